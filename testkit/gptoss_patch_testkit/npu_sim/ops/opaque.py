"""Emulated operators that TorchDynamo must see as single graph nodes, as it sees the real torch_npu operators.

The real ``torch_npu.npu_rms_norm`` etc. are C++ operators (``torch.ops.npu.*``): when vLLM compiles a model
(``@support_torch_compile``; PIECEWISE graph mode), TorchDynamo records each call as one node of the FX graph and never
looks inside. The simulator's operators are Python functions with data-dependent checks (``int(positions.max())``) and
graph-capture bookkeeping (``graph.route``) that must run at *call* time, not once at trace time. So each operator that
runs inside a compiled region is registered here as a PyTorch custom operator ``gptoss_sim::<name>`` (a schema as
torch_npu declares it in op-plugin's ``op_plugin_functions.yaml``, our emulation as the implementation, a shape-only
fake implementation for tracing), and ``torch_npu.<name>`` becomes a thin caller of that custom operator. Eagerly this
changes nothing but one dispatcher hop.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["SCHEMAS", "make_opaque"]


def _fake_rms_norm(x, gamma, epsilon=1e-6):
    nd = gamma.dim()
    return torch.empty_like(x), x.new_empty(tuple(x.shape[:-nd]) + (1,) * nd, dtype=torch.float32)


def _fake_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    y, rstd = _fake_rms_norm(x1, gamma, epsilon)
    return y, rstd, torch.empty_like(x1)


def _fake_rotary(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    return torch.empty_like(query), torch.empty_like(key)


#: name -> (schema without the name, fake implementation). Schemas follow op-plugin's declarations of the same ops.
SCHEMAS: dict[str, tuple[str, Callable[..., Any]]] = {
    "npu_rms_norm": ("(Tensor x, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)", _fake_rms_norm),
    "npu_add_rms_norm": ("(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
                         _fake_add_rms_norm),
    # in place on the device; here a functional node returning the rotated copies, which the caller writes back with
    # ``copy_`` (a mutating custom op would be wrapped by functionalization in ``auto_functionalized``, a
    # higher-order operator that graph capture would have to interpret)
    "_npu_rotary_embedding": ("(Tensor positions, Tensor query, Tensor key, int head_size, Tensor cos_sin_cache, "
                              "bool is_neox_style) -> (Tensor, Tensor)", _fake_rotary),
}

#: Operators that work in place on the device: the custom operator returns the new values of these arguments and
#: the caller copies them back (see :data:`SCHEMAS`).
IN_PLACE = {"_npu_rotary_embedding": ("query", "key")}

_lib = None


def make_opaque(ops: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Register each operator of :data:`SCHEMAS` found in ``ops`` as ``torch.ops.gptoss_sim.<name>`` (implementation:
    the emulated ``ops[name]``) and return ``ops`` with those entries replaced by callers of the custom operator.
    Idempotent per process (a second call returns the callers made by the first)."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library("gptoss_sim", "DEF")
        for name, (schema, fake) in SCHEMAS.items():
            if name not in ops:
                continue
            _lib.define(name + schema)
            _lib.impl(name, _functional(name, ops[name]) if name in IN_PLACE else ops[name], "CompositeExplicitAutograd")
            torch.library.register_fake(f"gptoss_sim::{name}", fake, lib=_lib)
    out = dict(ops)
    for name in SCHEMAS:
        if name in ops:
            out[name] = _caller(name, ops[name])
    return out


def _functional(name: str, emulated: Callable[..., Any]) -> Callable[..., Any]:
    """The in-place ``emulated`` run on copies of its :data:`IN_PLACE` arguments, returning the copies."""
    import inspect

    sig = inspect.signature(getattr(emulated, "__wrapped__", emulated))

    def impl(*args: Any, **kwargs: Any) -> tuple:
        bound = sig.bind(*args, **kwargs)
        for arg in IN_PLACE[name]:
            bound.arguments[arg] = bound.arguments[arg].clone()
        emulated(*bound.args, **bound.kwargs)
        return tuple(bound.arguments[arg] for arg in IN_PLACE[name])

    return impl


def _caller(name: str, emulated: Callable[..., Any]) -> Callable[..., Any]:
    packet = getattr(torch.ops.gptoss_sim, name)
    if name in IN_PLACE:
        import inspect

        sig = inspect.signature(getattr(emulated, "__wrapped__", emulated))

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            new = packet(*bound.args, **bound.kwargs)
            for arg, value in zip(IN_PLACE[name], new):
                bound.arguments[arg].copy_(value)
            return None
    else:
        def call(*args: Any, **kwargs: Any) -> Any:
            return packet(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``torch_npu.{name}`` through the custom operator ``gptoss_sim::{name}``: {emulated.__doc__}"
    call.__wrapped__ = emulated  # type: ignore[attr-defined]
    return call
