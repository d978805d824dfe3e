"""Attention test cases over the real vllm-ascend metadata builder, and the transformers reference.

:func:`build_case` lays out one batch the way vLLM + vllm-ascend would at run time: a paged KV cache
``(num_blocks, block_size, KV_N, D)`` holding each sequence's earlier tokens under a shuffled block
table, the new tokens' q/k/v, and the :class:`AscendMetadata` made by vllm-ascend's own
``AscendAttentionMetadataBuilder.build`` from an ``AscendCommonAttentionMetadata``; the attention
state and mask follow ``NPUModelRunner._build_attn_state`` / ``_make_attention_mask``
(vllm_ascend/worker/model_runner_v1.py) with vllm-ascend's ``AttentionMaskBuilder``. Every supported layout
(0.11 B, 0.12.0rc1 C, 0.13.x E, 0.14.0rc1 F) is built with the installed release's own classes; where the model
runners differ - which fields the common metadata has, who makes the mask (:data:`RUNNER_MASK`), who pads a graph
decode batch (:data:`DECODE_PADDING`), how vLLM calls the impl (:func:`forward_as_vllm`) - the layout decides.

:func:`reference_output` computes the same batch with Hugging Face transformers' GPT-OSS
``eager_attention_forward`` (sinks joined to the softmax) and transformers' own mask functions
(``causal_mask_function``, ``sliding_window_causal_mask_function``) - the oracle of the tests.
"""

from __future__ import annotations

import contextlib
import os
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


def installed_layout() -> str:
    """Module-layout family (``gptoss_patch.matrix.LAYOUTS`` key) of the installed vllm-ascend, from the matrix row
    gptoss-patch applied to in this process.

    Raises:
        RuntimeError: gptoss-patch is not applied here (no row / not activated).
    """
    import vllm_ascend  # noqa: F401 - its import activates gptoss-patch (the .pth start-up hook)

    import gptoss_patch
    from gptoss_patch import matrix

    st = gptoss_patch.status()
    row = next((r for r in matrix.ROWS if r.vllm_ascend == st.row), None)
    if st.decision != matrix.APPLY or row is None or row.layout is None:
        raise RuntimeError(f"gptoss-patch is not applied in this process ({st.decision}: {st.reason})")
    return row.layout


#: How ``NPUModelRunner`` hands the attention mask to the metadata builder, per layout:
#: ``per_state``: 0.11 ``_make_attention_mask(seq_lens, position, attn_state)`` - a state-dependent mask in
#: ``AscendCommonAttentionMetadata.attn_mask``; ``splitfuse``: 0.12.0rc1 ``_make_attention_mask(attn_state)`` -
#: ``get_splitfuse_attn_mask()`` (2048x2048 int8 causal template) for every non-MLA state; ``builder``: 0.13+ - the
#: common metadata has no mask, ``AscendAttentionMetadataBuilder.build`` takes it from its ``AttentionMaskBuilder``.
RUNNER_MASK = {"B": "per_state", "C": "splitfuse", "E": "builder", "F": "builder"}

#: Who pads a DecodeOnly batch up to the graph size ``num_input_tokens`` in FULL decode mode, per layout:
#: ``builder``: 0.11 ``AscendAttentionMetadataBuilder.build`` (seq_lens ones, query offsets one entry short);
#: ``runner_device_only``: 0.12.0rc1 ``NPUModelRunner._prepare_inputs`` pads the request count and the *device*
#: ``query_start_loc`` only - the host offsets and ``seq_lens`` of the padding requests keep an earlier step's values;
#: ``runner``: 0.13.x / 0.14.0rc1 ``_prepare_inputs`` pads the host ``query_start_loc`` (``arange``) and ``seq_lens``
#: (zeros) and the request count.
DECODE_PADDING = {"B": "builder", "C": "runner_device_only", "E": "runner", "F": "runner"}

#: Where ``NPUModelRunner`` keeps the ``seq_lens`` of the common metadata, per layout: 0.11 passes
#: ``self.seq_lens_cpu[:num_reqs]`` (host); 0.12.0rc1 - 0.14.0rc1 ``self.seq_lens.gpu[:num_reqs]`` (device), beside
#: ``seq_lens_cpu`` (vllm_ascend/worker/model_runner_v1.py ``_prepare_inputs``). The other tensors the runners pass:
#: ``query_start_loc``, ``block_table_tensor``, ``slot_mapping``, the mask on the device; ``*_cpu`` on the host.
SEQ_LENS_ON_DEVICE = {"B": False, "C": True, "E": True, "F": True}

#: The device the harnesses place what the model runner keeps in NPU memory on: the NPU (the simulator maps it to
#: host memory and, under its placement audit, keeps track of what was placed; npu_sim/placement.py).
NPU = "npu"


def attn_state_for(seqs: Sequence[tuple[int, int]], chunked_prefill: bool = True):
    """``NPUModelRunner._build_attn_state`` for ``(context, new)`` pairs, no speculative decoding: the same rule in
    0.11 - 0.14 and 0.15.0rc1 - 0.19.1rc1 (``model_runner_v1.py``; the native harness uses it too)."""
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    if all(c == 0 for c, _ in seqs):
        return AscendAttentionState.PrefillNoCache
    if all(n == 1 for _, n in seqs):
        return AscendAttentionState.DecodeOnly
    if chunked_prefill:
        return AscendAttentionState.ChunkedPrefill
    return AscendAttentionState.PrefillCacheHit


def runner_mask(state, seqs, dtype, layout: str, device: Any = NPU):
    """The ``attn_mask`` the model runner of ``layout`` puts into the common metadata (None: the builder makes it),
    made by vllm-ascend's ``AttentionMaskBuilder`` on the runner's device."""
    from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    kind = RUNNER_MASK[layout]
    device = torch.device(device)
    if kind == "builder":
        return None
    if kind == "splitfuse":
        return AttentionMaskBuilder(device).get_splitfuse_attn_mask()
    builder = AttentionMaskBuilder(max_seq_len=2048, dtype=dtype, device=device)
    if state == AscendAttentionState.ChunkedPrefill:
        return builder.get_splitfuse_attn_mask()
    if state == AscendAttentionState.PrefillNoCache:
        return builder.get_attn_mask(max(c + n for c, n in seqs), dtype, device)
    if state == AscendAttentionState.PrefillCacheHit:
        return builder.get_attn_mask(128, dtype, device)
    return None


def builder_config(*, max_model_len: int = 4096, dtype: torch.dtype = torch.float32, sliding_window: int = 128):
    """What ``AscendAttentionMetadataBuilder.__init__`` / ``build`` read from the ``VllmConfig`` (0.11 - 0.14): the
    model's length, dtype, runner type and (0.13+, for ``swa_mask``) ``hf_text_config.sliding_window`` (GPT-OSS: 128);
    no speculative decoding; chunked prefill on."""
    model = types.SimpleNamespace(max_model_len=max_model_len, runner_type="generate", dtype=dtype, use_mla=False,
                                  hf_text_config=types.SimpleNamespace(sliding_window=sliding_window))
    return types.SimpleNamespace(model_config=model, speculative_config=None, compilation_config=None,
                                 scheduler_config=types.SimpleNamespace(enable_chunked_prefill=True),
                                 kv_transfer_config=None)


def make_builder(device: Any = NPU, **config):
    """vllm-ascend's own ``AscendAttentionMetadataBuilder`` on ``device`` (the runner passes its NPU device;
    kv-cache spec None: a decoder layer; see :func:`builder_config` for ``config``)."""
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder

    return AscendAttentionMetadataBuilder(None, [], builder_config(**config), torch.device(device))


def common_metadata(**fields):
    """vllm-ascend's ``AscendCommonAttentionMetadata`` from the fields the installed release declares.

    The model runners of 0.11 - 0.14 set different field sets (0.12.0rc1 adds ``spec_attn_mask`` ...; 0.13+ inherit
    vLLM's ``CommonAttentionMetadata`` with ``max_seq_len`` and drop ``attn_mask``); fields the class does not
    declare are left out, as the runner of that release does not pass them.

    Raises:
        TypeError: a field the class requires is missing (named by the dataclass).
    """
    import dataclasses

    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    names = {f.name for f in dataclasses.fields(AscendCommonAttentionMetadata)}
    return AscendCommonAttentionMetadata(**{k: v for k, v in fields.items() if k in names})


def build_case(seqs: Sequence[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int = 64,
               block_size: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0, state=None,
               max_model_len: int = 4096, pad_to: int | None = None, layout: str | None = None,
               device: Any = NPU) -> Case:
    """Build a batch of sequences given as ``(context_len, new_len)`` pairs (context already in the cache).

    The metadata is what the real ``AscendAttentionMetadataBuilder.build`` of the installed release makes from the
    common metadata its ``NPUModelRunner`` would pass (mask: :data:`RUNNER_MASK`; decode padding:
    :data:`DECODE_PADDING`).

    Args:
        seqs: per sequence, tokens already cached and tokens computed now.
        num_heads / num_kv_heads / head_dim: per-rank attention geometry.
        block_size: KV block size (128 is vllm-ascend's supported size from 0.11.0rc2 on).
        dtype: q/k/v and cache dtype.
        seed: generator seed; physical blocks are assigned in shuffled order.
        state: force an :class:`AscendAttentionState` (default: the model runner's rule).
        pad_to: decode graph padding - total input tokens after padding (``num_input_tokens``).
        layout: module-layout family (default :func:`installed_layout`).
        device: where the runner's device tensors go (q/k/v, caches, ``query_start_loc``, ``block_table_tensor``,
            ``slot_mapping``, the mask, ``seq_lens`` where :data:`SEQ_LENS_ON_DEVICE`); ``full_k``/``full_v``, the
            reference's inputs, and the ``*_cpu`` fields stay on the host.
    """
    layout = layout or installed_layout()
    g = torch.Generator().manual_seed(seed)
    n_blocks_each = [-(-(c + n) // block_size) for c, n in seqs]
    total_blocks = sum(n_blocks_each) + 2
    perm = torch.randperm(total_blocks, generator=g)
    max_blocks = max(n_blocks_each)
    k_cache = torch.randn(total_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)  # garbage
    v_cache = torch.randn(total_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q_parts, k_parts, v_parts, slots, full_k, full_v, tables = [], [], [], [], [], [], []
    nxt = 0
    for i, (c, n) in enumerate(seqs):
        blocks = perm[nxt:nxt + n_blocks_each[i]]
        nxt += n_blocks_each[i]
        tables.append(blocks.to(torch.int32))
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
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    kv_lens = [c + n for c, n in seqs]
    state = state if state is not None else attn_state_for(seqs)
    num_actual = int(sum(q_lens))
    num_reqs = len(seqs)
    padding = DECODE_PADDING[layout] if pad_to and pad_to > num_actual else None
    if padding in ("runner", "runner_device_only"):
        from vllm_ascend.attention.attention_v1 import AscendAttentionState

        if state != AscendAttentionState.DecodeOnly or max(q_lens) != 1:
            raise ValueError("pad_to pads a DecodeOnly batch (one new token per sequence)")
        pad = pad_to - num_reqs
        if padding == "runner":  # host offsets continue with arange, padding requests have length 0
            cu += list(range(num_actual + 1, pad_to + 1))
            kv_lens += [0] * pad
        else:  # an earlier (mixed) step's host values stay in the padding entries (0.12.0rc1; see DECODE_PADDING)
            stale = torch.randint(1, 300, (pad,), generator=g).tolist()
            cu += [cu[-1] + 40 + int(x) for x in torch.tensor(stale).cumsum(0).tolist()]
            kv_lens += torch.randint(1, max_blocks * block_size + 1, (pad,), generator=g).tolist()
        tables += [torch.randint(0, total_blocks, (max_blocks,), generator=g).to(torch.int32) for _ in range(pad)]
        num_reqs = pad_to
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = t
    q_start = torch.tensor(cu, dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    computed = torch.tensor([c for c, _ in seqs] + [0] * (num_reqs - len(seqs)), dtype=torch.int32)
    common = common_metadata(
        query_start_loc=q_start.to(device), query_start_loc_cpu=q_start, seq_lens_cpu=seq_lens,
        seq_lens=seq_lens.to(device) if SEQ_LENS_ON_DEVICE[layout] else seq_lens.clone(),
        num_computed_tokens_cpu=computed, num_reqs=num_reqs, num_actual_tokens=num_actual, max_query_len=max(q_lens),
        max_seq_len=max(kv_lens), decode_token_per_req=1, block_table_tensor=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int32).to(device), actual_seq_lengths_q=q_start[1:].tolist(),
        positions=None, attn_mask=runner_mask(state, seqs, dtype, layout, device), attn_state=state,
        num_input_tokens=pad_to or num_actual)
    builder = make_builder(device, max_model_len=max_model_len, dtype=dtype)
    metadata = builder.build(0, common)
    if pad_to and pad_to > num_actual:
        pad = pad_to - num_actual
        query = torch.cat([query, torch.zeros(pad, query.shape[1], dtype=dtype)])
        key = torch.cat([key, torch.zeros(pad, key.shape[1], dtype=dtype)])
        value = torch.cat([value, torch.zeros(pad, value.shape[1], dtype=dtype)])
    return Case(list(seqs), num_heads, num_kv_heads, head_dim, query.to(device), key.to(device), value.to(device),
                k_cache.to(device), v_cache.to(device), metadata, state, full_k, full_v)


def calls_forward_with_trace_flag(layout: str) -> bool:
    """True when vLLM reaches ``impl.forward`` of ``layout`` through vllm-ascend 0.11's own custom op
    (``unified_ascend_attention_with_output`` -> ``forward(..., trace_flag=False)``); from 0.12.0rc1 on vLLM's
    ``unified_attention_with_output`` calls ``forward(..., output=, output_scale=, output_block_scale=)``
    (docs/upstream.md §7.1). Read from the matrix: the layout patches the 0.11 ``forward``."""
    from gptoss_patch import matrix

    return "attention_impl_forward_011" in matrix.LAYOUTS[layout]


def forward_as_vllm(impl, layer, query, key, value, kv_cache, metadata, output, *, layout: str, forward=None):
    """Call ``impl.forward`` (or ``forward(impl, ...)``) the way vLLM's attention op of ``layout`` does.

    0.11: ``query`` ``[T, N*D]``, ``trace_flag=False`` (the custom op's call). 0.12+: ``query``/``key``/``value``/
    ``output`` viewed ``[T, heads, head_size]`` as ``vllm.attention.layer.unified_attention_with_output`` passes them,
    ``output_scale=None``, ``output_block_scale=None``. Returns whatever ``forward`` returns.
    """
    fwd = forward or type(impl).forward
    if calls_forward_with_trace_flag(layout):
        return fwd(impl, layer, query, key, value, kv_cache, metadata, output=output, trace_flag=False)
    n, kvn, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    return fwd(impl, layer, query.view(-1, n, d), key.view(-1, kvn, d), value.view(-1, kvn, d), kv_cache, metadata,
               output=output.view(-1, n, d), output_scale=None, output_block_scale=None)


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
    q_all = case.query.cpu().float().view(-1, case.num_heads, case.head_dim)
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


@contextlib.contextmanager
def forced_path(path: str | None):
    """Context manager: run with ``GPTOSS_PATCH_ATTENTION_PATH=path`` (None: unset), the process-wide choice reset.

    The operator path is otherwise fixed once per process (:func:`gptoss_patch.kernels.attention.chosen_path`); tests and benchmarks use this
    to exercise both paths in one process. Restores the variable and forgets the choice on exit.
    """
    from gptoss_patch.kernels import attention as kernels

    old = os.environ.get("GPTOSS_PATCH_ATTENTION_PATH")
    if path is None:
        os.environ.pop("GPTOSS_PATCH_ATTENTION_PATH", None)
    else:
        os.environ["GPTOSS_PATCH_ATTENTION_PATH"] = path
    kernels._path = None
    try:
        yield
    finally:
        kernels._path = None
        if old is None:
            os.environ.pop("GPTOSS_PATCH_ATTENTION_PATH", None)
        else:
            os.environ["GPTOSS_PATCH_ATTENTION_PATH"] = old


_CONFIG: list = []


def make_impl(num_heads: int, num_kv_heads: int, window: int | None, sinks: torch.Tensor | None, head_dim: int = 64):
    """``AscendAttentionBackendImpl`` of the installed release (0.11 - 0.14, patched) as vLLM's ``Attention.__init__``
    builds it: positional ``(num_heads, head_size, scale = head_dim**-0.5, num_kv_heads, alibi_slopes, sliding_window,
    kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name)`` inside ``set_current_vllm_config``
    (0.13+ read it in ``__init__``), ``sinks=`` ``[num_heads]`` as the keyword GPT-OSS passes
    (vllm/model_executor/models/gpt_oss.py ``OAIAttention``); ``sinks=None`` builds a layer without sinks."""
    import vllm_ascend.attention.attention_v1 as aa
    from vllm.config import VllmConfig, set_current_vllm_config

    if not _CONFIG:
        _CONFIG.append(VllmConfig())
    kwargs = {} if sinks is None else {"sinks": sinks.to(NPU)}  # the layer's parameter, in NPU memory
    with set_current_vllm_config(_CONFIG[0]):
        return aa.AscendAttentionBackendImpl(num_heads, head_dim, head_dim ** -0.5, num_kv_heads, None, window,
                                             "auto", None, "decoder", None, **kwargs)


class _Layer:
    """What upstream's forward reads from the vLLM ``Attention`` layer on this path (k/v scales)."""

    _k_scale_float = 1.0
    _v_scale_float = 1.0
    layer_name = "model.layers.0.self_attn.attn"


@contextlib.contextmanager
def eager_forward_context(metadata):
    """vLLM's forward context of an eager step (upstream's decode path reads ``capturing`` from it)."""
    from vllm.forward_context import ForwardContext, override_forward_context

    ctx = ForwardContext(no_compile_layers={}, attn_metadata=metadata, virtual_engine=0)
    ctx.capturing = False  # set by vllm-ascend's set_ascend_forward_context
    with override_forward_context(ctx):
        yield ctx


def run_forward(impl, case: Case, output: torch.Tensor | None = None, forward=None):
    """``impl.forward`` as vLLM calls it in this release (:func:`forward_as_vllm`, eager forward context).

    Returns:
        ``(output buffer [T, N, D] in the query dtype, pre-filled with NaN so unwritten rows show; the return
        value of forward)``.
    """
    out = output if output is not None else torch.full((case.num_tokens, impl.num_heads, impl.head_size),
                                                       float("nan"), dtype=case.query.dtype, device=NPU)
    with eager_forward_context(case.metadata):
        ret = forward_as_vllm(impl, _Layer(), case.query, case.key, case.value, (case.key_cache, case.value_cache),
                              case.metadata, out, layout=installed_layout(), forward=forward)
    return out, ret
