"""Serve recipes: ``vllm serve`` for GPT-OSS BF16 on vllm-ascend with gptoss-patch, one preset per model.

Usage::

    gptoss-patch-serve PRESET --model DIR [options] [-- extra vllm serve arguments]
    gptoss-patch-serve 120b-tp8 --model DIR --tokenizer-dir DIR [options]    # the seed deployment, 910B3 x 8
    gptoss-patch-serve 20b-tp1  --model DIR --tokenizer-dir DIR [options]
    python -m gptoss_patch.tools.serve PRESET ...                              # the same without the console script

What it does, in order:

1. builds the ``vllm serve`` command and its environment from the preset (:data:`PRESETS`), then the
   ``GPTOSS_SERVE_*`` environment variables, then the command-line flags (later wins);
2. checks the checkpoint when ``--model`` is a local directory (:func:`gptoss_patch.tools.checkpoint.check_checkpoint`
   at the chosen tensor-parallel size; skip with ``--no-model-check``);
3. ``--dry-run``: prints the environment it sets (``export`` lines) and the command, and exits 0;
4. runs ``python -m gptoss_patch.verify`` with that environment and refuses to start (exit 1) when it
   exits non-zero, unless ``--no-verify``;
5. replaces itself with ``vllm serve`` (:func:`os.execvpe`), so signals reach vLLM directly.

Why Python and not bash: the values come from three layers (preset, environment, flags) that need
validation with clear errors, the checkpoint check and the verify gate are Python anyway, and a
function returning ``(argv, env)`` is testable without starting anything.

Sources of the recipe values:

* 120b TP=8: the seed deployment write-up (gitcode Ascend-SACT, 910B3 x 8, vLLM 0.11.2 dev + fork):
  ``HCCL_INTRA_ROCE_ENABLE=1``, ``--gpu-memory-utilization 0.95``, ``--tensor-parallel-size 8``,
  ``--max-model-len 16384``, ``--compilation_config '{"cudagraph_mode": "PIECEWISE",
  "cudagraph_capture_sizes": [1024,512,256,128,64,16,4,2,1]}'``. vLLM 0.11.0's flag is
  ``--compilation-config`` (alias ``-O``; ``vllm/engine/arg_utils.py``); its ``FlexibleArgumentParser``
  also accepts the underscore spelling. The seed's ``IGNORE_GRAPH_UPDATE_EXCEPTIONS=0`` is not set:
  no released vllm-ascend file (0.11.0rc0 ... 0.30.0rc2) reads it, it is local to the fork.
* 20b TP=1: the 120b recipe at TP=1 (our choice: the seed author ran ``unsloth/gpt-oss-20b-BF16`` on
  1 x 910B3 (gitcode Ascend-SACT/GPT-OSS-20B-BF16-based-vllm-ascend) - but its launch line is not in our material; 20b BF16 is
  ~42 GB (20.9 B parameters x 2 bytes), inside one 64 GB 910B3 at 0.95). ``HCCL_INTRA_ROCE_ENABLE``
  is a multi-card setting and is only set for TP > 1.
* ``--reasoning-parser openai_gptoss`` (``vllm/reasoning/gptoss_reasoning_parser.py``) and
  ``--tool-call-parser openai --enable-auto-tool-choice``
  (``vllm/entrypoints/openai/tool_parsers/openai_tool_parser.py``), both registered under these names
  in vLLM 0.11.0; without them tool calls stay in ``content`` (vllm#22337) and reasoning may be lost
  (vllm#41902).
* Tokenizer: harmony reads ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`` or the cache-key file in
  ``$TIKTOKEN_RS_CACHE_DIR`` (vllm#22525, Ascend/sglang#150); ``gptoss-patch-tokenizer prepare
  DIR`` lays out both, and ``--tokenizer-dir DIR`` points all three variables at it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PRESETS", "ENV_PREFIX", "Recipe", "ServeError", "build", "main"]

#: Default capture sizes of the seed recipe (largest first, as written there).
SEED_CAPTURE_SIZES = (1024, 512, 256, 128, 64, 16, 4, 2, 1)

#: Recipes. Every key is overridable by ``--<key with dashes>`` or ``GPTOSS_SERVE_<KEY UPPER>``.
#: What every preset shares: the seed deployment's serving flags (PIECEWISE graphs with its capture sizes, the
#: reasoning and tool-call parsers).
_SEED_FLAGS: dict = {
    "gpu_memory_utilization": 0.95,
    "max_model_len": 16384,
    "cudagraph_mode": "PIECEWISE",
    "cudagraph_capture_sizes": SEED_CAPTURE_SIZES,
    "host": "0.0.0.0",
    "port": 8000,
    "reasoning_parser": "openai_gptoss",
    "tool_call_parser": "openai",
}

PRESETS: dict[str, dict] = {
    "120b-tp8": {"served_model_name": "gpt-oss-120b", "tensor_parallel_size": 8, **_SEED_FLAGS,
                 "bf16_release": "unsloth/gpt-oss-120b-BF16"},
    "20b-tp1": {"served_model_name": "gpt-oss-20b", "tensor_parallel_size": 1, **_SEED_FLAGS,
                "bf16_release": "unsloth/gpt-oss-20b-BF16"},
}

#: Environment variables ``GPTOSS_SERVE_<NAME>`` override preset values (flags override them in turn).
ENV_PREFIX = "GPTOSS_SERVE_"

#: Graph modes accepted by vLLM 0.11.0's ``CUDAGraphMode`` (``vllm/config/compilation.py``).
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

#: The three variables harmony / tiktoken read (see :mod:`gptoss_patch.tools.tokenizer`).
TOKENIZER_VARS = ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR", "TIKTOKEN_CACHE_DIR")


class ServeError(ValueError):
    """A recipe value is invalid or a prerequisite is missing; the message says what and what would be right."""


@dataclass
class Recipe:
    """The resolved launch: ``argv`` to exec, ``env_set`` (variables this recipe adds), full ``env``, notes."""

    preset: str
    argv: list[str]
    env_set: dict[str, str]
    env: dict[str, str]
    values: dict
    warnings: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The recipe as shell text: ``export`` lines for ``env_set``, then the quoted command."""
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env_set.items()]
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- parsing


def _positive_int(name: str, text) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ServeError(f"{name} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ServeError(f"{name} must be a positive integer, got {text!r}")
    return value


def _fraction(name: str, text) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ServeError(f"{name} must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise ServeError(f"{name} must be a number in (0, 1], got {text!r}")
    return value


def _sizes(name: str, text) -> tuple[int, ...]:
    if isinstance(text, (tuple, list)):
        items = list(text)
    else:
        items = [t for t in str(text).replace(" ", "").strip("[]").split(",") if t]
    if not items:
        raise ServeError(f"{name} must be a comma-separated list of positive integers like '1024,512,1', got {text!r}")
    return tuple(_positive_int(f"{name} entry", t) for t in items)


def _graph_mode(name: str, text) -> str:
    value = str(text).strip().upper()
    if value not in CUDAGRAPH_MODES:
        raise ServeError(f"{name} must be one of {', '.join(CUDAGRAPH_MODES)}, got {text!r}")
    return value


def _port(name: str, text) -> int:
    value = _positive_int(name, text)
    if value > 65535:
        raise ServeError(f"{name} must be in 1..65535, got {text!r}")
    return value


def _text(name: str, text) -> str:
    value = str(text).strip()
    if not value:
        raise ServeError(f"{name} must not be empty")
    return value


#: option -> (converter, help). Order = order in --help.
_OPTIONS = {
    "model": (_text, "checkpoint directory (BF16 release layout) or hub id; required"),
    "served_model_name": (_text, "model name clients send in requests"),
    "tensor_parallel_size": (_positive_int, "NPUs per model replica"),
    "gpu_memory_utilization": (_fraction, "fraction of NPU memory vLLM may use"),
    "max_model_len": (_positive_int, "maximum prompt + output tokens"),
    "cudagraph_mode": (_graph_mode, "ACL graph mode for --compilation-config (" + "/".join(CUDAGRAPH_MODES) + ")"),
    "cudagraph_capture_sizes": (_sizes, "comma-separated batch sizes captured as graphs"),
    "host": (_text, "address vLLM listens on"),
    "port": (_port, "port vLLM listens on"),
    "reasoning_parser": (_text, "vLLM reasoning parser"),
    "tool_call_parser": (_text, "vLLM tool-call parser"),
    "tokenizer_dir": (_text, "directory prepared by 'gptoss-patch-tokenizer prepare DIR' "
                             "(default: $TIKTOKEN_ENCODINGS_BASE)"),
}


def _parser(preset: str | None) -> argparse.ArgumentParser:
    from gptoss_patch._cli import prog as _prog

    prog = _prog("gptoss-patch-serve", "gptoss_patch.tools.serve") + (f" {preset}" if preset else " PRESET")
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Start vLLM serving GPT-OSS (BF16) on vllm-ascend with gptoss-patch. Values: preset < "
        f"{ENV_PREFIX}<OPTION> environment variables < flags. Arguments after '--' go to vllm serve unchanged.",
    )
    if preset is None:
        ap.add_argument("preset", choices=sorted(PRESETS))
    for key, (_, help_text) in _OPTIONS.items():
        default = PRESETS[preset].get(key) if preset else None
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        shown = f" (preset: {default})" if default is not None else ""
        ap.add_argument("--" + key.replace("_", "-"), dest=key, default=None,
                        help=f"{help_text}{shown}; env {ENV_PREFIX}{key.upper()}")
    ap.add_argument("--eager", action="store_true",
                    help="no graph capture: --enforce-eager instead of --compilation-config (env GPTOSS_SERVE_EAGER=1)")
    ap.add_argument("--no-tool-calls", action="store_true",
                    help="omit --tool-call-parser/--enable-auto-tool-choice (env GPTOSS_SERVE_NO_TOOL_CALLS=1)")
    ap.add_argument("--vllm-bin", default=None, help="vllm executable (default: the one next to this Python, "
                    "else PATH, else 'python -m vllm.entrypoints.cli.main'); env GPTOSS_SERVE_VLLM_BIN")
    ap.add_argument("--dry-run", action="store_true", help="print the environment and command, start nothing")
    ap.add_argument("--no-verify", action="store_true",
                    help="start even when 'python -m gptoss_patch.verify' fails (not recommended)")
    ap.add_argument("--no-model-check", action="store_true", help="skip the checkpoint check of --model")
    return ap


def _truthy(text: str | None) -> bool:
    return str(text or "").strip().lower() in ("1", "true", "yes", "on")


def _vllm_program(explicit: str | None) -> list[str]:
    if explicit:
        return shlex.split(explicit)
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("vllm")
    if found:
        return [found]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _check_tokenizer_dir(directory: str) -> None:
    from gptoss_patch.tools.tokenizer import O200K_URL, cache_key

    path = Path(directory)
    wanted = [path / "o200k_base.tiktoken", path / cache_key(O200K_URL)]
    missing = [str(p) for p in wanted if not p.is_file()]
    if missing:
        raise ServeError(
            f"tokenizer directory {directory} lacks {', '.join(missing)}: run "
            f"'gptoss-patch-tokenizer prepare {shlex.quote(directory)}' (offline; needs quicktok-v1 or "
            "--from o200k_base.tiktoken) first")


def build(preset: str, argv: list[str] | None = None, environ: dict | None = None) -> tuple[Recipe, argparse.Namespace]:
    """Resolve ``preset`` + ``environ`` (``GPTOSS_SERVE_*``) + ``argv`` flags into a :class:`Recipe`.

    ``preset``: a key of :data:`PRESETS`. ``argv``: the flags after the preset (``--model`` ...,
    then optionally ``--`` and extra ``vllm serve`` arguments, appended last so they win in vLLM's
    parser). ``environ``: default ``os.environ``; it is copied, never modified.
    Returns ``(recipe, parsed_args)``. Raises :class:`ServeError` for an unknown preset, a missing
    ``--model``, an invalid value (naming the option and the accepted form), a tokenizer directory
    without the prepared files, or no tokenizer directory at all; ``SystemExit`` for unknown flags
    (argparse).
    """
    if preset not in PRESETS:
        raise ServeError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    environ = dict(os.environ if environ is None else environ)
    argv = list(argv or [])
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = _parser(preset).parse_args(argv)
    values: dict = {}
    for key, (convert, _) in _OPTIONS.items():
        raw = getattr(args, key)
        origin = "--" + key.replace("_", "-")
        if raw is None and ENV_PREFIX + key.upper() in environ:
            raw, origin = environ[ENV_PREFIX + key.upper()], ENV_PREFIX + key.upper()
        if raw is None:
            raw = PRESETS[preset].get(key)
        if raw is None:
            values[key] = None
            continue
        values[key] = convert(origin, raw)
    eager = args.eager or _truthy(environ.get(ENV_PREFIX + "EAGER"))
    tools = not (args.no_tool_calls or _truthy(environ.get(ENV_PREFIX + "NO_TOOL_CALLS")))
    if ENV_PREFIX + "EXTRA_ARGS" in environ:
        extra = shlex.split(environ[ENV_PREFIX + "EXTRA_ARGS"]) + extra
    if not values["model"]:
        raise ServeError(f"no model: pass --model DIR (or set {ENV_PREFIX}MODEL), e.g. a local copy of "
                         f"{PRESETS[preset]['bf16_release']}")
    warnings: list[str] = []

    env_set: dict[str, str] = {}
    tok = values["tokenizer_dir"] or environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not tok:
        raise ServeError(
            "no harmony vocabulary: GPT-OSS needs o200k_base.tiktoken at start-up and an air-gapped host cannot "
            "download it (vllm#22525). Run 'gptoss-patch-tokenizer prepare DIR' and pass "
            f"--tokenizer-dir DIR (or set {ENV_PREFIX}TOKENIZER_DIR or TIKTOKEN_ENCODINGS_BASE)")
    tok = str(Path(tok).absolute())
    _check_tokenizer_dir(tok)
    for var in TOKENIZER_VARS:
        if values["tokenizer_dir"] or var not in environ:
            env_set[var] = tok
    tp = values["tensor_parallel_size"]
    if tp > 1 and "HCCL_INTRA_ROCE_ENABLE" not in environ:
        env_set["HCCL_INTRA_ROCE_ENABLE"] = "1"  # seed recipe: intra-node multi-card communication
    from gptoss_patch.tools.server_probe import plugin_filter_warning

    plugin_warning = plugin_filter_warning(environ)
    if plugin_warning:
        warnings.append(plugin_warning)

    cmd = _vllm_program(args.vllm_bin or environ.get(ENV_PREFIX + "VLLM_BIN"))
    cmd += ["serve", values["model"],
            "--served-model-name", values["served_model_name"],
            "--tensor-parallel-size", str(tp),
            "--gpu-memory-utilization", f"{values['gpu_memory_utilization']:g}",
            "--max-model-len", str(values["max_model_len"]),
            "--host", values["host"],
            "--port", str(values["port"])]
    if eager:
        cmd += ["--enforce-eager"]
    else:
        compilation = {"cudagraph_mode": values["cudagraph_mode"],
                       "cudagraph_capture_sizes": list(values["cudagraph_capture_sizes"])}
        cmd += ["--compilation-config", json.dumps(compilation, separators=(",", ":"))]
    cmd += ["--reasoning-parser", values["reasoning_parser"]]
    if tools:
        cmd += ["--tool-call-parser", values["tool_call_parser"], "--enable-auto-tool-choice"]
    cmd += extra
    env = dict(environ)
    env.update(env_set)
    values.update(eager=eager, tool_calls=tools, extra_args=extra)
    return Recipe(preset=preset, argv=cmd, env_set=env_set, env=env, values=values, warnings=warnings), args


def _model_check(recipe: Recipe) -> list[str]:
    """Checkpoint problems of a local ``--model`` directory (empty for a hub id or a good checkpoint)."""
    model = recipe.values["model"]
    path = Path(model)
    if not path.exists():
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model):
            hub_id = PRESETS[recipe.preset]["bf16_release"]
            return [f"--model {model}: no such directory (and not a hub id like {hub_id})"]
        recipe.warnings.append(f"--model {model} is not a local directory (a hub id?): checkpoint not checked")
        return []
    from gptoss_patch.tools.checkpoint import check_checkpoint

    try:
        report = check_checkpoint(path, tp=recipe.values["tensor_parallel_size"])
    except ImportError as exc:
        return [f"cannot check --model {model}: {exc} (pip install safetensors numpy, or pass --no-model-check)"]
    except (OSError, ValueError) as exc:
        return [f"--model {model}: {exc}"]
    recipe.warnings.extend(report.warnings)
    return list(report.problems)


def run_verify(env: dict, timeout: float = 1800.0) -> tuple[int, str]:
    """Run ``python -m gptoss_patch.verify`` (this interpreter) with ``env``; returns (exit status, output)."""
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``gptoss-patch-serve PRESET ...``); returns an exit status or execs vLLM.

    Exit 0 after ``--dry-run``; 1 when the checkpoint check or verify fails (nothing started); 2 on
    invalid options; 127 when the vllm program cannot be executed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in PRESETS:
        if argv and argv[0] not in ("-h", "--help"):
            where = " (the preset comes first)" if any(a in PRESETS for a in argv) else ""
            print(f"error: unknown preset {argv[0]!r}{where}; known: {', '.join(sorted(PRESETS))}", file=sys.stderr)
            return 2
        _parser(None).print_help(sys.stdout if argv else sys.stderr)
        if not argv:
            print(f"error: a preset is required: {', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 0 if argv else 2
    preset, rest = argv[0], argv[1:]
    try:
        recipe, args = build(preset, rest)
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse already printed the message
        return 2 if exc.code else 0
    problems = [] if args.no_model_check else _model_check(recipe)
    for w in recipe.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if problems:
        print("error: the checkpoint cannot be served (skip with --no-model-check):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(recipe.shell())
        return 0
    if args.no_verify:
        print("warning: --no-verify: starting without 'python -m gptoss_patch.verify'", file=sys.stderr)
    else:
        status, output = run_verify(recipe.env)
        if status != 0:
            print(output, file=sys.stderr)
            print(f"error: 'python -m gptoss_patch.verify' exited {status}; refusing to start vLLM on a stack "
                  "gptoss-patch does not cover (override with --no-verify)", file=sys.stderr)
            return 1
    print(recipe.shell(), file=sys.stderr)
    sys.stderr.flush()
    try:
        os.execvpe(recipe.argv[0], recipe.argv, recipe.env)
    except OSError as exc:
        print(f"error: cannot execute {recipe.argv[0]}: {exc} (pass --vllm-bin)", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
