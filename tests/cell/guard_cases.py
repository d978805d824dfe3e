"""Guard cases shared by the patched cells (test_guard.py) and the native rows with a function target (layout G,
native_015/test_native_guard.py): imported by name into each, so that each cell runs them with its own vllm-ascend."""

import json
import subprocess
import sys

FUNCTION_REBOUND = """
import json, sys, importlib
from gptoss_patch_testkit import npu_sim
npu_sim.install()
import gptoss_patch
from gptoss_patch.fingerprint import split_target
from gptoss_patch.patches import guard
import vllm_ascend  # activates (the .pth hook)
functions = [p for p in gptoss_patch.status().patches if "." not in split_target(p.target)[1]]
for p in functions:
    importlib.import_module(split_target(p.target)[0])
status = gptoss_patch.status()
names = {p.name for p in functions}
out = {"functions": {p.name: p.state for p in status.patches if p.name in names},
       "clean": guard.unpatched_functions(status.patches, status.layout), "reverted": {}}
for p in functions:
    module, name = split_target(p.target)
    mod = sys.modules[module]
    ours = mod.__dict__[name]
    setattr(mod, name, ours.__wrapped__)  # something re-binds upstream's function after us
    out["reverted"][p.name] = guard.unpatched_functions(gptoss_patch.status().patches, status.layout)
    setattr(mod, name, ours)
print("FN-RESULT " + json.dumps(out))
"""


def test_a_patched_function_rebound_to_upstreams_is_named():
    """Issue 32: the guard checked only ``Class.method`` targets against the code that runs. A module-level function
    target (``moe_mlp.unified_apply_mlp`` / ``unquant_apply_mlp``, the ACL-graph update function) re-bound to
    upstream's function after we wrapped it runs upstream's code while its patch reads *applied*:
    :func:`gptoss_patch.patches.guard.unpatched_functions` (part of the guard's ``check_runs``) names it, each
    function in turn, and names nothing while ours is in place."""
    proc = subprocess.run([sys.executable, "-c", FUNCTION_REBOUND], capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FN-RESULT ")), None)
    assert line is not None, f"no result (rc {proc.returncode}): {proc.stderr[-3000:]}"
    out = json.loads(line[len("FN-RESULT "):])
    print(out)
    assert out["functions"] and set(out["functions"].values()) == {"applied"}, out
    assert out["clean"] == [], out
    for name, problems in out["reverted"].items():
        assert len(problems) == 1 and problems[0].startswith(f"{name}: ") and "not the patched function" in problems[0]
