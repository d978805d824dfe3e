"""Weights: pad GPT-OSS's per-rank MoE intermediate size so FRACTAL_NZ expert weights pass the grouped matmul.

Why
    ``npu_grouped_matmul`` rejects a bf16/fp16 FRACTAL_NZ weight whose logical ``(k, n)`` are not multiples of 16
    (``ACLNN_ERR_PARAM_INVALID`` "When weight(...) format is FRACTAL_NZ, weight'shape(k, n) should be divisible by ...";
    ``docs/operators.md`` §4.2, OTX-gmm ``TransWeightToNz``); ND weights have no such rule. After vllm-ascend's
    ``process_weights_after_loading`` the experts are ``w13 (E, H, 2I)`` and ``w2 (E, I, H)``, so the per-rank
    intermediate size ``I`` must be a multiple of 16 (:mod:`gptoss_patch.kernels.padding`). gpt-oss-120b at TP 8 has
    ``I = 2880 / 8 = 360`` (TP 16: 180): the first MoE call fails on ``w2``'s ``k = 360``. Whether the bf16 experts are
    NZ-cast depends on the release (docs/upstream.md §4.10, :data:`gptoss_patch.matrix.NZ_RULES`):
    0.11.0rc1/rc2 and 0.12.0rc1 by default (``VLLM_ASCEND_ENABLE_NZ`` default 1); 0.11.0 only with eagle/eagle3
    speculative decoding (``is_enable_nz(dtype)`` returns the env value then, else False for fp16/bf16 - gpt-oss has
    Eagle3 drafts, so 120b at TP 8 with speculative decoding hits it); 0.13.0rc1+ with ``VLLM_ASCEND_ENABLE_NZ=2``.
    vLLM's own ``_maybe_pad_weight`` pads only on ROCm (docs/upstream.md §7.4).
How
    One ``wrapt`` wrapper around the unquantised MoE method's ``process_weights_after_loading(layer)``. It runs *after*
    vLLM's loader has filled the parameters (vLLM 0.11 ... 0.14's BF16 GPT-OSS loader ``_load_weights_other`` copies
    each rank's slice with ``param.copy_(narrow_weight)``, not through a ``weight_loader``, so parameters created
    padded would make that copy fail; padding after loading leaves the loader and ``create_weights`` untouched and needs
    no second copy of the checkpoint slice) and *before* upstream transposes and NZ-casts. For a ``swigluoai`` layer
    (GPT-OSS; every other activation is left alone - their ``w13`` is not interleaved) whose ``I`` is not a multiple of
    16, it pads ``w13_weight (E, 2I, H)`` with whole zero gate/up pairs, ``w13_bias (E, 2I)`` likewise and
    ``w2_weight (E, H, I)`` with zero columns to ``I' = ceil(I / 16) * 16``
    (:func:`gptoss_patch.kernels.padding.pad_moe_layer_`: in place of the parameters, one tensor at a time, the old
    storage released before the next allocation - at most one padded tensor of extra memory, less than one layer's
    experts). Then upstream's code runs unchanged (transpose, NZ cast). The math is unchanged: a zero pair gives
    pre-activations ``0`` and ``swigluoai(0, 0) = 0``, and zero ``w2`` rows add nothing (proved in
    ``tests/unit/test_padding_math.py`` and ``tests/cell/test_padding.py``). Aligned layers are not copied.

    When: ``GPTOSS_PATCH_MOE_PAD`` = ``auto`` (default) pads exactly when the running release will NZ-cast this
    layer's weights - asked from the same functions its ``process_weights_after_loading`` calls, looked up in the
    wrapped function's module globals (:func:`upstream_nz_cast`: ``is_310p()`` or ``get_ascend_device_type()``, then
    ``is_enable_nz(dtype)`` / ``is_enable_nz()``, or ``maybe_trans_nz`` probed on a one-fractal tensor), and only for
    bf16/fp16/int8 weights (an fp32 NZ weight is rejected whatever its shape); if the release's decision cannot be
    read, it pads (always safe, costs memory). ``always`` pads every unaligned ``swigluoai`` layer (any dtype),
    ``never`` disables the patch's effect. Any other value raises ``ValueError`` at model load.

    Tensor and expert parallelism need nothing special: ``I`` is read from the layer's own parameters (``2880 / TP``
    without EP; ``2880`` with EP, which is aligned). ``w2_bias (E, H)`` does not depend on ``I``.
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.11.0 (layout B: ``vllm_ascend.ops.common_fused_moe:AscendUnquantizedFusedMoEMethod``).
    0.12.0rc1 ... 0.14.0rc1 (layouts C, E, F: the same method under ``vllm_ascend.ops.fused_moe.fused_moe``; 0.12.0rc1
    casts by default, 0.13.0rc1+ decide through ``maybe_trans_nz``, bf16 only with ``VLLM_ASCEND_ENABLE_NZ=2``). Not
    covered: the torchair graph-mode MoE method (``vllm_ascend.torchair``), which has its own weight processing.
    0.11.x and 0.12.0rc1 also NZ-cast *float32* experts whenever they cast bf16 ones (``is_enable_nz`` ignores or
    does not exclude fp32 there), which the grouped matmul rejects whatever the shape: padding cannot help; serve bf16
    or set ``VLLM_ASCEND_ENABLE_NZ=0`` (``tests/cell/test_moe.py``).
Remove when
    the oldest supported vllm-ascend pads unaligned MoE weights itself or never NZ-casts them (0.15.0rc1 still casts
    bf16 experts with ``VLLM_ASCEND_ENABLE_NZ=2`` without padding).
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any

from gptoss_patch.evidence import LOGGER_NAME  # under vLLM's logger: the lines show in the server's output
from gptoss_patch.registry import PatchSpec

#: Environment variable choosing when to pad: ``auto`` (default), ``always``, ``never``.
POLICY_ENV = "GPTOSS_PATCH_MOE_PAD"  # gptoss_patch.config.MOE_PAD
AUTO, ALWAYS, NEVER = "auto", "always", "never"

_log = logging.getLogger(LOGGER_NAME)
_lock = threading.Lock()
_padded: dict[str, tuple[int, int]] = {}


def pad_policy() -> str:
    """The padding policy from ``GPTOSS_PATCH_MOE_PAD`` (``auto`` when unset or empty).

    Raises:
        ValueError: a value other than ``auto``, ``always``, ``never`` (case-insensitive).
    """
    from gptoss_patch import config

    return config.choice(config.MOE_PAD)


def _on_310p(g: dict) -> bool | None:
    """``is_310p()`` (0.11.x) or ``get_ascend_device_type() == AscendDeviceType._310P`` (0.12.0rc1+), from the module
    globals ``g`` of the method upstream runs; None when neither is there."""
    is_310p = g.get("is_310p")
    if callable(is_310p):
        return bool(is_310p())
    get_type, types = g.get("get_ascend_device_type"), g.get("AscendDeviceType")
    if callable(get_type) and getattr(types, "_310P", None) is not None:
        return get_type() == types._310P
    return None


def upstream_nz_cast(wrapped: Any, dtype: Any, device: Any = None) -> bool | None:
    """Whether the running release's ``process_weights_after_loading`` will cast ``dtype`` expert weights to NZ.

    Asks the functions that method calls itself, from its module's globals (docs/upstream.md §4.10):

    * 310P check: ``is_310p()`` (0.11.x) or ``get_ascend_device_type() == AscendDeviceType._310P`` (0.12.0rc1+);
      on a 310P nothing is cast;
    * ``is_enable_nz(dtype)`` (0.11.0rc3, 0.11.0: ``dtype`` parameter) or ``is_enable_nz()`` (0.11.0rc1/rc2,
      0.12.0rc1: the ``VLLM_ASCEND_ENABLE_NZ`` value, for every dtype);
    * else ``maybe_trans_nz(weight)`` (0.13.0rc1+, which casts or returns ``weight`` itself): called on a one-fractal
      probe ``(1, 16, 16)`` of ``dtype`` on ``device``; the answer is whether it returned a different tensor.

    Args:
        wrapped: the original method (bound or not).
        dtype: the expert weights' dtype.
        device: the expert weights' device (for the ``maybe_trans_nz`` probe; default CPU).

    Returns:
        True / False, or ``None`` when the module has none of these functions (another release family).

    Raises:
        whatever upstream's ``is_enable_nz`` / ``maybe_trans_nz`` raise (e.g. ``ValueError`` when the worker never
        initialised ``is_enable_nz`` - upstream's own call a moment later would raise the same).
    """
    import torch

    func = inspect.unwrap(getattr(wrapped, "__func__", wrapped))  # through functools.wraps-style wrappers
    g = getattr(getattr(func, "__func__", func), "__globals__", None) or {}
    on_310p = _on_310p(g)
    if on_310p is None:
        return None
    if on_310p:
        return False
    is_enable_nz, maybe_trans_nz = g.get("is_enable_nz"), g.get("maybe_trans_nz")
    if callable(is_enable_nz):
        try:
            params = inspect.signature(is_enable_nz).parameters
        except (TypeError, ValueError):
            return None
        return bool(is_enable_nz(dtype) if "dtype" in params else is_enable_nz())
    if callable(maybe_trans_nz):
        probe = torch.zeros((1, 16, 16), dtype=dtype, device=device)
        return maybe_trans_nz(probe) is not probe
    return None


@dataclass(frozen=True)
class PadDecision:
    """What the patch does with one layer.

    Attributes:
        intermediate: the layer's per-rank ``I`` (``None`` when the layer is not a GPT-OSS MoE layer in vLLM's layout).
        target: ``I'`` to pad to, or ``None`` (leave the layer alone).
        reason: one sentence.
    """

    intermediate: int | None
    target: int | None
    reason: str


def decide(method: Any, layer: Any, wrapped: Any = None) -> PadDecision:
    """Decide whether (and to what size) to pad ``layer`` before ``method.process_weights_after_loading`` runs.

    Args:
        method: the unquantised MoE method (its ``transpose`` flag is True until upstream has transposed the weights).
        layer: the MoE layer (``activation``, ``w13_weight (E, 2I, H)``, ``w2_weight (E, H, I)``).
        wrapped: the original ``process_weights_after_loading`` (for :func:`upstream_nz_cast`).

    Returns:
        :class:`PadDecision`.

    Raises:
        ValueError: bad ``GPTOSS_PATCH_MOE_PAD`` (:func:`pad_policy`), or from upstream's ``is_enable_nz``.
    """
    import torch

    from gptoss_patch.kernels.moe import SWIGLUOAI, normalize_activation
    from gptoss_patch.kernels.padding import NZ_FRACTAL, padded_size

    act = normalize_activation(getattr(layer, "activation", None))
    if act != SWIGLUOAI:
        return PadDecision(None, None, f"activation {act!r} is not GPT-OSS's swigluoai")
    if not getattr(method, "transpose", True):
        return PadDecision(None, None, "weights already processed (transposed) by an earlier call")
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if (w13 is None or w2 is None or w13.dim() != 3 or w2.dim() != 3 or w13.size(1) != 2 * w2.size(2)
            or w13.size(0) != w2.size(0)):
        return PadDecision(None, None, "expert weights are not in vLLM's (E, 2I, H) / (E, H, I) layout")
    inter = int(w2.size(2))
    target = padded_size(inter, NZ_FRACTAL)
    if target is None:
        return PadDecision(inter, None, f"per-rank intermediate size {inter} is a multiple of {NZ_FRACTAL}")
    policy = pad_policy()
    if policy == NEVER:
        return PadDecision(inter, None, f"{POLICY_ENV}=never")
    if policy == ALWAYS:
        return PadDecision(inter, target, f"{POLICY_ENV}=always")
    if w13.dtype not in (torch.bfloat16, torch.float16, torch.int8):
        return PadDecision(inter, None, f"{w13.dtype} weights: the grouped matmul has no NZ rule to satisfy")
    nz = upstream_nz_cast(wrapped, w13.dtype, w13.device)
    if nz is False:
        return PadDecision(inter, None, "this vllm-ascend keeps these MoE weights in ND (no alignment rule)")
    why = "vllm-ascend will cast them to FRACTAL_NZ" if nz else "cannot tell whether vllm-ascend casts them to NZ"
    return PadDecision(inter, target, f"{why}; the grouped matmul needs I % {NZ_FRACTAL} == 0")


def padded_layers() -> dict[str, tuple[int, int]]:
    """``{layer name: (I, I')}`` of every layer this process padded (a copy)."""
    with _lock:
        return dict(_padded)


def _layer_arg(layer, *args, **kwargs):
    return layer


def _process_weights_after_loading(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading(layer)``: pad (see module
    docstring), then run the original."""
    from gptoss_patch.kernels.padding import pad_moe_layer_

    layer = _layer_arg(*args, **kwargs)
    decision = decide(instance, layer, wrapped)
    if decision.target is not None:
        pad_moe_layer_(layer, decision.target)
        layer._gptoss_moe_padding = (decision.intermediate, decision.target)
        name = str(getattr(layer, "layer_name", None) or id(layer))
        with _lock:
            first = not _padded
            _padded[name] = (decision.intermediate, decision.target)
        if first:
            _log.info("gptoss-patch: MoE intermediate size per rank %d -> %d (zero gate/up pairs; %s)",
                      decision.intermediate, decision.target, decision.reason)
    return wrapped(*args, **kwargs)


PATCHES = [
    PatchSpec(
        name="nz_padding.pad_moe_intermediate",
        target_key="moe_unquant_process_weights",
        wrapper=_process_weights_after_loading,
        params=("layer",),
        summary="GPT-OSS MoE weights padded to a per-rank intermediate size that is a multiple of 16 when "
                "vllm-ascend casts them to FRACTAL_NZ",
    ),
]
