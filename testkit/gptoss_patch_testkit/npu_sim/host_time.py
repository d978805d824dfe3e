"""Host-time benchmark switch of the simulator: attention operators that return preallocated results.

On an NPU, a torch_npu operator call costs the host only its launch; the kernel runs on the device. On
the simulator the "kernel" runs on the host, so timing a Python forward that calls simulated operators
measures mostly the emulation. :func:`host_time_only` removes that: inside it, the attention-family
operators of the simulated ``torch_npu`` skip emulation and validation and hand back a preallocated tensor
of the result's shape and dtype (the same tensor every call of that shape), or write nothing into ``out``
/ cache arguments. What remains measurable is the host-side Python of the caller (vllm-ascend's forward,
our patch), plus one cheap Python call per operator that is identical for every caller.

**Results are garbage inside the switch** (never compare values computed there); it is for
``scripts/bench_attention.py`` only. It is not an emulation mode and changes nothing outside the ``with``.

Covered operators (each replaced on the simulated ``torch_npu`` module object for the duration; callers that
look the operator up as ``torch_npu.X`` at call time, as vllm-ascend and gptoss-patch do, get the stub):

* ``npu_fused_infer_attention_score`` / ``_v2`` (functional): ``(out, softmax_lse)`` with ``out`` of the
  documented output shape for ``TND`` (``(T, N, Dv)``) and ``BSH`` (``(B, S, N*Dv)``) layouts (docs/operators.md §3.7),
  ``softmax_lse`` ``(T, N, 1)`` float32 when requested, else the documented ``(1,)`` zero tensor. Other layouts
  raise :class:`~gptoss_patch_testkit.npu_sim._base.NotEmulatedError`.
* their ``.out`` overloads and the ``_get_max_workspace`` helpers: return the given buffers / a preallocated
  workspace.
* ``_npu_reshape_and_cache``, ``_npu_paged_attention`` (+ ``_get_workspace``): write nothing.

It also suspends, in the calling thread, the simulator's device-mapping ``TorchFunctionMode``
(:func:`gptoss_patch_testkit.npu_sim.device.enter_device_mapping`): that mode runs Python on *every* torch call
(~25 µs each on this machine kind) to rewrite ``device="npu"``, a cost the real torch_npu does not have, and would
otherwise dominate the measurement. Inside the switch a request for the ``npu`` device therefore fails loudly
(PyTorch has no PrivateUse1 backend registered) instead of landing on the CPU - allocate before entering.

Not thread-safe: it swaps module attributes process-wide.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

from gptoss_patch_testkit.npu_sim._base import NotEmulatedError

_buffers: dict[tuple, torch.Tensor] = {}


def _buffer(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    key = (shape, dtype)
    buf = _buffers.get(key)
    if buf is None:
        buf = _buffers[key] = torch.zeros(shape, dtype=dtype)
    return buf


def _fia_result(query: torch.Tensor, value: torch.Tensor, kwargs: dict, heads_key: str, lse_key: str):
    n = int(kwargs.get(heads_key, 1))
    kvn = int(kwargs.get("num_key_value_heads", 0)) or n
    layout = kwargs.get("input_layout", "BSH")
    paged = kwargs.get("block_table") is not None
    if paged and value.dim() == 4:  # (num_blocks, KV_N, block_size, Dv)
        dv = value.shape[3]
    elif paged or layout == "BSH":  # (num_blocks, block_size, KV_N*Dv) / (B, S, KV_N*Dv)
        dv = value.shape[-1] // kvn
    else:  # TND (T_kv, KV_N, Dv)
        dv = value.shape[-1]
    if layout == "TND":
        out = _buffer((query.shape[0], n, dv), query.dtype)
        lse_shape = (query.shape[0], n, 1)
    elif layout == "BSH":
        out = _buffer((query.shape[0], query.shape[1], n * dv), query.dtype)
        lse_shape = (query.shape[0], n, query.shape[1], 1)
    else:
        raise NotEmulatedError(f"host_time_only covers input_layout TND and BSH, got {layout!r}")
    lse = _buffer(lse_shape, torch.float32) if kwargs.get(lse_key) else _buffer((1,), torch.float32)
    return out, lse


def _fia_v1(query, key, value, **kwargs):
    return _fia_result(query, value, kwargs, "num_heads", "softmax_lse_flag")


def _fia_v2(query, key, value, **kwargs):
    return _fia_result(query, value, kwargs, "num_query_heads", "return_softmax_lse")


def _fia_out(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
    return tuple(out) if out is not None else (attention_out, softmax_lse)


def _workspace(*args, **kwargs):
    return _buffer((64,), torch.uint8)


def _nothing(*args, **kwargs):
    return None


_fia_v1.out = _fia_out  # type: ignore[attr-defined]
_fia_v2.out = _fia_out  # type: ignore[attr-defined]

#: torch_npu attribute -> stub used inside :func:`host_time_only`.
STUBS: dict[str, Any] = {
    "npu_fused_infer_attention_score": _fia_v1,
    "npu_fused_infer_attention_score_v2": _fia_v2,
    "_npu_fused_infer_attention_score_get_max_workspace": _workspace,
    "_npu_fused_infer_attention_score_v2_get_max_workspace": _workspace,
    "_npu_reshape_and_cache": _nothing,
    "_npu_paged_attention": _nothing,
    "_npu_paged_attention_get_workspace": _workspace,
}


@contextlib.contextmanager
def host_time_only() -> Iterator[None]:
    """Within the ``with``, the simulated attention operators return preallocated results (see module doc).

    Raises:
        RuntimeError: the simulator is not installed (``torch_npu`` is missing or a real one).
    """
    mod = sys.modules.get("torch_npu")
    if mod is None or not getattr(mod, "__gptoss_simulator__", False):
        raise RuntimeError("host_time_only() needs the NPU simulator installed (gptoss_patch_testkit.npu_sim.install())")
    from torch.overrides import _get_current_function_mode_stack

    from gptoss_patch_testkit.npu_sim import device

    mapping = device.current_mapping()  # this thread's (another thread entering the mapping has its own)
    stack = _get_current_function_mode_stack()
    if mapping is not None and mapping in stack and stack[-1] is not mapping:
        raise RuntimeError("host_time_only(): another torch function mode is active above the simulator's device "
                           "mapping; enter the switch outside it")
    saved = {name: mod.__dict__[name] for name in STUBS if name in mod.__dict__}
    suspended = mapping is not None and mapping in stack
    try:
        for name, stub in STUBS.items():
            setattr(mod, name, stub)
        if suspended:
            mapping.__exit__(None, None, None)
        yield
    finally:
        if suspended:
            mapping.__enter__()
        for name in STUBS:
            if name in saved:
                setattr(mod, name, saved[name])
            else:
                delattr(mod, name)
