"""MoE: run GPT-OSS experts with their ``swigluoai`` activation and both expert biases.

Why
    GPT-OSS builds its experts as ``FusedMoE(..., has_bias=True, activation="swigluoai")`` (vLLM ``gpt_oss.py``
    ``MLPBlock``; docs/upstream.md §8.2): the gate/up projection output is *interleaved* (gate = ``x[..., 0::2]``
    clamped to max 7, up = ``x[..., 1::2]`` clamped to ±7, ``out = (up + 1) * gate * sigmoid(1.702 * gate)``), and
    ``w13_bias`` / ``w2_bias`` are added inside the two GEMMs. vllm-ascend 0.11.0rc1 ... 0.14.0rc1 swallow
    ``activation`` in ``AscendUnquantizedFusedMoEMethod.apply(**kwargs)``, never pass the biases, and
    ``unquant_apply_mlp`` always runs ``torch_npu.npu_swiglu`` (first half gate, second half up, no clamp, no +1)
    (docs/upstream.md §7.4; vllm-ascend issue #4283). The server runs and the MoE output is wrong.
How
    Three ``wrapt`` wrappers and one per-call :class:`contextvars.ContextVar` carry ``(activation, w1_bias, w2_bias)``
    from the quant method to the expert MLP, through whichever communication method the forward context picked
    (AllGather, All2All, MC2 and, in 0.11.x, NaiveMulticast all inherit ``MoECommMethod.fused_experts``; their
    dispatchers and combiners need nothing: the biases act per expert row inside the GEMMs and the combine weights the
    rows as before). 0.12.0rc1's ``FusedAlltoAllCommImpl`` and 0.13.0+'s ``FusedMC2CommImpl`` override
    ``fused_experts`` with a fused dispatch-FFN-combine kernel (no bias, no swigluoai); their runners pick them only
    for ``w8a8_dynamic`` checkpoints on A3, and a GPT-OSS call that reaches one anyway raises
    :class:`NotImplementedError` (:func:`check_comm_method`):

    * ``moe.unquant_apply`` wraps ``AscendUnquantizedFusedMoEMethod.apply``: reads ``activation`` from its keyword
      arguments (string, or the ``MoEActivation`` enum vLLM >= 0.17 passes - normalised by ``.value``, vllm-ascend
      issue #8463) and, when the layer's ``FusedMoEConfig.has_bias`` is set (``self.moe.has_bias``; the attribute
      0.11.0 has), ``layer.w13_bias`` / ``layer.w2_bias``; it sets the context for the duration of the original call.
      Routing stays upstream's (``select_experts`` -> ``npu_moe_gating_top_k_softmax`` + renormalise = GPT-OSS's
      softmax over the top-4 logits; proved in ``tests/cell/test_moe.py``).
    * ``moe.fused_experts`` wraps ``MoECommMethod.fused_experts``: accepts vllm-ascend 0.15's ``w1_bias=`` /
      ``w2_bias=`` keywords and honours its own ``activation`` parameter (ignored upstream); explicit arguments
      override the context set by ``apply``.
    * ``moe.apply_mlp`` (0.11.x signature) / ``moe.apply_mlp_012`` (0.12.0rc1 ... 0.14.0rc1: ``group_list`` before the
      scales, ``w1_offset``/``w2_offset``) wrap ``moe_mlp.unified_apply_mlp`` (also rebound in ``moe_comm_method``,
      which imports it by value, docs/upstream.md §7.5): accept 0.15's ``activation=`` / ``w1_bias=`` /
      ``w2_bias=`` keywords or read the context, and run :func:`gptoss_patch.kernels.moe.grouped_expert_mlp`:
      ``npu_grouped_matmul`` with
      ``bias=[w1_bias as float32]`` (for bf16), :func:`~gptoss_patch.kernels.moe.swigluoai` in plain torch (vLLM's
      ``SwigluOAIAndMul.forward_native``, as vllm-ascend 0.15.0rc1 does), ``npu_grouped_matmul`` with ``w2_bias``.

    A layer with ``activation="silu"`` and no bias (every non-GPT-OSS model) never sets the context and calls
    upstream's code unchanged (bit-identical output); so does any activation the patch does not implement (logged
    once). A quantised MoE path reached with ``swigluoai`` or biases raises :class:`NotImplementedError` instead of
    computing garbage.

    Tensor parallelism: vLLM's loader keeps ``w2_bias`` on TP rank 0 and zeroes it on the others
    (``GptOssModel._load_weights_other``), so the all-reduce after the MoE adds it once. Expert parallelism: each rank
    holds its own experts' biases; the dispatchers only send a rank the rows of its experts.
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.11.0 (layout B: ``vllm_ascend.ops.common_fused_moe`` + ``vllm_ascend.ops.moe.*``).
    0.12.0rc1 ... 0.14.0rc1 (layouts C, E, F: ``vllm_ascend.ops.fused_moe.{fused_moe, moe_comm_method, moe_mlp}``):
    same behaviour; ``apply`` drops ``shared_experts`` from 0.13.0rc2 and ``fused_experts`` returns a
    ``FusedExpertsResult`` from 0.13.0rc2 (the wrappers pass any return value through). 0.15.0rc1 consumes
    ``activation`` and the biases natively; the structural checks refuse targets that already have those parameters.
    ``moe.activation_name`` (layout G: vllm-ascend 0.17.0rc1, 0.18.0rc1, 0.18.0 with vLLM 0.17/0.18) is a different,
    smaller defect of the natively supporting releases: vLLM >= 0.17 turns ``activation="swigluoai"`` into the plain
    ``Enum`` member ``MoEActivation.SWIGLUOAI`` (``vllm/model_executor/layers/fused_moe/layer.py``,
    ``MoEActivation.from_str``) and vllm-ascend's ``moe_mlp.unquant_apply_mlp`` compares ``activation ==
    "swigluoai"``, which is False for an Enum member, so every GPT-OSS expert runs ``npu_swiglu`` (vllm-ascend issue
    #8463). The wrapper hands ``unquant_apply_mlp`` the member's ``.value``, exactly what upstream's fix does (PR
    #8465, ``act_name = getattr(activation, "value", activation)``, first in 0.19.1rc1); the rest of the call -
    biases, routing, communication - is upstream's native GPT-OSS code.
Remove when
    the oldest supported vllm-ascend is >= 0.15.0rc1 (layouts B-F), and >= 0.19.1rc1 (layout G).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

from gptoss_patch.evidence import LOGGER_NAME  # under vLLM's logger: the lines show in the server's output
from gptoss_patch.registry import PatchSpec

_UNSET = object()


@dataclass(frozen=True)
class MoEExtras:
    """What upstream drops on the way from the quant method to the expert MLP.

    Attributes:
        activation: normalised activation name (``"swigluoai"``, ``"silu"``, ...).
        w1_bias: ``(E_local, 2I)`` gate/up bias (the layer's ``w13_bias`` parameter, not a copy) or ``None``.
        w2_bias: ``(E_local, H)`` down bias (``w2_bias``) or ``None``.
    """

    activation: str
    w1_bias: Any = None
    w2_bias: Any = None

    @property
    def is_upstream(self) -> bool:
        """True when upstream's computation runs unchanged.

        That is every call except ``swigluoai`` and ``silu`` with a bias: ``silu`` without bias is already right
        upstream, and an activation this patch does not implement (e.g. ``gelu``, which vllm-ascend < 0.15 also runs
        as ``npu_swiglu``) is left to upstream with a one-time warning, so no non-GPT-OSS model changes behaviour.
        """
        from gptoss_patch.kernels.moe import SILU, SWIGLUOAI

        if self.activation == SWIGLUOAI:
            return False
        if self.activation == SILU:
            return self.w1_bias is None and self.w2_bias is None
        _warn_unsupported(self.activation)
        return True


_warned: set[str] = set()


def _warn_unsupported(activation: str) -> None:
    if activation not in _warned:
        _warned.add(activation)
        import logging

        logging.getLogger(LOGGER_NAME).warning(
            "gptoss-patch: MoE activation %r is not implemented by the patch; vllm-ascend's npu_swiglu path runs "
            "unchanged (its results are wrong for that activation)", activation)


_EXTRAS: contextvars.ContextVar[MoEExtras | None] = contextvars.ContextVar("gptoss_patch_moe_extras", default=None)


@contextlib.contextmanager
def _scope(extras: MoEExtras) -> Iterator[None]:
    token = _EXTRAS.set(extras)
    try:
        yield
    finally:
        _EXTRAS.reset(token)


def _merge(activation: Any, w1_bias: Any, w2_bias: Any) -> MoEExtras | None:
    """Explicit arguments (``activation`` may be :data:`_UNSET`) layered over the context; ``None`` if neither."""
    from gptoss_patch.kernels.moe import SILU, normalize_activation

    base = _EXTRAS.get()
    if activation is _UNSET and w1_bias is None and w2_bias is None:
        return base
    base = base or MoEExtras(SILU)
    return MoEExtras(
        normalize_activation(activation) if activation is not _UNSET else base.activation,
        w1_bias if w1_bias is not None else base.w1_bias,
        w2_bias if w2_bias is not None else base.w2_bias,
    )


def layer_extras(method: Any, layer: Any, activation: Any) -> MoEExtras:
    """The :class:`MoEExtras` of one ``apply`` call.

    Args:
        method: the unquantised MoE method (``AscendUnquantizedFusedMoEMethod``); ``method.moe`` is the layer's
            ``FusedMoEConfig`` whose ``has_bias`` says whether the layer was built with ``has_bias=True``.
        layer: the ``AscendFusedMoE`` layer (holds ``w13_bias`` ``(E_local, 2I)`` and ``w2_bias`` ``(E_local, H)``
            when it has biases).
        activation: ``FusedMoE.activation`` as passed by ``forward_impl`` (string or enum; ``None`` = ``"silu"``).

    Raises:
        AttributeError: ``has_bias`` is set but the layer has no ``w13_bias``/``w2_bias`` parameters.
        TypeError: an activation that is neither a string nor a string-valued enum.
    """
    from gptoss_patch.kernels.moe import normalize_activation

    config = getattr(method, "moe", None) or getattr(layer, "moe_config", None)
    has_bias = bool(getattr(config, "has_bias", False))
    act = normalize_activation(activation)
    if not has_bias:
        return MoEExtras(act)
    missing = [n for n in ("w13_bias", "w2_bias") if getattr(layer, n, None) is None]
    if missing:
        raise AttributeError(f"MoE layer {getattr(layer, 'layer_name', layer)!r} was built with has_bias=True but has "
                             f"no {' / '.join(missing)}")
    return MoEExtras(act, layer.w13_bias, layer.w2_bias)


# ----------------------------------------------------------------------------------------------------------------------
# wrappers
# ----------------------------------------------------------------------------------------------------------------------


def _apply_layer(layer, *args, **kwargs):
    return layer


def check_comm_method(comm_method: Any, extras: MoEExtras) -> None:
    """Refuse a communication method whose class overrides ``MoECommMethod.fused_experts`` for a GPT-OSS call.

    The patched ``fused_experts`` is the base class's; a subclass with its own ``fused_experts`` runs a fused kernel
    that never reaches ``unified_apply_mlp`` (0.12.0rc1 ``FusedAlltoAllCommImpl``, 0.13.0rc1+ ``FusedMC2CommImpl``:
    ``torch.ops._C_ascend.dispatch_ffn_combine`` / ``dispatch_gmm_combine_decode``, SwiGLU without biases). The model
    runners pick those only for ``w8a8_dynamic`` checkpoints on A3, never for GPT-OSS's BF16 experts; if one is
    reached anyway, fail instead of computing garbage.

    Args:
        comm_method: the forward context's ``moe_comm_method`` (``None``: nothing to check).
        extras: the call's :class:`MoEExtras`.

    Raises:
        NotImplementedError: ``extras`` needs our MLP and ``comm_method``'s class overrides ``fused_experts``.
    """
    if comm_method is None or extras.is_upstream:
        return
    owners = [k for k in type(comm_method).__mro__ if "fused_experts" in k.__dict__]
    if len(owners) > 1:
        raise NotImplementedError(
            f"gptoss-patch: MoE communication method {type(comm_method).__name__} runs its own fused kernel "
            f"({owners[0].__name__}.fused_experts), which has no {extras.activation!r} activation and no expert "
            "biases; "
            f"GPT-OSS needs one of the methods that inherit {owners[-1].__name__}.fused_experts (e.g. AllGather, "
            "All2All, MC2)")


def _forward_comm_method() -> Any:
    try:
        from vllm.forward_context import get_forward_context

        return getattr(get_forward_context(), "moe_comm_method", None)
    except (AssertionError, ImportError):  # no forward context (a direct call): upstream fails later on its own
        return None


def _unquant_apply(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendUnquantizedFusedMoEMethod.apply(layer, x, use_grouped_topk, top_k, router_logits,
    renormalize, ..., **kwargs)``: sets the call's :class:`MoEExtras` (``activation`` arrives in ``**kwargs``)."""
    extras = layer_extras(instance, _apply_layer(*args, **kwargs), kwargs.get("activation"))
    if extras.is_upstream and _EXTRAS.get() is None:
        return wrapped(*args, **kwargs)
    check_comm_method(_forward_comm_method(), extras)
    with _scope(extras):
        return wrapped(*args, **kwargs)


def _fused_experts(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``MoECommMethod.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids,
    activation="silu", ...)``: also takes ``w1_bias=`` / ``w2_bias=`` (vllm-ascend 0.15 keywords)."""
    w1_bias = kwargs.pop("w1_bias", None)
    w2_bias = kwargs.pop("w2_bias", None)
    if "activation" in kwargs:
        activation = kwargs["activation"]
    elif len(args) > 5:
        activation = args[5]
    else:
        activation = _UNSET
    if activation is _UNSET and w1_bias is None and w2_bias is None:
        return wrapped(*args, **kwargs)  # the context set by apply (if any) stays in force
    extras = _merge(activation, w1_bias, w2_bias)
    with _scope(extras):
        return wrapped(*args, **kwargs)


def _bind_mlp_011(hidden_states, w1, w1_scale, w2, w2_scale, group_list, dynamic_scale=None, group_list_type=1,
                  w1_scale_bias=None, w2_scale_bias=None, topk_scales=None, with_quant=False, fusion=False,
                  need_trans=True, dynamic_eplb=False):
    """0.11.x ``unified_apply_mlp`` parameters (docs/upstream.md §7.4, layout B) -> the ones the patch uses."""
    return {"hidden_states": hidden_states, "w1": w1, "w2": w2, "group_list": group_list,
            "group_list_type": group_list_type, "topk_scales": topk_scales, "with_quant": with_quant,
            "need_trans": need_trans}


def _bind_mlp_012(hidden_states, w1, w2, group_list, w1_scale=None, w2_scale=None, dynamic_scale=None,
                  group_list_type=1, w1_scale_bias=None, w2_scale_bias=None, w1_offset=None, w2_offset=None,
                  topk_scales=None, with_quant=False, fusion=False, need_trans=True, dynamic_eplb=False):
    """0.12.0rc1 ... 0.14.0rc1 ``unified_apply_mlp`` parameters (``group_list`` before the scales, ``w1_offset`` /
    ``w2_offset`` added; docs/upstream.md §7.4, layouts C, E, F) -> the ones the patch uses."""
    return {"hidden_states": hidden_states, "w1": w1, "w2": w2, "group_list": group_list,
            "group_list_type": group_list_type, "topk_scales": topk_scales, "with_quant": with_quant,
            "need_trans": need_trans}


def _run_mlp(bind, wrapped, args, kwargs):
    """Shared body of the ``unified_apply_mlp`` wrappers: ``bind`` maps the release's signature to our arguments."""
    extras = _merge(kwargs.pop("activation", _UNSET), kwargs.pop("w1_bias", None), kwargs.pop("w2_bias", None))
    if extras is None or extras.is_upstream:
        return wrapped(*args, **kwargs)
    b = bind(*args, **kwargs)
    from gptoss_patch import evidence

    evidence.first_use("moe", f"activation {extras.activation}, biases {extras.w1_bias is not None}")
    if b["with_quant"]:
        raise NotImplementedError(
            f"gptoss-patch: a quantised MoE with activation {extras.activation!r} and/or expert biases is not "
            "supported on vllm-ascend < 0.15 (use the BF16 checkpoint)")
    from gptoss_patch.kernels.moe import grouped_expert_mlp

    return grouped_expert_mlp(b["hidden_states"], b["w1"], b["w2"], b["group_list"],
                              group_list_type=b["group_list_type"], activation=extras.activation,
                              w1_bias=extras.w1_bias, w2_bias=extras.w2_bias, topk_scales=b["topk_scales"],
                              need_trans=b["need_trans"])


def _apply_mlp_011(wrapped, instance, args, kwargs):
    """wrapt wrapper for 0.11.x ``moe_mlp.unified_apply_mlp(hidden_states, w1, w1_scale, w2, w2_scale, group_list,
    ..., topk_scales=None, with_quant=False, fusion=False, need_trans=True, dynamic_eplb=False)``.

    Shapes: ``hidden_states`` ``(M, H)`` sorted by expert; ``w1`` ``(E, H, 2I)``, ``w2`` ``(E, I, H)`` (as stored after
    ``process_weights_after_loading``, ``need_trans=False``); ``group_list`` int64 ``(E,)``. Returns ``(M, H)``.
    """
    return _run_mlp(_bind_mlp_011, wrapped, args, kwargs)


def _apply_mlp_012(wrapped, instance, args, kwargs):
    """wrapt wrapper for 0.12.0rc1 ... 0.14.0rc1 ``moe_mlp.unified_apply_mlp(hidden_states, w1, w2, group_list,
    w1_scale=None, w2_scale=None, dynamic_scale=None, group_list_type=1, w1_scale_bias=None, w2_scale_bias=None,
    w1_offset=None, w2_offset=None, topk_scales=None, with_quant=False, fusion=False, need_trans=True,
    dynamic_eplb=False)``; same shapes and behaviour as :func:`_apply_mlp_011`."""
    return _run_mlp(_bind_mlp_012, wrapped, args, kwargs)


def activation_name(activation: Any) -> Any:
    """The activation as the string vllm-ascend compares with: an ``Enum`` member (vLLM >= 0.17's
    ``MoEActivation``, whose values are the names, ``vllm/model_executor/layers/fused_moe/activation.py``) becomes its
    ``.value``; a string or ``None`` is returned unchanged."""
    import enum

    return activation.value if isinstance(activation, enum.Enum) else activation


def _activation_name(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``moe_mlp.unquant_apply_mlp(hidden_states, w1, w2, group_list, w1_bias=None, w2_bias=None,
    activation=None, group_list_type=1, topk_scales=None, need_trans=True)`` (vllm-ascend 0.16.0rc1 ... 0.18.0):
    passes ``activation`` as its string value (:func:`activation_name`); everything else unchanged.

    Shapes (upstream's): ``hidden_states`` ``(M, H)`` sorted by expert, ``w1`` ``(E, H, 2I)`` / ``(E, 2I, H)``,
    ``w2`` ``(E, I, H)`` / ``(E, H, I)``, ``group_list`` int64 ``(E,)``. Returns ``(M, H)``.
    """
    if "activation" in kwargs:
        kwargs = dict(kwargs, activation=activation_name(kwargs["activation"]))
    elif len(args) > 6:
        args = (*args[:6], activation_name(args[6]), *args[7:])
    name = kwargs.get("activation", args[6] if len(args) > 6 else None)
    if name == "swigluoai":
        from gptoss_patch import evidence

        evidence.first_use("moe", "swigluoai (MoEActivation Enum passed as its value)")
    return wrapped(*args, **kwargs)


PATCHES = [
    PatchSpec(
        name="moe.activation_name",
        target_key="moe_unquant_apply_mlp",
        wrapper=_activation_name,
        params=("hidden_states", "w1", "w2", "group_list", "w1_bias", "w2_bias", "activation", "group_list_type"),
        # the defect: a string compare with no Enum handling (0.19.1rc1 normalises, 0.23.0+ compares Enum members:
        # there the patch would turn a right compare wrong)
        defect_present=('activation == "swigluoai"',),
        defect_absent=('getattr(activation, "value"', "MoEActivation"),
        summary="the expert MLP receives vLLM's MoEActivation Enum as the string it compares with (swigluoai)",
    ),
    PatchSpec(
        name="moe.unquant_apply",
        target_key="moe_unquant_apply",
        wrapper=_unquant_apply,
        params=("layer", "x", "router_logits", "top_k", "renormalize", "**"),
        absent_params=("activation",),
        summary="the unquantised MoE method forwards the layer's activation (str or enum) and w13_bias/w2_bias",
    ),
    PatchSpec(
        name="moe.fused_experts",
        target_key="moe_fused_experts",
        wrapper=_fused_experts,
        params=("hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation", "need_trans"),
        absent_params=("w1_bias", "w2_bias"),
        summary="every MoE communication method honours activation and takes w1_bias/w2_bias",
    ),
    PatchSpec(
        name="moe.apply_mlp",
        target_key="moe_unified_apply_mlp_011",
        wrapper=_apply_mlp_011,
        params=("hidden_states", "w1", "w1_scale", "w2", "w2_scale", "group_list", "group_list_type",
                "topk_scales", "with_quant", "need_trans"),
        absent_params=("activation", "w1_bias", "w2_bias"),
        rebind_keys=("moe_comm_method_module",),
        summary="expert MLP: grouped matmuls with the biases, swigluoai (interleaved, clamped) in between",
    ),
    PatchSpec(
        name="moe.apply_mlp_012",
        target_key="moe_unified_apply_mlp_012",
        wrapper=_apply_mlp_012,
        params=("hidden_states", "w1", "w2", "group_list", "w1_scale", "w2_scale", "group_list_type",
                "w1_offset", "topk_scales", "with_quant", "need_trans"),
        absent_params=("activation", "w1_bias", "w2_bias"),
        rebind_keys=("moe_comm_method_module",),
        summary="expert MLP: grouped matmuls with the biases, swigluoai (interleaved, clamped) in between",
    ),
]
