"""The main job: a GPT-OSS checkpoint through vLLM's own model and patched vllm-ascend, on the NPU simulator.

Real upstream code in the loop: vLLM's ``EngineArgs``/``VllmConfig``, ``GptOssForCausalLM`` and its
BF16 weight loader (``DefaultModelLoader``), vLLM's distributed groups (gloo, world size 1), vLLM's
KV-cache grouping (``vllm.v1.core.kv_cache_utils.get_kv_cache_groups``) and, from vllm-ascend 0.14.0rc1
on, the layers' own ``Attention.get_kv_cache_spec``; vllm-ascend's worker start-up sequence
(``NPUWorker.__init__``: ``adapt_patch``, ``register_ascend_customop`` - FusedMoE → AscendFusedMoE, YaRN
rope, ...), its attention backend and ``AscendAttentionMetadataBuilder`` (one per KV-cache group), its
``AttentionMaskBuilder``, ``set_ascend_forward_context``, the MoE communication methods and, for
FULL_DECODE_ONLY, its ``ACLGraphWrapper``, graph parameters and graph-parameter update; the ``torch_npu``
operators are the simulator's.

Ours: this runner's scheduling (which tokens run in which step, chunked prefill with a token
budget, prefix reuse of whole KV blocks, the block allocator) - the role of vLLM's scheduler and
``KVCacheManager`` and of ``NPUModelRunner._prepare_inputs``, kept small and explicit - and the greedy
loop. What ``NPUModelRunner`` does differently per vllm-ascend release is data: :data:`RUNNER_RULES`, one
entry per module layout of :data:`gptoss_patch.matrix.LAYOUTS`, each rule restated from the release's
``worker/model_runner_v1.py`` (``NPUModelRunner`` cannot be built here: its module imports ``numba``, which
the cells do not install).

KV-cache groups: up to vllm-ascend 0.13.0 the runner gives every decoder layer a ``FullAttentionSpec``
(one group, one block table); from 0.14.0rc1 it asks each layer (``Attention.get_kv_cache_spec``), so
GPT-OSS's sliding-window layers get a ``SlidingWindowSpec`` and vLLM makes two groups, each with its own
block table, slot mapping and attention metadata, sharing the KV tensors as
``get_kv_cache_config_from_groups`` lays them out. vLLM's ``SlidingWindowManager`` replaces the blocks of a
sliding-window group that have left the window with the null block (block 0);
``null_out_of_window=True`` does the same to the block tables the kernels see (the blocks stay allocated
here) and fills the null block with large random values, so any read of an out-of-window key shows.

Graph mode keeps the eager engine config: a FULL_DECODE_ONLY deployment would also ``torch.compile`` the model;
here the eager model is wrapped in ``ACLGraphWrapper`` directly (as ``NPUModelRunner.load_model`` wraps it), graphs
are captured on a size's first decode step instead of at start-up, and capture sizes are the decode batch sizes
1..``max_decode_batch`` (no padding). On the forward path only ``attention.utils.using_paged_attention`` (0.13.0+)
reads ``compilation_config.cudagraph_mode``; it answers False for both configs unless
``additional_config.pa_shape_list`` is set.

The reference is transformers' ``GptOssForCausalLM`` in float32 on the same checkpoint and token ids.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

#: ``BlockPool.null_block`` (vllm/v1/core/block_pool.py): block 0 is never handed out; block tables point freed or
#: padded entries at it.
NULL_BLOCK = 0


@dataclass(frozen=True)
class RunnerRules:
    """How vllm-ascend's ``NPUModelRunner`` of one module layout prepares a step (restated from its source).

    Attributes:
        mask: where the attention mask comes from. ``"per-state"``: the runner's ``_make_attention_mask``
            (0.11.x: the splitfuse mask for ChunkedPrefill, a causal ``max(seq_lens)`` mask for PrefillNoCache, a
            128x128 one for PrefillCacheHit, none for DecodeOnly), passed in
            ``AscendCommonAttentionMetadata.attn_mask``;
            ``"splitfuse"``: 0.12.0rc1's ``_make_attention_mask`` (non-MLA, non-pooling: always
            ``AttentionMaskBuilder.get_splitfuse_attn_mask()``), passed the same way; ``"builder"``: 0.13.0+, the
            metadata builder asks its own ``AttentionMaskBuilder`` (``AscendCommonAttentionMetadata`` has no mask).
        kv_spec: ``"full"``: ``NPUModelRunner.get_kv_cache_spec`` makes a ``FullAttentionSpec`` for every decoder
            ``Attention`` (sliding window ignored); ``"layer"``: 0.14.0rc1 calls ``attn_module.get_kv_cache_spec``.
        graph_update: the FULL-graph parameter update ``_generate_process_reqs_hidden_states`` calls after a replay:
            ``"update_attn_params"`` (0.11.x, 0.12.0rc1: ``(update_stream, forward_context, num_tokens)``; 0.11.0's
            extra ``kv_transfer_config`` is ``None`` here), ``"update_attn_params+config"`` (0.13.x: ``(...,
            vllm_config)``), ``"update_full_graph_params"`` (0.14.0rc1: ``(attn_backend, update_stream,
            forward_context, num_tokens, vllm_config, speculative_config)``).
        update_cos_sin: 0.13.0+ refresh ``ops.rotary_embedding``'s global cos/sin for the step's positions
            (``update_cos_sin(positions)``; 0.13.0 in ``_prepare_inputs``, 0.14.0rc1 in ``execute_model``).
        source: the release files the rules were read from.
    """

    mask: str
    kv_spec: str
    graph_update: str
    update_cos_sin: bool
    source: str


RUNNER_RULES: dict[str, RunnerRules] = {
    "B": RunnerRules("per-state", "full", "update_attn_params", False,
                     "vllm_ascend 0.11.0 worker/model_runner_v1.py: _make_attention_mask, get_kv_cache_spec, "
                     "_generate_process_reqs_hidden_states"),
    "C": RunnerRules("splitfuse", "full", "update_attn_params", False,
                     "vllm_ascend 0.12.0rc1 worker/model_runner_v1.py: _make_attention_mask, get_kv_cache_spec, "
                     "_generate_process_reqs_hidden_states"),
    "E": RunnerRules("builder", "full", "update_attn_params+config", True,
                     "vllm_ascend 0.13.0 worker/model_runner_v1.py: _prepare_inputs, get_kv_cache_spec, "
                     "_generate_process_reqs_hidden_states; attention/attention_v1.py: "
                     "AscendAttentionMetadataBuilder.build"),
    "F": RunnerRules("builder", "layer", "update_full_graph_params", True,
                     "vllm_ascend 0.14.0rc1 worker/model_runner_v1.py: execute_model, get_kv_cache_spec, "
                     "_generate_process_reqs_hidden_states; attention/attention_v1.py: "
                     "AscendAttentionMetadataBuilder.build"),
}


def ascend_context(checkpoint: str | os.PathLike, *, dtype: str = "bfloat16", max_model_len: int = 2048,
                   **engine_args: Any):
    """vLLM + vllm-ascend worker state as ``NPUWorker.__init__`` sets it up; yields the ``VllmConfig``.

    See :func:`gptoss_patch.selftest.worker.ascend_context` (world size 1, gloo, the NPU simulator).
    """
    from gptoss_patch.selftest import worker as vllm_setup

    return vllm_setup.ascend_context(checkpoint, dtype=dtype, max_model_len=max_model_len, **engine_args)


@dataclass
class Request:
    """One conversation: its prompt token ids and what greedy decoding produced."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 [vocab] per generated token
    forced: list[int] | None = None  # teacher forcing: feed these instead of our own outputs
    computed: int = 0            # tokens whose K/V are in the cache
    blocks: list[list[int]] = field(default_factory=list)  # per KV-cache group: physical block ids

    @property
    def tokens(self) -> list[int]:
        """What the model is fed: the prompt, then our outputs (or the forced tokens, one per output)."""
        if self.forced is not None:
            return self.prompt + self.forced[:len(self.output)]
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class KVGroup:
    """One KV-cache group (vLLM ``KVCacheGroupSpec``) and what the runner keeps for it."""

    spec: Any                      # vllm.v1.kv_cache_interface.{FullAttentionSpec, SlidingWindowSpec}
    layer_names: list[str]
    builder: Any                   # the group's AscendAttentionMetadataBuilder
    prefix_blocks: dict = field(default_factory=dict)  # full-block token prefix -> physical block

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.spec, "sliding_window", None) if type(self.spec).__name__ == "SlidingWindowSpec" \
            else None


def _fill(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` restricted to the fields ``cls`` declares (a dataclass of the installed release).

    Raises:
        TypeError: ``cls`` declares a field without a default that ``values`` does not provide (a release whose
            metadata needs something this runner does not know about yet).
    """
    declared = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in declared.items() if f.init and n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} needs {missing}, which the runner does not provide; "
                        f"it provides {sorted(values)}")
    return cls(**{k: v for k, v in values.items() if k in declared and declared[k].init})


def batch_descriptor(num_tokens: int, uniform_decode: bool) -> Any:
    """``vllm.forward_context.BatchDescriptor`` as vLLM's ``CudagraphDispatcher`` builds it for a batch of
    ``num_tokens`` one-token decodes (``uniform_decode``) that is itself a capture size, or for an eager step.

    vLLM 0.11 (``vllm/v1/cudagraph_dispatcher.py``: ``CudagraphDispatcher.initialize_cudagraph_keys`` /
    ``dispatch``): ``BatchDescriptor(num_tokens=n, uniform_decode=True)`` for a FULL decode graph, ``None`` when it
    dispatches to no graph; vLLM 0.12+ (``_create_padded_batch_descriptor`` / ``dispatch``):
    ``BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True, has_lora=False)``, and ``BatchDescriptor(num_tokens)``
    for no graph.
    """
    from vllm.forward_context import BatchDescriptor

    names = getattr(BatchDescriptor, "_fields", None) or [f.name for f in dataclasses.fields(BatchDescriptor)]
    if "uniform_decode" in names:
        return BatchDescriptor(num_tokens=num_tokens, uniform_decode=True) if uniform_decode else None
    if not uniform_decode:
        return BatchDescriptor(num_tokens)
    return BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens, uniform=True, has_lora=False)


class SimulatedGptOss:
    """vLLM's GptOssForCausalLM on (simulated) vllm-ascend with a paged KV cache and greedy decoding.

    Args:
        config: the ``VllmConfig`` from :func:`ascend_context`.
        num_blocks: KV-cache blocks per KV tensor (block size = ``cache_config.block_size``, 128); block 0 is the
            null block, so ``num_blocks - 1`` can be handed out, shared by all KV-cache groups.
        token_budget: max tokens per step (chunked prefill: prompt chunks fill what decodes leave).
        graph: serve pure decode steps of up to ``max_decode_batch`` requests through FULL_DECODE_ONLY ACL graphs.
        max_decode_batch: the largest graph capture size (sizes 1 .. this).
        null_out_of_window: in sliding-window KV-cache groups, point block-table entries of blocks that left the
            window at the null block, as vLLM's ``SlidingWindowManager.remove_skipped_blocks`` does (the blocks stay
            allocated here), and fill the null block with large random values. Default (None): on whenever vLLM makes
            a sliding-window group (layout F), as vLLM's KV-cache manager then does.

    Raises:
        ValueError: ``null_out_of_window`` on a layout without a sliding-window KV-cache group (nothing to null),
            or a KV-cache dtype other than ``"auto"``.
        RuntimeError: the installed vllm-ascend has no layout in :data:`RUNNER_RULES`.
    """

    def __init__(self, config: Any, *, num_blocks: int = 64, token_budget: int = 256, graph: bool = False,
                 max_decode_batch: int = 8, null_out_of_window: bool | None = None):
        from gptoss_patch.selftest import worker as vllm_setup

        self.layout = vllm_setup.layout()
        if self.layout not in RUNNER_RULES:
            raise RuntimeError(f"no runner rules for module layout {self.layout!r}; known: {sorted(RUNNER_RULES)}")
        self.rules = RUNNER_RULES[self.layout]
        self.config = config
        self.token_budget = token_budget
        self.block_size = config.cache_config.block_size
        t0 = time.perf_counter()
        self.model = vllm_setup.load_model(config)
        self.load_seconds = time.perf_counter() - t0
        self.dtype = config.model_config.dtype
        self.device = torch.device("cpu")  # the simulated NPU's memory is host memory
        self._init_kv_cache(num_blocks)
        self.null_out_of_window = null_out_of_window = self.resolve_null_out_of_window(null_out_of_window)
        self.nulled_entries = 0  # block-table entries pointed at the null block (null_out_of_window)
        if null_out_of_window:
            gen = torch.Generator().manual_seed(1234)
            for k, v in self._kv_tensors:
                for t in (k, v):
                    t[NULL_BLOCK].copy_(torch.randn(t[NULL_BLOCK].shape, generator=gen) * 50)
        self.mask_builder = None
        if self.rules.mask != "builder":
            from vllm_ascend.attention.attention_mask import AttentionMaskBuilder

            if self.rules.mask == "per-state":  # 0.11.x NPUModelRunner.__init__
                self.mask_builder = AttentionMaskBuilder(config.model_config.max_model_len, self.dtype, self.device)
            else:  # 0.12.0rc1 NPUModelRunner.__init__
                self.mask_builder = AttentionMaskBuilder(self.device)
        self.free_blocks = list(range(NULL_BLOCK + 1, num_blocks))
        self.states_seen: set[str] = set()
        self.reused_blocks = 0  # 128-token prefix blocks served from the prefix cache instead of being computed
        self.graph = graph
        self.graph_steps = 0  # decode steps served by replaying a captured ACL graph
        self.captured_sizes: set[int] = set()
        if graph:
            self._init_graph(max_decode_batch)

    def resolve_null_out_of_window(self, requested: bool | None) -> bool:
        """``null_out_of_window`` for this runner's KV-cache groups: ``None`` -> whether a sliding-window group exists.

        Raises:
            ValueError: ``True`` without a sliding-window group (nothing could be pointed at the null block).
        """
        has_window_group = any(g.sliding_window for g in self.groups)
        if requested is None:
            return has_window_group
        if requested and not has_window_group:
            raise ValueError(f"null_out_of_window needs a sliding-window KV-cache group; layout {self.layout} makes "
                             f"{[type(g.spec).__name__ for g in self.groups]}")
        return bool(requested)

    # ---------------------------------------------------------------- KV cache
    def _kv_cache_specs(self) -> dict[str, Any]:
        """Layer name -> ``KVCacheSpec`` as the layout's ``NPUModelRunner.get_kv_cache_spec`` (:class:`RunnerRules`)."""
        from vllm.attention.layer import Attention
        from vllm.config import get_layers_from_vllm_config
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if self.config.cache_config.cache_dtype != "auto":
            raise ValueError(f"kv cache dtype {self.config.cache_config.cache_dtype!r}: the runner supports 'auto' "
                             "(the model dtype)")
        specs = {}
        for name, layer in get_layers_from_vllm_config(self.config, Attention).items():
            if self.rules.kv_spec == "layer":
                specs[name] = layer.get_kv_cache_spec(self.config)
            else:
                specs[name] = FullAttentionSpec(block_size=self.block_size, num_kv_heads=layer.num_kv_heads,
                                                head_size=layer.head_size, dtype=self.dtype)
        return specs

    def _init_kv_cache(self, num_blocks: int) -> None:
        """KV-cache groups (vLLM's ``get_kv_cache_groups``), the shared KV tensors and one metadata builder per group.

        Tensors as ``get_kv_cache_config_from_groups`` lays them out (vllm/v1/core/kv_cache_utils.py, the general
        case): ``group_size = max(len(group.layer_names))`` tensors, tensor ``i`` shared by the ``i``-th layer of each
        group; each split into a K and a V cache of ``AscendAttentionBackend.get_kv_cache_shape(...)[1:]``
        (``NPUModelRunner._allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors``). Layers of different groups
        use different blocks of the same tensor, so the block pool is shared.
        """
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
        from vllm.v1.worker.utils import bind_kv_cache

        ctx = self.config.compilation_config.static_forward_context
        specs = self._kv_cache_specs()
        vllm_groups = get_kv_cache_groups(self.config, specs)
        self.attn_backend = ctx[vllm_groups[0].layer_names[0]].attn_backend
        group_size = max(len(g.layer_names) for g in vllm_groups)
        caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kv_tensors = []
        for i in range(group_size):
            shared_by = [g.layer_names[i] for g in vllm_groups if i < len(g.layer_names)]
            spec = specs[shared_by[0]]
            shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads,
                                                         spec.head_size)[1:]
            kv = (torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype))
            self._kv_tensors.append(kv)
            for name in shared_by:
                caches[name] = kv
        self.kv_caches: list = []
        bind_kv_cache(caches, ctx, self.kv_caches)
        self.groups = []
        for g in vllm_groups:
            backend = ctx[g.layer_names[0]].attn_backend
            builder = backend.get_builder_cls()(g.kv_cache_spec, g.layer_names, self.config, self.device)
            self.groups.append(KVGroup(g.kv_cache_spec, list(g.layer_names), builder))
        self.layer_names = [n for g in self.groups for n in g.layer_names]

    def _init_graph(self, max_batch: int) -> None:
        """FULL_DECODE_ONLY as ``NPUModelRunner`` sets it up: graph params per capture size (``set_graph_params``:
        0.11 ``load_model``, 0.12 ``initialize_aclgraph_capture``, 0.13+ ``_check_and_update_cudagraph_mode``), the
        model wrapped in vllm-ascend's ``ACLGraphWrapper`` (FULL, ``load_model``), static input buffers (one block
        table and slot mapping per KV-cache group), an update stream."""
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled
        from vllm.config import CUDAGraphMode
        from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, set_graph_params

        set_graph_params(set(range(1, max_batch + 1)))
        set_cudagraph_capturing_enabled(True)
        self.graph_model = ACLGraphWrapper(self.model, self.config, runtime_mode=CUDAGraphMode.FULL)
        width = -(-self.config.model_config.max_model_len // self.block_size)
        self.static = {"input_ids": torch.zeros(max_batch, dtype=torch.long),
                       "positions": torch.zeros(max_batch, dtype=torch.long),
                       "slots": [torch.zeros(max_batch, dtype=torch.int32) for _ in self.groups],
                       "block_table": [torch.zeros(max_batch, width, dtype=torch.int32) for _ in self.groups]}
        self.update_stream = torch.npu.Stream()

    # ---------------------------------------------------------------- blocks and prefix reuse
    def _reuse_prefix(self, req: Request) -> None:
        """Point the request at cached blocks holding its longest full-block prompt prefix (prefix caching; a hit
        must hold in every group, as vLLM's ``KVCacheCoordinator.find_longest_cache_hit`` requires)."""
        req.blocks = [[] for _ in self.groups]
        n_full = (len(req.prompt) - 1) // self.block_size
        for b in range(n_full):
            key = tuple(req.prompt[:(b + 1) * self.block_size])
            if not all(key in g.prefix_blocks for g in self.groups):
                break
            for g, blocks in zip(self.groups, req.blocks):
                blocks.append(g.prefix_blocks[key])
            req.computed = (b + 1) * self.block_size
            self.reused_blocks += 1

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        for blocks in req.blocks:
            while len(blocks) * self.block_size < upto:
                if not self.free_blocks:
                    raise RuntimeError("KV cache full: raise num_blocks")
                blocks.append(self.free_blocks.pop(0))

    def _publish_prefix(self, req: Request) -> None:
        for b in range(min(req.computed, len(req.prompt)) // self.block_size):
            key = tuple(req.prompt[:(b + 1) * self.block_size])
            for g, blocks in zip(self.groups, req.blocks):
                g.prefix_blocks.setdefault(key, blocks[b])

    def _table_row(self, group: KVGroup, req: Request, gi: int) -> list[int]:
        """The block-table row the kernels see for ``req`` in ``group`` this step.

        With ``null_out_of_window``, in a sliding-window group the first ``(computed - W + 1) // block_size`` entries
        point at the null block (``SlidingWindowManager.get_num_skipped_tokens`` / ``remove_skipped_blocks``, vLLM
        0.14, run by ``KVCacheManager.allocate_slots`` with the request's computed tokens before the step).
        """
        row = list(req.blocks[gi])
        window = group.sliding_window
        if self.null_out_of_window and window:
            skipped = max(0, req.computed - window + 1) // self.block_size
            for i in range(min(skipped, len(row))):
                row[i] = NULL_BLOCK
                self.nulled_entries += 1
        return row

    # ---------------------------------------------------------------- one model step
    def _schedule(self, reqs: Sequence[Request]) -> list[tuple[Request, int]]:
        budget = self.token_budget
        plan = []
        for r in reqs:  # decodes first, one token each
            if not r.done and r.computed >= len(r.prompt):
                plan.append((r, 1))
                budget -= 1
        for r in reqs:  # then prompt chunks
            if r.computed < len(r.prompt) and budget > 0:
                n = min(budget, len(r.prompt) - r.computed)
                plan.append((r, n))
                budget -= n
        return plan

    def _common_metadata(self, *, q_start, seq_t, ctx_lens, plan, n_tok, q_lens, block_table, slot_t, pos_t,
                         state, mask):
        """``AscendCommonAttentionMetadata`` as ``NPUModelRunner._prepare_inputs`` fills it (no speculative decoding:
        ``actual_seq_lengths_q`` is the runner's empty list, ``decode_token_per_req`` 1; 0.12.0rc1 also sets
        ``is_only_prefill`` and ``spec_attn_mask=None``; 0.13.0+ ``max_seq_len=0`` and vLLM's ``causal``)."""
        from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

        values = dict(
            query_start_loc=q_start.clone(), query_start_loc_cpu=q_start, seq_lens_cpu=seq_t, seq_lens=seq_t.clone(),
            num_computed_tokens_cpu=torch.tensor(ctx_lens, dtype=torch.int32), num_reqs=len(plan),
            num_actual_tokens=n_tok, num_input_tokens=n_tok, max_query_len=max(q_lens), decode_token_per_req=1,
            block_table_tensor=block_table, slot_mapping=slot_t, actual_seq_lengths_q=[], positions=pos_t,
            attn_state=state, max_seq_len=0, causal=True, spec_attn_mask=None,
            is_only_prefill=all(n != 1 for n in q_lens))
        if self.rules.mask != "builder":
            values["attn_mask"] = mask
        return _fill(AscendCommonAttentionMetadata, values)

    @torch.inference_mode()  # as vLLM's worker runs execute_model
    def step(self, reqs: Sequence[Request]) -> int:
        """Run one scheduled step over ``reqs``; returns the number of tokens computed (0 when all done)."""
        from vllm.config import CUDAGraphMode

        from gptoss_patch.selftest import worker as vllm_setup
        from gptoss_patch.selftest.attention import attn_state_for

        plan = self._schedule(reqs)
        if not plan:
            return 0
        ids, pos, q_lens, seq_lens, ctx_lens = [], [], [], [], []
        slots: list[list[int]] = [[] for _ in self.groups]
        tables: list[list[list[int]]] = [[] for _ in self.groups]
        for r, n in plan:
            start = r.computed
            self._ensure_blocks(r, start + n)
            ids += r.tokens[start:start + n]
            pos += list(range(start, start + n))
            for gi, g in enumerate(self.groups):
                slots[gi] += [r.blocks[gi][p // self.block_size] * self.block_size + p % self.block_size
                              for p in range(start, start + n)]
                tables[gi].append(self._table_row(g, r, gi))
            q_lens.append(n)
            seq_lens.append(start + n)
            ctx_lens.append(start)
        # NPUModelRunner._build_attn_state: the same rule in 0.11.0 - 0.14.0rc1 without speculative decoding
        state = attn_state_for(list(zip(ctx_lens, q_lens)), self.config.scheduler_config.enable_chunked_prefill)
        graph_step = self.graph and state.name == "DecodeOnly" and len(plan) <= self.static["input_ids"].shape[0]
        b = len(plan)
        block_tables, slot_ts = [], []
        for gi in range(len(self.groups)):
            if graph_step:  # captured graphs read fixed buffers: write this step's values into them
                bt = self.static["block_table"][gi]
                bt[:b].zero_()
                for i, t in enumerate(tables[gi]):
                    bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
                self.static["slots"][gi][:b] = torch.tensor(slots[gi], dtype=torch.int32)
                block_tables.append(bt[:b])
                slot_ts.append(self.static["slots"][gi][:b])
            else:
                width = max(len(t) for t in tables[gi])
                bt = torch.zeros(b, width, dtype=torch.int32)
                for i, t in enumerate(tables[gi]):
                    bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
                block_tables.append(bt)
                slot_ts.append(torch.tensor(slots[gi], dtype=torch.int32))
        if graph_step:
            self.static["input_ids"][:b] = torch.tensor(ids)
            self.static["positions"][:b] = torch.tensor(pos)
            input_ids, positions = self.static["input_ids"][:b], self.static["positions"][:b]
        else:
            input_ids, positions = torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
        self.states_seen.add(state.name)
        q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        n_tok = len(ids)
        mask = self._mask(state, seq_lens)
        per_layer: dict[str, Any] = {}  # in KV-cache-group order, as _prepare_inputs fills it
        for gi, g in enumerate(self.groups):
            common = self._common_metadata(q_start=q_start, seq_t=seq_t, ctx_lens=ctx_lens, plan=plan, n_tok=n_tok,
                                           q_lens=q_lens, block_table=block_tables[gi], slot_t=slot_ts[gi],
                                           pos_t=positions, state=state, mask=mask)
            md = g.builder.build(0, common)
            for name in g.layer_names:
                per_layer[name] = md
        if self.rules.update_cos_sin:
            from vllm_ascend.ops.rotary_embedding import update_cos_sin

            update_cos_sin(positions)
        if graph_step:
            hidden = self._graph_forward(b, input_ids, positions, per_layer)
        else:
            with vllm_setup.forward_context(self.config, n_tok, with_prefill=state.name != "DecodeOnly",
                                            attn_metadata=per_layer, model_instance=self.model,
                                            cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                            batch_descriptor=batch_descriptor(n_tok, False)):
                hidden = self.model(input_ids=input_ids, positions=positions)
        last = q_start[1:].long() - 1
        logits = self.model.compute_logits(hidden[last]).float()
        for (r, n), row in zip(plan, logits):
            r.computed += n
            if r.computed >= len(r.tokens):  # the step reached the end of what we know: emit a token
                r.output.append(int(row.argmax()))
                r.logits.append(row)
            self._publish_prefix(r)
        return n_tok

    def _graph_update(self, fc: Any, b: int) -> None:
        """The layout's graph-parameter update after a replay (:attr:`RunnerRules.graph_update`)."""
        from vllm_ascend.compilation import acl_graph

        how = self.rules.graph_update
        if how == "update_attn_params":
            acl_graph.update_attn_params(self.update_stream, fc, b)
        elif how == "update_attn_params+config":
            acl_graph.update_attn_params(self.update_stream, fc, b, self.config)
        elif how == "update_full_graph_params":
            acl_graph.update_full_graph_params(self.attn_backend, self.update_stream, fc, b, self.config,
                                               self.config.speculative_config)
        else:
            raise ValueError(f"unknown graph update rule {how!r}")

    def _graph_forward(self, b: int, input_ids: torch.Tensor, positions: torch.Tensor,
                       per_layer: dict) -> torch.Tensor:
        """A decode step of ``b`` requests through the FULL graph of size ``b``.

        First use of a size: a capture run (``NPUModelRunner._capture_aclgraphs`` / ``_dummy_run``: the wrapper
        captures while ``forward_context.capturing`` is set). Then, as ``_generate_process_reqs_hidden_states`` does:
        replay, then the layout's graph-parameter update (the captured ``ExternalEvent.wait`` holds the replayed
        attention until the update has rewritten its lengths).
        """
        from vllm.config import CUDAGraphMode

        from gptoss_patch.selftest import worker as vllm_setup

        args = {"input_ids": input_ids, "positions": positions}
        desc = batch_descriptor(b, True)
        if b not in self.captured_sizes:
            with vllm_setup.forward_context(self.config, b, with_prefill=False, attn_metadata=per_layer,
                                            model_instance=self.model, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                                            batch_descriptor=desc):
                self.graph_model(**args)  # captures
            self.captured_sizes.add(b)
        with vllm_setup.forward_context(self.config, b, with_prefill=False, attn_metadata=per_layer,
                                        model_instance=self.model, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                                        batch_descriptor=desc) as fc:
            hidden = self.graph_model(**args)  # replays (queued at the first captured event wait)
            self._graph_update(fc, b)
        self.graph_steps += 1
        return hidden

    def _mask(self, state, seq_lens):
        """The runner-built mask of the layout (:attr:`RunnerRules.mask`); ``None`` where the builder makes it."""
        if self.rules.mask == "builder":
            return None
        if self.rules.mask == "splitfuse":  # 0.12.0rc1 NPUModelRunner._make_attention_mask (non-MLA, non-pooling)
            return self.mask_builder.get_splitfuse_attn_mask()
        name = state.name  # 0.11.x NPUModelRunner._make_attention_mask
        if name == "ChunkedPrefill":
            return self.mask_builder.get_splitfuse_attn_mask()
        if name == "PrefillNoCache":
            return self.mask_builder.get_attn_mask(max(seq_lens), self.dtype, self.device)
        if name == "PrefillCacheHit":
            return self.mask_builder.get_attn_mask(128, self.dtype, self.device)
        return None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stagger: bool = True,
                 forced: Sequence[Sequence[int]] | None = None) -> list[Request]:
        """Greedy-decode every prompt. With ``stagger``, request i joins after step i, so prefill chunks of
        later requests share steps with the decodes of earlier ones (chunked prefill, mixed batches) and
        reuse the prefix blocks the earlier ones published. ``forced``: per prompt, the tokens to feed
        back instead of our own argmax (teacher forcing); outputs are still our argmax."""
        reqs = [Request(i, list(p), max_new_tokens, forced=list(forced[i]) if forced else None)
                for i, p in enumerate(prompts)]
        active: list[Request] = []
        pending = list(reqs)
        while pending or any(not r.done for r in active):
            if pending and (stagger or not active):
                joiners = [pending.pop(0)] if stagger else [pending.pop(0) for _ in range(len(pending))]
                for r in joiners:
                    self._reuse_prefix(r)
                    active.append(r)
            live = [r for r in active if not r.done]
            if live:
                self.step(live)
        return reqs

    def kv_groups_summary(self) -> list[dict]:
        """Per KV-cache group: spec class, sliding window, layer names (what the report shows)."""
        return [{"spec": type(g.spec).__name__, "sliding_window": g.sliding_window, "layers": list(g.layer_names)}
                for g in self.groups]


def _transformers_mxfp4_model(checkpoint: str | os.PathLike):
    """transformers' ``GptOssForCausalLM`` (float32) of an MXFP4 checkpoint, experts dequantized by transformers'
    ``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` - what ``Mxfp4Config(dequantize=True)`` runs on a
    machine without an FP4 kernel. (``from_pretrained`` with that config needs ``accelerate``, which the cells do not
    install: the same conversion is applied here to the safetensors and loaded with ``strict=True``.) The bfloat16
    dequantized values are exact in float32."""
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = GptOssConfig.from_pretrained(str(checkpoint))
    del config.quantization_config
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update(load_file(str(path)))
    for name in [n for n in state if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        state[base] = convert_moe_packed_tensors(state.pop(name), state.pop(base + "_scales"))
    model = GptOssForCausalLM(config).float()  # rope buffers computed as from_pretrained does; weights replaced below
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model


def reference_generate(checkpoint: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       cache_dir: str | os.PathLike | None = None) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy generation, float32: per prompt (tokens, logits ``[vocab]`` per generated token).

    An MXFP4 checkpoint (``quantization_config.quant_method: mxfp4``) is dequantized by transformers' own
    ``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` (:func:`_transformers_mxfp4_model`). The greedy tokens come from ``generate``; the logits from one teacher-forced forward pass over
    prompt + tokens (the same numbers ``generate`` scored, without its per-step overhead). With
    ``cache_dir``, the tokens are cached under a key of the checkpoint bytes, the prompts, the step count
    and the transformers version (greedy tokens are deterministic for those); logits are recomputed.
    """
    import hashlib
    import json

    import transformers
    from transformers import GptOssForCausalLM

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        model = _transformers_mxfp4_model(checkpoint)
    else:
        model = GptOssForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    model.eval()
    cached: dict = {}
    path = None
    if cache_dir is not None:
        h = hashlib.sha256()
        for f in sorted(Path(checkpoint).glob("*.safetensors")):
            h.update(f.read_bytes())
        h.update(json.dumps([list(map(int, p)) for p in prompts]).encode())
        h.update(f"{max_new_tokens}/{transformers.__version__}".encode())
        path = Path(cache_dir) / f"reference-{h.hexdigest()[:16]}.json"
        if path.exists():
            cached = json.loads(path.read_text())
    out = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            toks = cached.get(str(i))
            if toks is None:
                gen = model.generate(torch.tensor([list(p)]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                toks = gen[0, len(p):].tolist()
                cached[str(i)] = toks
            full = torch.tensor([list(p) + toks[:-1]])
            logits = model(full).logits[0, len(p) - 1:].float()
            out.append((toks, list(logits)))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    return out
