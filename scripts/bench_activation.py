#!/usr/bin/env python3
"""Benchmark: what activating gptoss-patch costs one process (each vLLM worker pays it once).

Run it with the python of a cell venv (e.g. ``~/.cache/gptoss-patch/venvs/cell-0.11.0-*/bin/python``). Each run is a
fresh interpreter on the CPU NPU simulator (``GPTOSS_PATCH_SIMULATE_NPU=1``) that first imports every module the
active layout patches (vllm-ascend, vLLM, torch: upstream's own cost, not counted) with the ``.pth`` finder taken
out of ``sys.meta_path``, then times, separately:

* ``activate()``: the decision and every patch applied (the post-import hooks run at once, their modules being
  imported), i.e. what a worker pays on its import path;
* ``status()`` afterwards: the drift classification of the applied targets (``docs/upstream.md`` §6), which is
  computed when ``status()`` / ``verify`` asks for it, not on the import path.

Prints the median of ``--runs`` processes (default 7). Usage: ``python scripts/bench_activation.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "_gptoss_patch_hook"]  # the .pth finder: we time by hand
from gptoss_patch import environment, matrix, patches
versions = environment.installed_versions()
row = next((r for r in matrix.ROWS if r.vllm_ascend == versions.vllm_ascend), None)
import importlib
for spec, target in patches.layout_plan(row.layout if row else None):
    importlib.import_module(target.partition(":")[0])
import gptoss_patch
t0 = time.perf_counter()
st = gptoss_patch.activate(source="bench")
t1 = time.perf_counter()
st = gptoss_patch.status()
drifts = [p.drift for p in st.patches]
t2 = time.perf_counter()
print(json.dumps({"activate": t1 - t0, "status": t2 - t1, "decision": st.decision, "layout": st.layout,
                  "applied": sum(p.state == "applied" for p in st.patches), "patches": len(st.patches),
                  "drift": sum(d is not None for d in drifts)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh processes (default 7)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}
    env.update(GPTOSS_PATCH_SIMULATE_NPU="1", OMP_NUM_THREADS="1")
    results = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD], check=True, env=env, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    last = results[-1]
    act = statistics.median(r["activate"] for r in results) * 1e3
    sta = statistics.median(r["status"] for r in results) * 1e3
    print(f"activation per process, {args.runs} fresh interpreters ({sys.executable})")
    print(f"  decision {last['decision']} (layout {last['layout']}), {last['applied']}/{last['patches']} patches "
          f"applied, {last['drift']} drift verdicts")
    print(f"  activate() (decide, register, apply): median {act:.1f} ms")
    print(f"  status() afterwards (drift verdicts):  median {sta:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
