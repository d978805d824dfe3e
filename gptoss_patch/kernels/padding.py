"""Zero-padding of GPT-OSS's per-rank MoE intermediate size to the FRACTAL_NZ alignment: the math, no upstream imports.

The rule
========
vllm-ascend keeps the unquantised expert weights as ``w13 (E, H, 2I)`` and ``w2 (E, I, H)`` after
``process_weights_after_loading`` (``(E, in, out)``: ``docs/upstream.md`` §7.4), and ``npu_grouped_matmul`` reads a
weight's last two dims as ``(k, n)``. When a weight is in FRACTAL_NZ (ACL format 29) the operator checks, on A2/A3,
``k % 16 == 0 and n % 16 == 0`` for bf16/fp16 (``k % 16, n % 32`` for int8) and raises ``ACLNN_ERR_PARAM_INVALID``
otherwise; with ND weights there is no alignment rule (``docs/operators.md`` §4.2, source OTX-gmm ``TransWeightToNz`` and
OTX-gmmt ``CheckWeightNZShape``). For the two expert weights that means:

* ``w13``: ``k = H``, ``n = 2I`` -> ``H % 16`` and ``2I % 16``;
* ``w2``: ``k = I``, ``n = H`` -> ``I % 16`` and ``H % 16``.

``H`` is not split by tensor parallelism (GPT-OSS: 2880 = 180 * 16), so the binding condition is **I % 16 == 0** for
the *per-rank* intermediate size ``I`` (int8 needs ``2I % 32``, the same condition). gpt-oss-120b / -20b have
``intermediate_size = 2880``; per rank ``I = 2880 / (TP * DP)`` without expert parallelism (vLLM
``FusedMoEParallelConfig.make`` flattens TP across DP; ``FusedMoE.intermediate_size_per_partition = I // tp``),
``I = 2880`` with expert parallelism (every rank holds whole experts). TP 8 -> 360 = 22 * 16 + 8 and TP 16 -> 180 are
not multiples of 16; TP 1, 2, 4 (2880, 1440, 720) are.

Which releases cast bf16 MoE weights to NZ (so that the rule bites) is release data: :data:`gptoss_patch.matrix.NZ_RULES`.

Why zero padding is exact
=========================
Padding ``I -> I'`` appends ``I' - I`` *whole* gate/up pairs: in vLLM's layout ``w13 (E, 2I, H)`` row ``2j`` is gate
``j`` and row ``2j + 1`` is up ``j`` (``docs/upstream.md`` §8.3), so appending ``2 (I' - I)`` zero rows appends
``I' - I`` zero pairs and leaves every existing pair where it was; ``w13_bias (E, 2I)`` gets zero columns the same way.
For a padded pair the gate/up pre-activations are ``x @ 0 + 0 = 0``, and ``swigluoai(0, 0) = (0 + 1) * 0 *
sigmoid(1.702 * 0) = 0``; ``w2 (E, H, I)`` gets ``I' - I`` zero *columns* (zero rows of the transposed ``(E, I', H)``),
so the padded activations (zeros) meet zero weights and add nothing to the down projection. Every real output
element is the same sum plus ``+0`` terms. (Bitwise equality additionally needs an accumulation order that does not
depend on K; the tests show where that holds.)

Memory
======
:func:`pad_moe_layer_` pads one layer in place of its parameters: for each tensor it allocates the padded copy,
copies, swaps it into the ``Parameter`` (``param.data = new``) and drops the old storage before touching the next
tensor, so the transient extra memory is one padded tensor (the largest is ``w13``), never more than one layer's
expert weights. An aligned layer is left alone: no allocation, the same storages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the functions that use it: the layout and NZ rules need no torch
    import torch

__all__ = [
    "NZ_FRACTAL",
    "MoERankLayout",
    "nz_multiple",
    "aligned_size",
    "moe_rank_layout",
    "padded_size",
    "pad_dim",
    "pad_w13",
    "pad_w13_bias",
    "pad_w2",
    "pad_parameter_",
    "pad_moe_layer_",
    "expert_bytes",
]

#: Edge of an NZ fractal in elements for 2-byte dtypes (32 bytes / itemsize; docs/operators.md §4.2).
NZ_FRACTAL = 16


def nz_multiple(dtype: torch.dtype) -> int:
    """The multiple the per-rank MoE intermediate size ``I`` needs for NZ grouped-matmul weights of ``dtype``.

    Args:
        dtype: the expert weights' dtype.

    Returns:
        16 for bfloat16 / float16 (``k % 16, n % 16``) and int8 (``k % 16, n % 32``: ``w13``'s ``n = 2I`` and
        ``w2``'s ``k = I`` both need ``I % 16``).

    Raises:
        ValueError: any other dtype (float32 included): ``npu_grouped_matmul`` accepts no NZ weight of that dtype at
            all, so no padding can help (OTX-gmm ``TransWeightToNz`` lists INT8, BF16/FP16 and INT4 only).

    Source: docs/operators.md §4.2 (OTX-gmm, OTX-gmmt).
    """
    import torch

    if dtype in (torch.bfloat16, torch.float16, torch.int8):
        return NZ_FRACTAL
    raise ValueError(f"npu_grouped_matmul has no FRACTAL_NZ alignment rule for {dtype} weights (only int8, bf16, "
                     "fp16, int4); padding cannot make such a weight acceptable")


def aligned_size(n: int, multiple: int = NZ_FRACTAL) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (``aligned_size(360) == 368``, ``aligned_size(368) == 368``).

    Raises:
        ValueError: ``n < 0`` or ``multiple < 1``.
    """
    if n < 0 or multiple < 1:
        raise ValueError(f"aligned_size needs n >= 0 and multiple >= 1, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple


def padded_size(intermediate_per_rank: int, multiple: int = NZ_FRACTAL) -> int | None:
    """The padded per-rank intermediate size, or ``None`` when ``intermediate_per_rank`` is already aligned."""
    target = aligned_size(intermediate_per_rank, multiple)
    return None if target == intermediate_per_rank else target


@dataclass(frozen=True)
class MoERankLayout:
    """Per-rank expert shapes of a GPT-OSS MoE layer under a parallel layout (vLLM's layout, before vllm-ascend's
    transpose).

    Attributes:
        experts: experts held by one rank (``E / (TP*DP)`` with expert parallelism, else ``E``).
        hidden: ``H``.
        intermediate: per-rank ``I``.
        padded: the NZ-aligned ``I'`` (``None`` when ``I`` is aligned).
        expert_parallel: whether experts (not the intermediate dim) are split.
    """

    experts: int
    hidden: int
    intermediate: int
    padded: int | None
    expert_parallel: bool

    @property
    def target(self) -> int:
        """``I'`` if padding applies, else ``I``."""
        return self.padded or self.intermediate

    def shapes(self, padded: bool = False) -> dict[str, tuple[int, ...]]:
        """Parameter shapes in vLLM's layout (``w13 (E, 2I, H)``, ``w13_bias (E, 2I)``, ``w2 (E, H, I)``,
        ``w2_bias (E, H)``), with ``I`` or ``I'``."""
        i = self.target if padded else self.intermediate
        e, h = self.experts, self.hidden
        return {"w13_weight": (e, 2 * i, h), "w13_bias": (e, 2 * i), "w2_weight": (e, h, i), "w2_bias": (e, h)}


def moe_rank_layout(num_experts: int, hidden_size: int, intermediate_size: int, tensor_parallel_size: int = 1,
                    data_parallel_size: int = 1, expert_parallel: bool = False,
                    multiple: int = NZ_FRACTAL) -> MoERankLayout:
    """Per-rank MoE shapes from the model config and the parallel layout, as vLLM 0.11 builds them.

    Without expert parallelism the intermediate dim is split over ``TP * DP`` ranks (vLLM
    ``FusedMoEParallelConfig.make`` ``flatten_tp_across_dp``; ``FusedMoE`` ``intermediate_size // tp_size``). With
    ``expert_parallel`` and ``TP * DP > 1`` the experts are split instead (``E / (TP*DP)`` whole experts per rank; with
    one rank vLLM turns EP off).

    Args:
        num_experts: ``num_local_experts`` (GPT-OSS: 32 for 20b, 128 for 120b).
        hidden_size: ``H`` (2880).
        intermediate_size: the expert intermediate size of the config (2880).
        tensor_parallel_size, data_parallel_size: the parallel layout (>= 1).
        expert_parallel: ``--enable-expert-parallel``.
        multiple: the alignment (:func:`nz_multiple`).

    Returns:
        :class:`MoERankLayout`.

    Raises:
        ValueError: a size < 1; ``intermediate_size`` not divisible by ``TP * DP`` without EP (vLLM's ``MLPBlock``
            asserts ``intermediate_size % world_size == 0``); ``num_experts`` not divisible by ``TP * DP`` with EP.
    """
    ranks = tensor_parallel_size * data_parallel_size
    if min(num_experts, hidden_size, intermediate_size, tensor_parallel_size, data_parallel_size) < 1:
        raise ValueError("moe_rank_layout: every size must be >= 1")
    ep = expert_parallel and ranks > 1
    if ep:
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {ranks} expert-parallel ranks")
        experts, inter = num_experts // ranks, intermediate_size
    else:
        if intermediate_size % ranks:
            raise ValueError(f"intermediate_size {intermediate_size} is not divisible by TP*DP = {ranks} "
                             "(vLLM's GPT-OSS MLPBlock asserts it)")
        experts, inter = num_experts, intermediate_size // ranks
    return MoERankLayout(experts, hidden_size, inter, padded_size(inter, multiple), ep)


def expert_bytes(shapes: dict[str, tuple[int, ...]], itemsize: int = 2) -> int:
    """Bytes of the tensors in ``shapes`` (e.g. :meth:`MoERankLayout.shapes`) at ``itemsize`` bytes per element."""
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n * itemsize
    return total


# ----------------------------------------------------------------------------------------------------------------------
# padding tensors
# ----------------------------------------------------------------------------------------------------------------------


def pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A new contiguous tensor equal to ``t`` along ``dim`` for indices ``< t.size(dim)`` and zero up to ``size``.

    Returns ``t`` itself (no copy) when ``t.size(dim) == size``.

    Raises:
        ValueError: ``size < t.size(dim)`` (padding never truncates).
    """
    dim = dim % t.dim()
    old = t.size(dim)
    if size == old:
        return t
    if size < old:
        raise ValueError(f"cannot pad dim {dim} of a tensor of shape {tuple(t.shape)} down to {size}")
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_empty(shape)  # contiguous
    out.narrow(dim, 0, old).copy_(t)
    out.narrow(dim, old, size - old).zero_()
    return out


def _check_i(name: str, actual: int, intermediate: int) -> None:
    if actual > intermediate:
        raise ValueError(f"{name}: cannot pad intermediate size {actual} down to {intermediate}")


def pad_w13(w13: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Pad vLLM's gate/up weight ``(E, 2I, H)`` (rows interleaved: ``2j`` gate ``j``, ``2j+1`` up ``j``) to
    ``(E, 2I', H)`` by appending ``I' - I`` zero gate/up *pairs*; the existing pairs keep their rows.

    Args:
        w13: ``(E, 2I, H)`` any dtype.
        intermediate: ``I' >= I``.

    Returns:
        A new ``(E, 2I', H)`` tensor, or ``w13`` itself when ``I' == I``.

    Raises:
        ValueError: not 3-D, odd row count, or ``I' < I``.
    """
    if w13.dim() != 3 or w13.size(1) % 2:
        raise ValueError(f"w13 must be (E, 2I, H) with interleaved gate/up rows, got {tuple(w13.shape)}")
    _check_i("w13", w13.size(1) // 2, intermediate)
    return pad_dim(w13, 1, 2 * intermediate)


def pad_w13_bias(bias: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Pad the gate/up bias ``(E, 2I)`` (interleaved like ``w13``) to ``(E, 2I')`` with zero pairs; ``bias`` itself if
    aligned. Raises ValueError for a bad shape or ``I' < I``."""
    if bias.dim() != 2 or bias.size(1) % 2:
        raise ValueError(f"w13_bias must be (E, 2I), got {tuple(bias.shape)}")
    _check_i("w13_bias", bias.size(1) // 2, intermediate)
    return pad_dim(bias, 1, 2 * intermediate)


def pad_w2(w2: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Pad vLLM's down weight ``(E, H, I)`` to ``(E, H, I')`` with zero columns; ``w2`` itself if aligned.

    Raises:
        ValueError: not 3-D, or ``I' < I``.
    """
    if w2.dim() != 3:
        raise ValueError(f"w2 must be (E, H, I), got {tuple(w2.shape)}")
    _check_i("w2", w2.size(2), intermediate)
    return pad_dim(w2, 2, intermediate)


def pad_parameter_(param: Any, padded: torch.Tensor) -> bool:
    """Swap ``padded`` into ``param`` (a ``torch.nn.Parameter``, same object afterwards); True if anything changed.

    ``param.data = padded`` releases the old storage as soon as nothing else refers to it (the caller must not keep a
    reference), so the layer never holds both versions.
    """
    import torch

    if tuple(padded.shape) == tuple(param.shape) and padded.data_ptr() == param.data_ptr():
        return False
    param.data = padded
    return True


def pad_moe_layer_(layer: Any, intermediate: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pad one MoE layer's ``w13_weight (E, 2I, H)``, ``w13_bias (E, 2I)`` (if any) and ``w2_weight (E, H, I)`` to
    ``I' = intermediate``, in place of the parameters and one tensor at a time.

    Order: ``w13_weight``, ``w13_bias``, ``w2_weight``; each old tensor is released (``param.data = new``) before the
    next one is allocated, so the transient extra memory is the largest single padded tensor. ``w2_bias (E, H)``
    does not depend on ``I`` and is not touched. Nothing is allocated when ``I == I'``.

    Args:
        layer: a module with parameters ``w13_weight``, ``w2_weight`` and optionally ``w13_bias``, in vLLM's layout
            (before vllm-ascend's ``process_weights_after_loading`` transposes them).
        intermediate: ``I'``.

    Returns:
        ``{name: (old_shape, new_shape)}`` of the tensors that changed (empty when nothing was padded).

    Raises:
        ValueError: inconsistent shapes (``w13`` rows != 2 * ``w2`` columns) or ``I' < I``.
    """
    import torch

    w13, w2 = layer.w13_weight, layer.w2_weight
    if w13.dim() != 3 or w2.dim() != 3 or w13.size(1) != 2 * w2.size(2) or w13.size(0) != w2.size(0):
        raise ValueError(f"MoE weights are not in vLLM's layout: w13 {tuple(w13.shape)} (want (E, 2I, H)), "
                         f"w2 {tuple(w2.shape)} (want (E, H, I))")
    changed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    bias = getattr(layer, "w13_bias", None)
    steps = [("w13_weight", pad_w13)]
    if bias is not None:
        steps.append(("w13_bias", pad_w13_bias))
    steps.append(("w2_weight", pad_w2))
    with torch.no_grad():
        for name, fn in steps:
            param = getattr(layer, name)
            before = tuple(param.shape)
            if pad_parameter_(param, fn(param.data, intermediate)):
                changed[name] = (before, tuple(param.shape))
            del param
    return changed


# ----------------------------------------------------------------------------------------------------------------------
# which vllm-ascend releases cast bf16 MoE weights to NZ (for reports; the patch asks the running release itself)
# ----------------------------------------------------------------------------------------------------------------------
