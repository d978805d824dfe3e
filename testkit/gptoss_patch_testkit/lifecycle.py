"""A generic lifecycle check of every :class:`~gptoss_patch.registry.PatchSpec` on the installed release's real targets.

What ddtrace's ``PatchTestCase`` does for each integration, here for each patch of the installed row's layout plus
the GPT-OSS guard (:data:`gptoss_patch.patches.guard.PATCHES`), in a fresh interpreter per import order (the ``.pth``
finder is taken out of ``sys.meta_path`` so that activation happens exactly where the check says):

* ``import-first``: every target module (and every module that binds a target by value, ``rebind_keys``) is imported,
  the original objects are recorded, then ``activate()``;
* ``activate-first``: ``activate()``, the patches are pending, then the modules are imported (the post-import hooks
  apply them).

Then in both: ``activate()`` again (nothing re-wrapped), ``deactivate()`` (originals restored, by value too;
``docs/upstream.md`` §7.5), ``activate()`` once more (one-way: nothing re-applied, the guard stays armed).

:func:`observe` returns, per patch and step, what was found: whether the live attribute is our wrapper, carries the
patch's marker, wraps the original object; whether the by-value names hold the wrapper; whether the original ever
carried the marker. Tests (``tests/cell/test_lifecycle.py``, ``tests/cell/native_015/test_native_lifecycle.py``) assert
on these values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ORDERS = ("import-first", "activate-first")

CHILD = r"""
import importlib, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "_gptoss_patch_hook"]
ORDER = sys.argv[1]
from gptoss_patch import environment, matrix
from gptoss_patch.patches import guard, layout_plan
from gptoss_patch.fingerprint import split_target
from gptoss_patch.registry import MARKER

versions = environment.installed_versions()
row = next(r for r in matrix.ROWS if r.vllm_ascend == versions.vllm_ascend)
layout = row.layout if row.verdict == matrix.APPLY else None
plan = [(s, t, [matrix.LAYOUTS[layout][k] for k in s.rebind_keys]) for s, t in layout_plan(layout)]
plan += [(s, guard.TARGET, []) for s in guard.PATCHES]


def live(target):
    module, qualname = split_target(target)
    parent = importlib.import_module(module)
    *path, attribute = qualname.split(".")
    for part in path:
        parent = getattr(parent, part)
    raw = parent.__dict__[attribute] if isinstance(parent, type) else getattr(parent, attribute)
    return parent, attribute, raw


def import_all():
    if any(rebinds for _, _, rebinds in plan):  # the model runner binds the graph update by value (layouts B, C, E)
        from gptoss_patch_testkit.harness import importable_model_runner

        importable_model_runner()
    for spec, target, rebinds in plan:
        importlib.import_module(split_target(target)[0])
        for module in rebinds:
            importlib.import_module(module)


originals = {}


def record_originals():
    for spec, target, rebinds in plan:
        parent, attribute, raw = live(target)
        originals[spec.name] = raw


def observe(step):
    import gptoss_patch

    states = {p.name: p.state for p in gptoss_patch.status().patches}
    out = {}
    for spec, target, rebinds in plan:
        parent, attribute, raw = live(target)
        if spec.name not in originals:  # activate-first: the original is what our wrapper wraps
            originals[spec.name] = getattr(raw, "__wrapped__", raw) if getattr(raw, MARKER, None) else raw
        original = originals[spec.name]
        wrapped = getattr(raw, MARKER, None) == spec.name
        by_value = {}
        for module in rebinds:
            mod = sys.modules.get(module)
            if mod is not None and attribute in mod.__dict__:
                held = mod.__dict__[attribute]
                by_value[module] = "wrapper" if held is raw and wrapped else (
                    "original" if held is getattr(original, "__func__", original) or held is original else "other")
        inner = getattr(raw, "__wrapped__", None)
        out[spec.name] = {
            "wrapped": wrapped,
            "wraps_original": wrapped and inner is original,
            "double": wrapped and getattr(inner, MARKER, None) is not None,
            "is_original": raw is original,
            "original_marked": getattr(original, MARKER, None) is not None,
            "by_value": by_value,
            "state": states.get(spec.name, "guard" if spec.name.startswith("guard.") else None),
            "id": id(raw),
        }
    return out


import gptoss_patch

steps = {}
if ORDER == "import-first":
    import_all()
    record_originals()
    gptoss_patch.activate(source="lifecycle")
    steps["activated"] = observe("activated")
else:
    gptoss_patch.activate(source="lifecycle")
    steps["pending"] = {p.name: p.state for p in gptoss_patch.status().patches}
    import_all()
    steps["activated"] = observe("activated")
gptoss_patch.activate(source="lifecycle")
steps["activated_twice"] = observe("activated_twice")
gptoss_patch.deactivate()
steps["deactivated"] = observe("deactivated")
gptoss_patch.activate(source="lifecycle")
steps["activated_after_deactivate"] = observe("activated_after_deactivate")
st = gptoss_patch.status()
print("RESULT " + json.dumps({"layout": layout, "decision": st.decision, "sources": st.sources,
                              "patches": [s.name for s, _, _ in plan], "steps": steps}))
"""


def observe(order: str, env: dict | None = None, timeout: float = 900) -> dict:
    """Run the lifecycle in a fresh interpreter of this venv with import order ``order`` (:data:`ORDERS`)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {ORDERS}")
    proc = subprocess.run([sys.executable, "-c", CHILD, order], capture_output=True, text=True,
                          env=dict(os.environ if env is None else env), timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"lifecycle child gave no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def assert_lifecycle(result: dict, order: str) -> None:
    """The lifecycle contract, on :func:`observe`'s ``result`` for ``order``; raises AssertionError naming the step.

    Every patch: applied as our marked wrapper around the original object (never around another wrapper), the
    by-value names rebound to it; a second ``activate()`` changes nothing. ``deactivate()`` restores every layout
    patch's original object, by value too, and leaves the guard armed; a later ``activate()`` re-applies nothing
    (one-way, :func:`gptoss_patch._activation.deactivate`).
    """
    steps = result["steps"]
    guard = [n for n in result["patches"] if n.startswith("guard.")]
    layout_patches = [n for n in result["patches"] if n not in guard]
    assert guard == ["guard.gpt_oss_model"], result["patches"]
    if order == "activate-first":
        assert steps["pending"] == {n: "pending" for n in layout_patches}, steps["pending"]
    for name in result["patches"]:
        on = steps["activated"][name]
        assert on["wrapped"] and on["wraps_original"] and not on["double"] and not on["is_original"], (name, on)
        assert not on["original_marked"], (name, "the marker leaked onto the original")
        assert set(on["by_value"].values()) <= {"wrapper"}, (name, on["by_value"])
        twice = steps["activated_twice"][name]
        assert twice["id"] == on["id"] and twice["wrapped"] and not twice["double"], (name, "re-wrapped", twice)
        for step in ("deactivated", "activated_after_deactivate"):
            off = steps[step][name]
            if name in guard:  # the guard stays armed after deactivate()
                assert off["wrapped"] and off["id"] == on["id"], (step, name, off)
                continue
            assert off["is_original"] and not off["wrapped"] and not off["original_marked"], (step, name, off)
            assert set(off["by_value"].values()) <= {"original"}, (step, name, off["by_value"])
            assert off["by_value"].keys() == on["by_value"].keys(), (step, name)
            assert off["state"] == "skipped", (step, name, off["state"])
        if name in layout_patches:
            assert on["state"] == "applied", (name, on["state"])
