"""Emulated torch_npu operators, by name (``OPS``), gathered from the per-family modules.

Each operator implements its documented semantics (doc page cited in its docstring; see
``shared/reference/npu_ops.md``), validates the documented limits and raises ``RuntimeError``
like the operator does. Anything not listed here is a ``NotEmulated`` sentinel on ``torch_npu``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

#: Modules contributing operators; each exports ``OPS: dict[str, Callable]``.
_FAMILIES = ("attention", "moe", "misc")

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
        OPS[_name] = _fn
