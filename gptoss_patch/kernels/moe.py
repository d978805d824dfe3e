"""GPT-OSS mixture-of-experts math: plain-torch references, and the grouped expert MLP on the NPU operators.

GPT-OSS's MoE block differs from the SwiGLU MoE that vllm-ascend 0.11-0.14 hard-codes
(``docs/operators.md`` §4.3, ``docs/upstream.md`` §7.4, §8.2, §3):

* **activation** ``swigluoai``: gate and linear halves are *interleaved* along the last dim (``x[..., 0::2]`` is the
  gate, ``x[..., 1::2]`` the linear part), both are clamped to ``limit = 7`` (the gate only from above), the gate uses
  ``sigmoid(alpha * gate)`` with ``alpha = 1.702``, and the linear part is shifted by ``+1``;
* **biases** on both projections (added inside the GEMMs: before the activation for ``w13``, after ``w2``);
* **routing**: top-k of the router *logits*, then a softmax over the k selected logits - which equals
  "softmax over all experts, take the top-k, renormalise to sum 1" (proved in
  ``tests/unit/test_kernels_moe.py``), i.e. what vllm-ascend computes with ``renormalize=True``.

Weight layout used here = transformers' ``GptOssExperts`` = vllm-ascend's layout after
``process_weights_after_loading`` (``docs/upstream.md`` §7.4, §8.3): ``w13`` ``(E, H, 2I)`` with interleaved
gate/up columns, ``w13_bias`` ``(E, 2I)``, ``w2`` ``(E, I, H)``, ``w2_bias`` ``(E, H)``.

:func:`swigluoai`, :func:`route_gptoss` and :func:`experts_forward` are plain torch (no NPU operator).
:func:`grouped_expert_mlp` is the expert MLP the patched vllm-ascend path runs (``gptoss_patch.patches.moe``): two
``torch_npu.npu_grouped_matmul`` calls with the biases inside, and :func:`swigluoai` in between - the computation
of vllm-ascend 0.15.0rc1's native ``unquant_apply_mlp`` (``docs/upstream.md`` §3).

Sources: openai/gpt-oss ``gpt_oss/torch/model.py`` (``swiglu``, ``MLPBlock``; tag GPTOSS); vLLM
``SwigluOAIAndMul.forward_native``; transformers 4.57.1 ``models/gpt_oss/modeling_gpt_oss.py``
(``GptOssExperts``, ``GptOssTopKRouter``).
"""

from __future__ import annotations

import torch

__all__ = ["swigluoai", "route_gptoss", "experts_forward", "normalize_activation", "gmm_bias", "grouped_expert_mlp",
           "SWIGLUOAI_ALPHA", "SWIGLUOAI_LIMIT", "SILU", "SWIGLUOAI"]

#: GPT-OSS activation constants (GPTOSS ``swiglu``; vLLM ``SwigluOAIAndMul.__init__`` defaults).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0

#: Activation names as vLLM spells them (``FusedMoE(activation=...)``; ``MoEActivation.<X>.value`` from vLLM 0.17).
SILU = "silu"
SWIGLUOAI = "swigluoai"


def swigluoai(x: torch.Tensor, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT) -> torch.Tensor:
    """GPT-OSS gated activation on interleaved gate/linear columns.

    ``gate = x[..., 0::2].clamp(max=limit)``, ``up = x[..., 1::2].clamp(-limit, limit)``,
    ``out = (up + 1) * gate * sigmoid(alpha * gate)``.

    Args:
        x: ``(..., 2I)`` floating tensor (the output of the gate/up projection, bias included).
        alpha: sigmoid scale (1.702 for GPT-OSS).
        limit: clamp bound (7.0 for GPT-OSS).

    Returns:
        ``(..., I)`` tensor, computed in ``x``'s dtype like vLLM's ``forward_native`` (the reference for
        vllm-ascend 0.15's ``AscendSwigluOAIAndMul``).

    Raises:
        ValueError: the last dimension is odd.

    Source: vLLM ``SwigluOAIAndMul.forward_native`` (docs/upstream.md §8.2); GPTOSS ``swiglu``;
    transformers ``GptOssExperts.forward``.
    """
    if x.size(-1) % 2:
        raise ValueError(f"swigluoai needs an even last dimension (interleaved gate/up), got {x.size(-1)}")
    gate = x[..., 0::2].clamp(max=limit)
    up = x[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def route_gptoss(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS expert selection: the top-k logits, softmax-normalised over the selected k.

    ``values, ids = topk(logits, k)`` (descending, ``sorted=True``); ``weights = softmax(values)``. This is identical
    to ``softmax(logits)`` -> top-k -> divide by the sum of the k selected probabilities (the common ``exp(max)``
    factor and the full-softmax denominator cancel), which is what vllm-ascend's ``renormalize=True`` path computes.

    Args:
        router_logits: ``(T, E)`` floating router output (bias included).
        top_k: ``1 <= top_k <= E``.

    Returns:
        ``(weights (T, top_k), ids (T, top_k))``: ``weights`` in ``router_logits``' dtype (softmax evaluated in
        at least float32, then cast), ``ids`` int64, ordered by descending logit.

    Raises:
        ValueError: ``router_logits`` not 2-D or ``top_k`` out of range.

    Source: transformers ``GptOssTopKRouter.forward`` (topk, then ``softmax(dim=1)``); GPTOSS ``MLPBlock.forward``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (tokens, experts), got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.size(-1):
        raise ValueError(f"top_k must be in [1, {router_logits.size(-1)}], got {top_k}")
    values, ids = torch.topk(router_logits, top_k, dim=-1, sorted=True)
    compute = torch.promote_types(values.dtype, torch.float32)
    weights = torch.softmax(values.to(compute), dim=-1).to(router_logits.dtype)
    return weights, ids


def experts_forward(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2: torch.Tensor,
    w2_bias: torch.Tensor | None,
    alpha: float = SWIGLUOAI_ALPHA,
    limit: float = SWIGLUOAI_LIMIT,
) -> torch.Tensor:
    """Reference GPT-OSS expert MLP: ``out[t] = sum_k w[t,k] * (swigluoai(h[t] @ w13[e] + b13[e]) @ w2[e] + b2[e])``.

    Args:
        hidden_states: ``(T, H)``.
        topk_weights: ``(T, k)`` routing weights.
        topk_ids: ``(T, k)`` integer expert ids in ``[0, E)``.
        w13: ``(E, H, 2I)`` interleaved gate/up projection; ``w13_bias``: ``(E, 2I)`` or ``None``.
        w2: ``(E, I, H)`` down projection; ``w2_bias``: ``(E, H)`` or ``None``.
        alpha, limit: :func:`swigluoai` constants.

    Returns:
        ``(T, H)`` in ``hidden_states``' dtype (accumulated in that dtype, like transformers' CPU path).

    Raises:
        ValueError: inconsistent shapes.

    Source: transformers ``GptOssExperts.forward``; GPTOSS ``MLPBlock.forward``.
    """
    if hidden_states.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.size(0) != hidden_states.size(0):
        raise ValueError("expected hidden_states (T, H) and topk_weights/topk_ids (T, k)")
    num_experts, hidden, two_i = w13.shape
    if hidden != hidden_states.size(1) or w2.shape != (num_experts, two_i // 2, hidden):
        raise ValueError(f"inconsistent weights: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, H={hidden_states.size(1)}")
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        h = hidden_states[token_idx] @ w13[e]
        if w13_bias is not None:
            h = h + w13_bias[e]
        y = swigluoai(h, alpha, limit) @ w2[e]
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(out.dtype))
    return out


def normalize_activation(activation: object) -> str:
    """The activation name vLLM means, whether it passed a string or an enum member.

    vLLM <= 0.16 passes ``FusedMoE.activation`` as a string (``"swigluoai"``); from 0.17 it passes a
    ``vllm.model_executor.layers.fused_moe.activation.MoEActivation`` member (an :class:`enum.Enum` whose ``.value`` is
    that string). vllm-ascend's ``activation == "swigluoai"`` test broke on the enum (vllm-ascend issue #8463, fixed by
    PR #8465 with ``getattr(activation, "value", activation)``); this is the same normalisation.

    Args:
        activation: ``str``, an enum member with a ``str`` value, or ``None`` (vllm-ascend's own default, = ``"silu"``).

    Returns:
        The lower-level name, e.g. ``"swigluoai"`` or ``"silu"``, unchanged in case.

    Raises:
        TypeError: neither a string nor an object whose ``.value`` is a string.
    """
    if activation is None:
        return SILU
    value = getattr(activation, "value", activation)
    if not isinstance(value, str):
        raise TypeError(f"MoE activation must be a str or an enum with a str value, got {activation!r}")
    return value


def _on_310p() -> bool:
    """Whether vllm-ascend runs on an Atlas 310P, asked the way the running release's ``unquant_apply_mlp`` asks:
    ``vllm_ascend.utils.is_310p()`` (0.11.x, 0.14.0rc1) or ``get_ascend_device_type() == AscendDeviceType._310P``
    (0.12.0rc1, 0.13.x, which have no ``is_310p``)."""
    import vllm_ascend.utils as vu

    is_310p = getattr(vu, "is_310p", None)
    if callable(is_310p):
        return bool(is_310p())
    return vu.get_ascend_device_type() == vu.AscendDeviceType._310P


def gmm_bias(bias: torch.Tensor | None, x_dtype: torch.dtype) -> list[torch.Tensor] | None:
    """The ``bias=`` argument ``npu_grouped_matmul`` needs for one 3-D weight: ``[bias]`` in the operator's bias dtype.

    Args:
        bias: ``(E, N)`` per-expert bias (any floating dtype; the checkpoints store bf16), or ``None``.
        x_dtype: dtype of the grouped matmul's ``x`` (= its weight dtype).

    Returns:
        ``None`` for no bias, else ``[bias.to(float32)]`` when ``x`` is bfloat16 and ``[bias.to(x_dtype)]`` otherwise
        (OPD-gmm data-type tables; OTX-gmm ``biasDtype = BF16 ? FLOAT : xDtype``; ``docs/operators.md`` §4.1). vllm-ascend
        0.15.0rc1 always passes float32, which the operator rejects for a float16 ``x``.

    Raises:
        ValueError: ``bias`` is not 2-D.
    """
    if bias is None:
        return None
    if bias.dim() != 2:
        raise ValueError(f"expert bias must be (num_experts, N), got shape {tuple(bias.shape)}")
    want = torch.float32 if x_dtype == torch.bfloat16 else x_dtype
    return [bias.to(want)]


def grouped_expert_mlp(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_list: torch.Tensor,
    *,
    group_list_type: int = 1,
    activation: object = SWIGLUOAI,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    topk_scales: torch.Tensor | None = None,
    need_trans: bool = False,
) -> torch.Tensor:
    """The unquantised expert MLP on rows already grouped by expert, with biases and the model's activation.

    ``y[r] = act(x[r] @ w1[e] + w1_bias[e]) @ w2[e] + w2_bias[e]`` for every row ``r`` of expert ``e``'s group, where
    ``act`` is :func:`swigluoai` (interleaved gate/up, clamps; plain torch in the GEMM output's dtype, exactly vLLM's
    ``SwigluOAIAndMul.forward_native`` as vllm-ascend 0.15.0rc1 calls it) or, for ``"silu"``, ``torch_npu.npu_swiglu``
    (first half gate, second half up - upstream's activation, unchanged). Both GEMMs are one
    ``torch_npu.npu_grouped_matmul(split_item=2, group_type=0)`` each with the bias inside (:func:`gmm_bias`), the
    calls of vllm-ascend 0.15.0rc1 ``unquant_apply_mlp`` (``docs/upstream.md`` §3).

    Args:
        hidden_states: ``(M, H)`` rows sorted by expert (bfloat16/float16/float32). Rows past the total of
            ``group_list`` (dispatcher padding) produce uninitialised output rows, as upstream.
        w1: ``(E, H, 2I)`` gate/up weight as stored after vllm-ascend's ``process_weights_after_loading``
            (``(E, 2I, H)`` with ``need_trans=True``); columns interleaved gate/up for ``swigluoai``.
        w2: ``(E, I, H)`` down weight (``(E, H, I)`` with ``need_trans=True``).
        group_list: 1-D int64, one entry per local expert: counts (``group_list_type=1``) or cumulative ends (``0``).
        group_list_type: 0 or 1, passed to the operator.
        activation: ``"swigluoai"`` or ``"silu"`` (string or enum member, :func:`normalize_activation`).
        w1_bias: ``(E, 2I)`` or ``None``; ``w2_bias``: ``(E, H)`` or ``None``. With tensor parallelism vLLM's loader
            keeps ``w2_bias`` on TP rank 0 only (zeros elsewhere), so the all-reduce adds it once.
        topk_scales: ``(M, 1)`` per-row routing weights applied after the activation (PanguProMoE dispatcher) or
            ``None``.
        need_trans: the weights are ``(E, out, in)`` and are used through a transposed view (upstream's flag).

    Returns:
        ``(M, H)`` in ``hidden_states``' dtype.

    Raises:
        NotImplementedError: an activation other than ``"swigluoai"``/``"silu"`` (no NPU path computes it here).
        TypeError: ``activation`` is not a string/enum (:func:`normalize_activation`).
        RuntimeError: from the operator (shape, dtype, NZ alignment checks).
    """
    import torch_npu

    act = normalize_activation(activation)
    if act not in (SILU, SWIGLUOAI):
        raise NotImplementedError(f"gptoss-patch MoE MLP supports activation 'swigluoai' or 'silu', got {act!r}")
    if need_trans:
        w1 = w1.transpose(1, 2)
        w2 = w2.transpose(1, 2)
    gate_up = torch_npu.npu_grouped_matmul(
        x=[hidden_states], weight=[w1], bias=gmm_bias(w1_bias, hidden_states.dtype), split_item=2,
        group_list_type=group_list_type, group_type=0, group_list=group_list)[0]
    if act == SWIGLUOAI:
        act_out = swigluoai(gate_up.view(-1, gate_up.size(-1)))
    else:
        if _on_310p():  # upstream's 310P branch: npu_swiglu in float32, back to float16
            act_out = torch_npu.npu_swiglu(gate_up.to(torch.float32)).to(torch.float16)
        else:
            act_out = torch_npu.npu_swiglu(gate_up)
    if topk_scales is not None:
        act_out = act_out * topk_scales
    return torch_npu.npu_grouped_matmul(
        x=[act_out], weight=[w2], bias=gmm_bias(w2_bias, act_out.dtype), split_item=2,
        group_list_type=group_list_type, group_type=0, group_list=group_list)[0]
