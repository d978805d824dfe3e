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


def _fake_none(*args, **kwargs):
    return None


#: name -> (schema without the name, fake implementation). Schemas follow op-plugin's declarations of the same ops.
SCHEMAS: dict[str, tuple[str, Callable[..., Any]]] = {
    "npu_rms_norm": ("(Tensor x, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)", _fake_rms_norm),
    "npu_add_rms_norm": ("(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
                         _fake_add_rms_norm),
    "_npu_rotary_embedding": ("(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
                              "Tensor cos_sin_cache, bool is_neox_style) -> ()", _fake_none),
}

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
            _lib.impl(name, ops[name], "CompositeExplicitAutograd")
            torch.library.register_fake(f"gptoss_sim::{name}", fake, lib=_lib)
    out = dict(ops)
    for name in SCHEMAS:
        if name in ops:
            out[name] = _caller(name, ops[name])
    return out


def _caller(name: str, emulated: Callable[..., Any]) -> Callable[..., Any]:
    packet = getattr(torch.ops.gptoss_sim, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        return packet(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``torch_npu.{name}`` through the custom operator ``gptoss_sim::{name}``: {emulated.__doc__}"
    call.__wrapped__ = emulated  # type: ignore[attr-defined]
    return call
