"""``python -m gptoss_patch.verify``: is this stack covered, what was patched, are the numbers right.

Prints the installed versions, the version-matrix decision and its reason, the state of every
patch, and proves activation the way a real deployment sees it: in a fresh child interpreter
(``python -c "import vllm_ascend..."``, i.e. through the ``.pth`` start-up hook) and in a
``multiprocessing`` *spawn* child (how vLLM starts workers).

Usage::

    python -m gptoss_patch.verify [--json] [--simulate] [--matrix] [--no-children]

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
from typing import Any

#: Modules whose import triggers every patch target of a release (the attention module for now).
_PROBE_MODULES = ("vllm_ascend.attention.attention_v1",)

_CHILD_CODE = (
    "import json, importlib, gptoss_patch\n"
    "err = None\n"
    "try:\n"
    "    for m in {mods!r}: importlib.import_module(m)\n"
    "except Exception as e:\n"
    "    err = '%s: %s' % (type(e).__name__, e)\n"
    "d = gptoss_patch.status().as_dict(); d['import_error'] = err\n"
    "print('GPTOSS_STATUS ' + json.dumps(d))\n"
)


def _import_targets() -> str | None:
    """Import the probe modules so the post-import hooks fire; returns an error text or None."""
    import importlib

    try:
        for m in _PROBE_MODULES:
            importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001 - reported to the user
        return f"{type(exc).__name__}: {exc}"
    return None


def child_interpreter_status(env: dict | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Run a fresh ``python`` that imports vllm-ascend's patched modules; return its status dict.

    Activation there comes only from the installed ``.pth`` (nothing is passed in but the
    environment). Keys as :meth:`gptoss_patch.registry.Status.as_dict` plus ``import_error``;
    on a crash, ``{"error": ...}``.
    """
    code = _CHILD_CODE.format(mods=_PROBE_MODULES)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("GPTOSS_STATUS "):
            return json.loads(line[len("GPTOSS_STATUS "):])
    return {"error": f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"}


def _spawn_target(queue: Any) -> None:
    import importlib

    import gptoss_patch

    err = None
    try:
        for m in _PROBE_MODULES:
            importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}"
    d = gptoss_patch.status().as_dict()
    d["import_error"] = err
    queue.put(d)


def spawn_child_status(timeout: float = 300.0) -> dict[str, Any]:
    """Status seen by a ``multiprocessing`` spawn child that imports the patched modules."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawn_target, args=(queue,))
    proc.start()
    try:
        result = queue.get(timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        result = {"error": f"spawn child gave no status: {type(exc).__name__}: {exc}"}
    proc.join(timeout=30)
    return result


def _child_ok(d: dict[str, Any], decision: str | None) -> bool:
    return "error" not in d and d.get("decision") == decision and bool(d.get("ok")) and not d.get("import_error")


def collect(simulate: bool = False, children: bool = True) -> dict[str, Any]:
    """Gather the full report as a JSON-ready dict (the ``--json`` output)."""
    import gptoss_patch
    from gptoss_patch import environment

    report: dict[str, Any] = {"problems": []}
    if simulate:
        os.environ["GPTOSS_PATCH_SIMULATE_NPU"] = "1"
        from gptoss_patch.testing import npu_sim

        npu_sim.install()
    versions = environment.installed_versions()
    if versions.vllm_ascend is None:
        report["problems"].append("vllm-ascend is not installed: gptoss-patch patches vllm-ascend and has nothing "
                                  "to do without it (pip install vllm-ascend==0.11.0 vllm==0.11.0)")
    status = gptoss_patch.activate(source="verify")
    import_error = None
    if status.decision == "apply":
        import_error = _import_targets()
        if import_error:
            report["problems"].append(f"importing vllm-ascend failed: {import_error}")
        status = gptoss_patch.status()
    report["status"] = status.as_dict()
    if status.decision == "refuse" and versions.vllm_ascend is not None:
        report["problems"].append(f"stack not covered: {status.reason}")
    for p in status.patches:
        if p.state != "applied":
            report["problems"].append(f"patch {p.name} is {p.state}: {p.reason}")
    if children and status.decision in ("apply", "stand-down") and not import_error:
        fresh = child_interpreter_status()
        spawned = spawn_child_status()
        report["children"] = {"fresh_interpreter": fresh, "spawn": spawned}
        for label, d in (("fresh interpreter", fresh), ("spawned child", spawned)):
            if not _child_ok(d, status.decision):
                why = d.get("error") or d.get("import_error") or d.get("reason")
                report["problems"].append(f"activation not proven in a {label}: {why}")
    if simulate and status.decision == "apply" and not import_error:
        job = run_main_job()
        report["main_job"] = job
        if not job.get("ok"):
            report["problems"].append("the simulated GPT-OSS run did not reproduce the reference: "
                                      + (job.get("error") or "token or logit mismatch (see main job report)"))
    report["ok"] = not report["problems"]
    return report


def run_main_job(steps: int = 32, timeout: float = 1800.0) -> dict[str, Any]:
    """Run :mod:`gptoss_patch.testing.main_job` in a child interpreter on the simulator; its JSON report.

    A child keeps vLLM's process-wide state (distributed groups, current config) out of this process.
    """
    env = dict(os.environ, GPTOSS_PATCH_SIMULATE_NPU="1", VLLM_LOGGING_STREAM="ext://sys.stderr",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.testing.main_job", "--json", "--steps", str(steps)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = proc.stderr.strip().splitlines()[-3:]
    return {"ok": False, "error": f"main job exited {proc.returncode}: {' | '.join(tail)}"}


def _print_human(report: dict[str, Any]) -> None:
    st = report["status"]
    v = st["versions"]
    print("gptoss-patch verify")
    print(f"  vllm-ascend {v['vllm_ascend'] or 'not installed'} | vllm {v['vllm'] or 'not installed'} | "
          f"torch {v['torch'] or '-'} | torch-npu {v['torch_npu'] or ('simulated' if v['simulated_npu'] else '-')} | "
          f"CANN {v['cann']} | Python {v['python']}")
    print(f"  decision: {st['decision']}{' (FORCED)' if st['forced'] else ''} - {st['reason']}")
    for gap in st.get("gaps", []):
        print(f"    upstream gap still open in this release: {gap}")
    for key, value in st.get("details", {}).items():
        print(f"  {key.replace('_', ' ')}: {value}")
    if st["patches"]:
        print("  patches:")
        for p in st["patches"]:
            print(f"    [{p['state']:>7}] {p['name']:<28} {p['target']}")
            if p["state"] != "applied":
                print(f"              {p['reason']}")
    for label, d in report.get("children", {}).items():
        ok = "error" not in d and d.get("ok") and not d.get("import_error")
        print(f"  activation in {label.replace('_', ' ')}: {'ok' if ok else 'FAILED'} "
              f"({d.get('decision')}, {sum(p['state'] == 'applied' for p in d.get('patches', []))} patches applied)")
    job = report.get("main_job")
    if job and "conversations" in job:
        print(f"  simulated GPT-OSS run ({job['mode']}; vLLM GptOssForCausalLM on patched vllm-ascend vs transformers):")
        print(f"    attention states: {', '.join(job['states_seen'])}; prefix-cache blocks reused: "
              f"{job['reused_prefix_blocks']}")
        for i, c in enumerate(job["conversations"]):
            print(f"    conversation {i}: prompt {c['prompt_tokens']} tokens, tokens matched {c['matched']}/{c['compared']}, "
                  f"max |logit diff| {c['max_logit_diff']:.1e} (tolerance {job['logit_tolerance']:g})")
        print(f"    conversation 0 decoded: {job['decoded_first'][:120]!r}")
        print(f"    harmony channels: {job['harmony_parse']}")
        print(f"    time (s): {job['seconds']}")
    if report["problems"]:
        print("  PROBLEMS:")
        for p in report["problems"]:
            print(f"    - {p}")
    print("  result: " + ("OK - this stack is covered" if report["ok"] else "NOT OK"))


def _print_matrix() -> None:
    from gptoss_patch import matrix

    rows = matrix.table()
    cols = ["vllm-ascend", "vllm", "torch / torch-npu", "CANN", "verdict", "tested", "note"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    print("  ".join(c.ljust(widths[c]) for c in cols[:-1]) + "  note")
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols[:-1]) + "  " + r["note"])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 problems, 2 usage error)."""
    ap = argparse.ArgumentParser(prog="python -m gptoss_patch.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--simulate", action="store_true",
                    help="run on the CPU NPU simulator (hosts without an NPU; sets GPTOSS_PATCH_SIMULATE_NPU=1)")
    ap.add_argument("--matrix", action="store_true", help="print the version matrix and exit")
    ap.add_argument("--no-children", action="store_true", help="skip the fresh-interpreter and spawn checks")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if args.matrix:
        if args.json:
            from gptoss_patch import matrix

            print(json.dumps(matrix.table(), indent=2))
        else:
            _print_matrix()
        return 0
    if args.json:
        # stdout must stay one JSON document: vLLM logs to stdout unless told otherwise (vllm/envs.py)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    report = collect(simulate=args.simulate, children=not args.no_children)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_human(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
