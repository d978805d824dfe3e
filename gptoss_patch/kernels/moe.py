"""GPT-OSS mixture-of-experts math in plain torch (no NPU operators).

GPT-OSS's MoE block differs from the SwiGLU MoE that vllm-ascend 0.11-0.14 hard-codes
(``npu_ops.md`` §5.2, ``upstream_targets.md`` §4.2, §5.4, §7.2):

* **activation** ``swigluoai``: gate and linear halves are *interleaved* along the last dim (``x[..., 0::2]`` is the
  gate, ``x[..., 1::2]`` the linear part), both are clamped to ``limit = 7`` (the gate only from above), the gate uses
  ``sigmoid(alpha * gate)`` with ``alpha = 1.702``, and the linear part is shifted by ``+1``;
* **biases** on both projections (added inside the GEMMs: before the activation for ``w13``, after ``w2``);
* **routing**: top-k of the router *logits*, then a softmax over the k selected logits - which equals
  "softmax over all experts, take the top-k, renormalise to sum 1" (proved in
  ``tests/unit/test_kernels_moe.py``), i.e. what vllm-ascend computes with ``renormalize=True``.

Weight layout used here = transformers' ``GptOssExperts`` = vllm-ascend's layout after
``process_weights_after_loading`` (``upstream_targets.md`` §4.2, §5.3): ``w13`` ``(E, H, 2I)`` with interleaved
gate/up columns, ``w13_bias`` ``(E, 2I)``, ``w2`` ``(E, I, H)``, ``w2_bias`` ``(E, H)``.

Sources: openai/gpt-oss ``gpt_oss/torch/model.py`` (``swiglu``, ``MLPBlock``; tag GPTOSS); vLLM
``SwigluOAIAndMul.forward_native``; transformers 4.57.1 ``models/gpt_oss/modeling_gpt_oss.py``
(``GptOssExperts``, ``GptOssTopKRouter``).
"""

from __future__ import annotations

import torch

__all__ = ["swigluoai", "route_gptoss", "experts_forward", "SWIGLUOAI_ALPHA", "SWIGLUOAI_LIMIT"]

#: GPT-OSS activation constants (GPTOSS ``swiglu``; vLLM ``SwigluOAIAndMul.__init__`` defaults).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


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

    Source: vLLM ``SwigluOAIAndMul.forward_native`` (upstream_targets.md §5.4); GPTOSS ``swiglu``;
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
