"""Attention test cases over the real vllm-ascend metadata builder, and the transformers reference.

:func:`build_case` lays out one batch the way vLLM + vllm-ascend would at run time: a paged KV cache
``(num_blocks, block_size, KV_N, D)`` holding each sequence's earlier tokens under a shuffled block
table, the new tokens' q/k/v, and the :class:`AscendMetadata` made by vllm-ascend's own
``AscendAttentionMetadataBuilder.build`` from an ``AscendCommonAttentionMetadata``; the attention
state and mask follow ``NPUModelRunner._build_attn_state`` / ``_make_attention_mask``
(vllm_ascend/worker/model_runner_v1.py) with vllm-ascend's ``AttentionMaskBuilder``.

:func:`reference_output` computes the same batch with Hugging Face transformers' GPT-OSS
``eager_attention_forward`` (sinks joined to the softmax) and transformers' own mask functions
(``causal_mask_function``, ``sliding_window_causal_mask_function``) - the oracle of the tests.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class Case:
    """One batch. Shapes: ``query`` ``[T, N*D]``, ``key``/``value`` ``[T, KV_N*D]``, caches
    ``[num_blocks, block_size, KV_N, D]``; ``full_k``/``full_v`` per sequence ``[Skv_i, KV_N, D]``."""

    seqs: list[tuple[int, int]]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: Any
    state: Any
    full_k: list[torch.Tensor] = field(default_factory=list)
    full_v: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]


def attn_state_for(seqs: Sequence[tuple[int, int]], chunked_prefill: bool = True):
    """vllm-ascend 0.11 ``NPUModelRunner._build_attn_state`` for ``(context, new)`` pairs (no speculative decoding)."""
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    if all(c == 0 for c, _ in seqs):
        return AscendAttentionState.PrefillNoCache
    if all(n == 1 for _, n in seqs):
        return AscendAttentionState.DecodeOnly
    if chunked_prefill:
        return AscendAttentionState.ChunkedPrefill
    return AscendAttentionState.PrefillCacheHit


def _mask_for(state, seqs, dtype):
    """vllm-ascend 0.11 ``NPUModelRunner._make_attention_mask`` with its ``AttentionMaskBuilder``."""
    from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    builder = AttentionMaskBuilder(max_seq_len=2048, dtype=dtype, device=torch.device("cpu"))
    if state == AscendAttentionState.ChunkedPrefill:
        return builder.get_splitfuse_attn_mask()
    if state == AscendAttentionState.PrefillNoCache:
        return builder.get_attn_mask(max(c + n for c, n in seqs), dtype, torch.device("cpu"))
    if state == AscendAttentionState.PrefillCacheHit:
        return builder.get_attn_mask(128, dtype, torch.device("cpu"))
    return None


def build_case(seqs: Sequence[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int = 64,
               block_size: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0, state=None,
               max_model_len: int = 4096, pad_to: int | None = None) -> Case:
    """Build a batch of sequences given as ``(context_len, new_len)`` pairs (context already in the cache).

    Args:
        seqs: per sequence, tokens already cached and tokens computed now.
        num_heads / num_kv_heads / head_dim: per-rank attention geometry.
        block_size: KV block size (128 is vllm-ascend 0.11's only supported size).
        dtype: q/k/v and cache dtype.
        seed: generator seed; physical blocks are assigned in shuffled order.
        state: force an :class:`AscendAttentionState` (default: the model runner's rule).
        pad_to: decode graph padding - total input tokens after padding (``num_input_tokens``).
    """
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    n_blocks_each = [-(-(c + n) // block_size) for c, n in seqs]
    total_blocks = sum(n_blocks_each) + 2
    perm = torch.randperm(total_blocks, generator=g)
    max_blocks = max(n_blocks_each)
    block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(total_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)  # garbage
    v_cache = torch.randn(total_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q_parts, k_parts, v_parts, slots, full_k, full_v = [], [], [], [], [], []
    nxt = 0
    for i, (c, n) in enumerate(seqs):
        blocks = perm[nxt:nxt + n_blocks_each[i]]
        nxt += n_blocks_each[i]
        block_table[i, :len(blocks)] = blocks.to(torch.int32)
        kk = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        vv = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        full_k.append(kk)
        full_v.append(vv)
        for p in range(c):  # the cached context
            k_cache[blocks[p // block_size], p % block_size] = kk[p]
            v_cache[blocks[p // block_size], p % block_size] = vv[p]
        q_parts.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        k_parts.append(kk[c:])
        v_parts.append(vv[c:])
        slots += [int(blocks[p // block_size]) * block_size + p % block_size for p in range(c, c + n)]
    query = torch.cat(q_parts).reshape(-1, num_heads * head_dim)
    key = torch.cat(k_parts).reshape(-1, num_kv_heads * head_dim)
    value = torch.cat(v_parts).reshape(-1, num_kv_heads * head_dim)
    q_lens = [n for _, n in seqs]
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    state = state if state is not None else attn_state_for(seqs)
    num_actual = int(sum(q_lens))
    common = AscendCommonAttentionMetadata(
        query_start_loc=q_start.clone(), query_start_loc_cpu=q_start, seq_lens_cpu=seq_lens, seq_lens=seq_lens.clone(),
        num_computed_tokens_cpu=torch.tensor([c for c, _ in seqs], dtype=torch.int32), num_reqs=len(seqs),
        num_actual_tokens=num_actual, max_query_len=max(q_lens), decode_token_per_req=1,
        block_table_tensor=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int32),
        actual_seq_lengths_q=q_start[1:].tolist(), positions=None, attn_mask=_mask_for(state, seqs, dtype),
        attn_state=state, num_input_tokens=pad_to or num_actual)
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=max_model_len),
                                   speculative_config=None)
    builder = AscendAttentionMetadataBuilder(None, [], config, torch.device("cpu"))
    metadata = builder.build(0, common)
    if pad_to and pad_to > num_actual:
        pad = pad_to - num_actual
        query = torch.cat([query, torch.zeros(pad, query.shape[1], dtype=dtype)])
        key = torch.cat([key, torch.zeros(pad, key.shape[1], dtype=dtype)])
        value = torch.cat([value, torch.zeros(pad, value.shape[1], dtype=dtype)])
    return Case(list(seqs), num_heads, num_kv_heads, head_dim, query, key, value, k_cache, v_cache, metadata,
                state, full_k, full_v)


def reference_output(case: Case, *, sinks: torch.Tensor, sliding_window: int | None, scale: float) -> torch.Tensor:
    """``[num_actual_tokens, N, D]`` float32 output of transformers' GPT-OSS eager attention for ``case``."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    holder = torch.nn.Module()
    holder.sinks = torch.nn.Parameter(sinks.detach().float(), requires_grad=False)
    holder.num_key_value_groups = case.num_heads // case.num_kv_heads
    holder.eval()
    mask_fn = causal_mask_function if sliding_window is None else sliding_window_causal_mask_function(sliding_window)
    outs = []
    q_all = case.query.float().view(-1, case.num_heads, case.head_dim)
    start = 0
    for i, (c, n) in enumerate(case.seqs):
        q = q_all[start:start + n].transpose(0, 1).unsqueeze(0)          # [1, N, n, D]
        k = case.full_k[i].float().transpose(0, 1).unsqueeze(0)           # [1, KV_N, c+n, D]
        v = case.full_v[i].float().transpose(0, 1).unsqueeze(0)
        qi = torch.arange(c, c + n).view(-1, 1)
        kj = torch.arange(c + n).view(1, -1)
        allowed = mask_fn(0, 0, qi, kj)
        additive = torch.zeros(n, c + n).masked_fill(~allowed, float("-inf")).view(1, 1, n, c + n)
        out, _ = eager_attention_forward(holder, q, k, v, additive, scaling=scale)
        outs.append(out[0])                                               # [n, N, D]
        start += n
    return torch.cat(outs)
