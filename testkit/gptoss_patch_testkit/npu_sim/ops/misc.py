"""Emulated torch_npu operators outside attention and MoE: RMSNorm, rotary embedding, prefetch.

Sources:

* ``npu_rms_norm`` / ``npu_add_rms_norm``: Ascend/op-plugin docs ``torch_npu-npu_rms_norm.md``
  ("rmsnorm(x) = x / sqrt(mean(x^2) + epsilon) * gamma"; returns ``(y, rstd)``, rstd float32 with the
  gamma dims reduced to 1) and ``torch_npu-npu_add_rms_norm.md`` (``x = x1 + x2``; returns
  ``(y, rstd, x)``). Computed in float32, results cast to the input dtype (the kernels accumulate in
  fp32 for fp16/bf16 inputs).
* ``_npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``: ATB RoPE used by
  vllm-ascend as the in-place equivalent of vLLM's ``rotary_embedding`` custom op
  (``vllm_ascend/ops/rotary_embedding.py``); semantics = vLLM's ``RotaryEmbedding.forward_native``
  (``vllm/model_executor/layers/rotary_embedding/base.py``): ``cos, sin = cache[pos].chunk(2)``; NeoX
  style rotates the two halves of the rotary dims, GPT-J style the even/odd pairs.
* ``_npu_matmul_add_fp32(x, weight, c)``: ATB MatmulAdd, ``c += x.T @ weight`` in place with ``c`` float32 and
  ``x``/``weight`` float16/bfloat16 (Ascend MindSpeed's ``npu_matmul_add.md`` operator page: "product = torch.mm(x.T,
  weight); result = product + C"); vllm-ascend's worker calls it once to warm ATB up (``_warm_up_atb``).
* ``npu_prefetch``: an L2-cache prefetch hint (``torch_npu-npu_prefetch.md``); no effect on values.
"""

from __future__ import annotations

from typing import Any

import torch


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: RMS normalisation over gamma's trailing dims.

    Args:
        x: ``[..., H]`` fp16/bf16/fp32; gamma: ``[H]``; epsilon: added to the mean square.

    Returns:
        ``(y, rstd)``: ``y`` like ``x``; ``rstd`` float32 ``[..., 1]``.

    Raises:
        RuntimeError: gamma's shape does not match x's trailing dims.
    """
    nd = gamma.dim()
    if tuple(x.shape[-nd:]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma shape {list(gamma.shape)} must equal x's trailing dims "
                           f"{list(x.shape[-nd:])}")
    xf = x.float()
    dims = tuple(range(-nd, 0))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_add_rms_norm``: ``x = x1 + x2`` then :func:`npu_rms_norm`.

    Args:
        x1, x2: same shape ``[..., H]`` and dtype; gamma: ``[H]``.

    Returns:
        ``(y, rstd, x)``; ``x`` (the sum, in the input dtype) is what vllm-ascend keeps as the residual.

    Raises:
        RuntimeError: x1 and x2 differ in shape.
    """
    if x1.shape != x2.shape:
        raise RuntimeError(f"npu_add_rms_norm: x1 {list(x1.shape)} and x2 {list(x2.shape)} must have the same shape")
    x = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def _npu_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                          cos_sin_cache: torch.Tensor, is_neox_style: bool) -> None:
    """``torch_npu._npu_rotary_embedding``: rotate ``query``/``key`` in place by their positions.

    Args:
        positions: ``[T]`` int positions.
        query: ``[T, N*head_size]`` (or any shape with T first and a multiple of head_size after).
        key: ``[T, KV_N*head_size]``.
        head_size: per-head size; the rotary dims are ``cos_sin_cache.shape[-1]`` (≤ head_size), first in each head.
        cos_sin_cache: ``[max_position, rotary_dim]`` - cos in the first half, sin in the second (vLLM layout).
        is_neox_style: rotate halves (True) or even/odd pairs (False).

    Returns:
        None (in place), like the ATB op.

    Raises:
        RuntimeError: a position outside the cache, or sizes not a multiple of head_size.
    """
    rot = cos_sin_cache.shape[-1]
    if int(positions.max()) >= cos_sin_cache.shape[0] if positions.numel() else False:
        raise RuntimeError(f"_npu_rotary_embedding: position {int(positions.max())} outside the cos/sin cache "
                           f"({cos_sin_cache.shape[0]} positions)")
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)   # [T, rot/2]
    for x in (query, key):
        t = x.shape[0]
        if x[0].numel() % head_size:
            raise RuntimeError(f"_npu_rotary_embedding: {x[0].numel()} is not a multiple of head_size {head_size}")
        v = x.detach().view(t, -1, head_size)  # device ops write memory; no autograd view bookkeeping
        xr = v[..., :rot].float()
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        if is_neox_style:
            x1, x2 = xr.chunk(2, dim=-1)
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        v[..., :rot] = out.to(x.dtype)


def _npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``torch_npu._npu_matmul_add_fp32``: ``c += x.T @ weight``, accumulated in float32, in place.

    Args:
        x: ``[K, M]`` float16/bfloat16; weight: ``[K, N]`` float16/bfloat16; c: ``[M, N]`` float32.

    Returns:
        ``c``.

    Raises:
        RuntimeError: ``c`` is not float32 or the shapes do not chain.
    """
    if c.dtype != torch.float32:
        raise RuntimeError(f"_npu_matmul_add_fp32: c must be float32, got {c.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != weight.shape[0] or \
            tuple(c.shape) != (x.shape[1], weight.shape[1]):
        raise RuntimeError(f"_npu_matmul_add_fp32: x {list(x.shape)}, weight {list(weight.shape)}, c {list(c.shape)}: "
                           "need x [K, M], weight [K, N], c [M, N]")
    c.add_(x.float().T @ weight.float())
    return c


def npu_prefetch(*args: Any, **kwargs: Any) -> None:
    """``torch_npu.npu_prefetch``: cache prefetch hint; changes no value (nothing to do on the CPU)."""


OPS = {
    "npu_rms_norm": npu_rms_norm,
    "npu_add_rms_norm": npu_add_rms_norm,
    "_npu_rotary_embedding": _npu_rotary_embedding,
    "npu_prefetch": npu_prefetch,
    "_npu_matmul_add_fp32": _npu_matmul_add_fp32,
}
