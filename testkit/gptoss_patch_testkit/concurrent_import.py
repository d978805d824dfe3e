"""Activation while another thread is still executing a target module (issue 32), in a fresh interpreter.

The reported failure: two threads' first imports of vllm-ascend modules left the attention patches "failed: target
not found" - ``wrapt`` runs a post-import hook at once when its module is already in ``sys.modules``, also when that
module is still executing in another thread and its target class is not defined yet. Here the interleaving is made
exact instead of hoped for: thread A imports the gated module, whose execution is held (after importlib has put it in
``sys.modules``, before its body runs) until the main thread has activated gptoss-patch (``activate()``, what the
``.pth`` hook and the vLLM plugin entry point call; the ``.pth`` finder is taken out so that nothing activates
earlier). Then A's import is let go, and the result says which patches ended applied, without any further import.

``old_hook=True`` replaces :meth:`gptoss_patch.registry.Registry.hook` by the behaviour before the fix (apply at
once, whatever state the module is in), to show the failure the test guards against.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "_gptoss_patch_hook"]
from gptoss_patch_testkit import npu_sim
npu_sim.install()
import importlib.abc, importlib.util
GATED, OLD_HOOK = sys.argv[1], sys.argv[2] == "1"
entered, release = threading.Event(), threading.Event()

class Gate(importlib.abc.MetaPathFinder):
    # holds the gated module's execution: importlib has put it in sys.modules, its body has not run
    def find_spec(self, name, path, target=None):
        if name != GATED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def held(module):
            entered.set()
            assert release.wait(300)
            run(module)
        spec.loader.exec_module = held
        return spec

sys.meta_path.insert(0, Gate())
errors = []
def importer():
    try:
        importlib.import_module(GATED)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
thread = threading.Thread(target=importer)
thread.start()
assert entered.wait(300), errors
import gptoss_patch
from gptoss_patch import _state, registry
if OLD_HOOK:
    registry.Registry.hook = registry.Registry._safe_on_import
gptoss_patch.activate(source="concurrent-import")
regs = [r for r in (_state.registry, _state.checkpoint, _state.guard) if r is not None]
mine = {n for r in regs for n, st in r.states.items() if st.target.startswith(GATED + ":")}
while_held = {n: st.state for r in regs for n, st in r.states.items() if n in mine}
release.set()
thread.join(300)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and any(st.state == "pending" for r in regs for n, st in r.states.items() if n in mine):
    time.sleep(0.01)
print("CONCURRENT-RESULT " + json.dumps({
    "errors": errors, "decision": _state.decision.verdict, "while_held": while_held,
    "states": {n: [st.state, st.reason] for r in regs for n, st in r.states.items() if n in mine},
    "deferred": [m for r in regs for m in r.deferred_history]}))
"""


def run(gated: str, old_hook: bool = False, timeout: float = 900) -> dict:
    """Run the interleaving for module ``gated`` (a target module of the row) in a fresh interpreter of this venv.

    Returns ``{"errors": [thread A's import errors], "decision": ..., "while_held": {patch: state while A was held},
    "states": {patch: [state, reason]} after A's import, "deferred": [modules deferred]}`` for the patches whose
    target is in ``gated``. Raises AssertionError when the child printed no result.
    """
    proc = subprocess.run([sys.executable, "-c", CHILD, gated, "1" if old_hook else "0"], capture_output=True,
                          text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CONCURRENT-RESULT ")), None)
    if line is None:
        raise AssertionError(f"no result (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(line[len("CONCURRENT-RESULT "):])


def check_old_hook_fails(gated: str) -> dict:
    """The negative control: with the hook of before the fix (``old_hook``), the same interleaving leaves every patch
    of ``gated`` "failed: target not found" and defers nothing. Raises AssertionError otherwise; returns the result."""
    old = run(gated, old_hook=True)
    assert old["errors"] == [] and old["deferred"] == [] and old["states"], old
    assert all(state == "failed" and "target not found" in reason for state, reason in old["states"].values()), old
    return old
