"""Emulated torch_npu operators, by name (``OPS``), gathered from the per-family modules.

Each operator implements its documented semantics (doc page cited in its docstring; see
``docs/operators.md``), validates the documented limits and raises ``RuntimeError``
like the operator does. Anything not listed here is a ``NotEmulated`` sentinel on ``torch_npu``.

Every operator in ``OPS`` (and its ``.out`` overload) is wrapped by
:func:`gptoss_patch_testkit.npu_sim.graph.route`, so that calls made during an NPU graph capture
are recorded, and calls inside a task-group update re-parameterise the captured call; outside a
graph the wrapper just calls the operator. The family modules keep their unwrapped functions.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from gptoss_patch_testkit.npu_sim.graph import route as _route

#: Modules contributing operators; each exports ``OPS: dict[str, Callable]``.
_FAMILIES = ("attention", "moe", "moe_distribute", "misc")

OPS: dict[str, Callable[..., Any]] = {}
for _family in _FAMILIES:
    try:
        _mod = importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as _exc:  # a family not written yet
        if _exc.name != f"{__name__}.{_family}":
            raise
        continue
    for _name, _fn in _mod.OPS.items():
        if _name in OPS:
            raise RuntimeError(f"emulated operator {_name!r} defined twice")
        OPS[_name] = _route(_name, _fn)

# Operators that run inside vLLM's compiled regions become opaque custom-operator nodes for TorchDynamo (opaque.py).
from gptoss_patch_testkit.npu_sim.ops.opaque import make_opaque as _make_opaque  # noqa: E402

OPS = _make_opaque(OPS)
