"""FULL_DECODE_ONLY ACL-graph cases over the real vllm-ascend graph code (patched layouts B, C, E, F).

:class:`Harness` plays the model runner's part around vLLM's real ``Attention`` layers (a small decoder,
:class:`Toy`), vllm-ascend's ``ACLGraphWrapper`` (capture and replay), ``AscendAttentionMetadataBuilder.build`` /
``build_for_graph_capture`` and the graph-parameter update entry point of each release (:func:`runner_update`):
persistent input buffers, one KV-cache group per layer, the decode padding of each release's runner
(``attention_case.DECODE_PADDING``), the step order ``replay -> update``. The same model run eagerly
(``CUDAGraphMode.NONE``) over its own caches is the graph's oracle; transformers' ``eager_attention_forward`` is the
attention rows' (tests/cell/test_aclgraph.py, gptoss_patch/selftest/__init__.py). Used inside :func:`graph_env`.

Deviations from the model runner (tests/cell/test_aclgraph.py states why): padded slot-mapping entries are -1;
``weak_ref_tensors`` is an alias of the tensor.
"""

from __future__ import annotations

import contextlib

import torch

from gptoss_patch.selftest import attention as attention_case

WINDOW = 128
BLOCK = 128
N, KVN, D = 8, 1, 64          # gpt-oss-120b per rank at TP=8 (GQA 8:1, head_dim 64)
H = N * D
SIZES = (1, 2, 4, 8)
MAX_REQS = 8
MAX_BLOCKS = 8
SCALE = D ** -0.5


def _layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def runner_update(layout, update_stream, fc, size, cfg):
    """The model runner's graph-parameter update after a FULL replay, per layout (docs/upstream.md §7.3):
    ``NPUModelRunner._generate_process_reqs_hidden_states`` (0.11 - 0.13) / ``_model_forward`` (0.14.0rc1)."""
    from vllm_ascend.compilation import acl_graph

    if layout == "B":  # 0.11.0: (..., runtime_shape, kv_transfer_config)
        return acl_graph.update_attn_params(update_stream, fc, size, cfg.kv_transfer_config)
    if layout == "C":
        return acl_graph.update_attn_params(update_stream, fc, size)
    if layout == "E":
        return acl_graph.update_attn_params(update_stream, fc, size, cfg)
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    return acl_graph.update_full_graph_params(AscendAttentionBackend, update_stream, fc, size, cfg,
                                              cfg.speculative_config)


def batch_descriptor(size):
    """vLLM's ``BatchDescriptor`` of a uniform decode batch (field ``uniform_decode`` in 0.11, ``uniform`` later)."""
    import inspect

    from vllm.forward_context import BatchDescriptor

    names = inspect.signature(BatchDescriptor).parameters
    return BatchDescriptor(num_tokens=size, **({"uniform_decode": True} if "uniform_decode" in names
                                               else {"uniform": True}))


@contextlib.contextmanager
def graph_env():
    """Fresh simulator graph state, no graph params, capturing allowed; vllm-ascend's weak refs as aliases (its
    compiled ``_C_ascend.weak_ref_tensor`` is not simulated; an alias keeps what the graph code relies on - the same
    memory); one torch thread. Everything is put back on exit. Yields vllm-ascend's ``acl_graph`` module.

    On a real NPU only the graph-parameter reset and the capture switch apply (the simulator state and the weak-ref
    alias are simulator-only)."""
    import vllm_ascend.attention.attention_v1 as av
    import vllm_ascend.compilation.acl_graph as ag
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    from gptoss_patch.selftest import device

    device.reset_graph_state()
    saved = ag._graph_params
    ag._graph_params = None
    saved_refs = (ag.weak_ref_tensors, av.weak_ref_tensors)
    if not device.has_weak_ref_kernel():
        ag.weak_ref_tensors = av.weak_ref_tensors = lambda t: t
    set_cudagraph_capturing_enabled(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny operators: a second thread only costs synchronisation on 2 shared cores
    try:
        with torch.npu.stream(torch.npu.default_stream()):
            yield ag
    finally:
        torch.set_num_threads(threads)
        set_cudagraph_capturing_enabled(False)
        device.reset_graph_state()
        ag._graph_params = saved
        ag.weak_ref_tensors, av.weak_ref_tensors = saved_refs


class Toy:
    """``h -> h + Attention(h Wq, h Wk, h Wv) Wo`` per layer with real vLLM ``Attention`` layers.

    ``kinds[i]``: ``"sliding"`` (window 128 + sinks), ``"full"`` (sinks), ``"plain"`` (neither: upstream's code),
    ``"window"`` (window, no sinks: a non-GPT-OSS sliding layer, also ours - upstream would bake its lengths).
    Returns ``(h, attn_0, ..., attn_{L-1})``, each ``(T, ...)``; eager runs also keep each layer's query.
    """

    def __init__(self, cfg, kinds, weights, sinks, caches):
        from vllm.attention.layer import Attention
        from vllm.config import set_current_vllm_config

        self.kinds, self.weights, self.queries = kinds, weights, []
        self.layers = []
        with set_current_vllm_config(cfg):
            for i, kind in enumerate(kinds):
                extra = {} if kind in ("plain", "window") else {"sinks": sinks[i]}
                attn = Attention(N, D, SCALE, num_kv_heads=KVN, cache_config=cfg.cache_config, prefix=_layer_name(i),
                                 per_layer_sliding_window=WINDOW if kind in ("sliding", "window") else None, **extra)
                attn.kv_cache = [caches[i]]
                self.layers.append(attn)

    def __call__(self, x):
        h = x
        outs = []
        self.queries = []
        for attn, (wq, wk, wv, wo) in zip(self.layers, self.weights):
            q = h @ wq
            self.queries.append(q)
            a = attn(q, h @ wk, h @ wv)
            outs.append(a)
            h = h + a @ wo
        return (h, *outs)


def _config():
    from vllm.config import CacheConfig, VllmConfig

    return VllmConfig(cache_config=CacheConfig(block_size=BLOCK))


class Group:
    """One KV-cache group (here: one layer): caches for the graph and the eager model, and the runner's persistent
    block table / slot mapping / seq_lens buffers. Each group has its own sequence lengths (``offset``), so a record
    paired with another layer's metadata would read wrong lengths."""

    def __init__(self, init_lens, gen, dtype=torch.float32):
        nb = MAX_REQS * MAX_BLOCKS + 4
        # NPU memory, as the runner keeps them: caches, block table, slot mapping, the device copy of seq_lens
        self.kc = torch.randn(nb, BLOCK, KVN, D, generator=gen).to(attention_case.NPU, dtype)
        self.vc = torch.randn(nb, BLOCK, KVN, D, generator=gen).to(attention_case.NPU, dtype)
        self.kc_e, self.vc_e = self.kc.clone(), self.vc.clone()
        self.bt = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32, device=attention_case.NPU)
        self.slots = torch.full((MAX_REQS,), -1, dtype=torch.int32, device=attention_case.NPU)
        self.seq_lens_cpu = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.seq_lens_npu = torch.zeros(MAX_REQS, dtype=torch.int32, device=attention_case.NPU)
        self.free = torch.randperm(nb - 1, generator=gen).add(1).tolist()   # block 0 stays for padding rows
        self.lengths = list(init_lens)
        self.blocks = []
        for length in init_lens:
            self.blocks.append([self.free.pop() for _ in range(-(-length // BLOCK))])

    def schedule(self, active):
        """Slot of each active request's new token; its length grows by one."""
        slots = []
        for i, r in enumerate(active):
            p = self.lengths[r]
            if p // BLOCK == len(self.blocks[r]):
                self.blocks[r].append(self.free.pop())
            slots.append(self.blocks[r][p // BLOCK] * BLOCK + p % BLOCK)
            self.lengths[r] = p + 1
            self.bt[i].zero_()
            self.bt[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
            self.seq_lens_cpu[i] = p + 1
        self.slots[:len(active)] = torch.tensor(slots, dtype=torch.int32)


class Harness:
    """Graph model (``ACLGraphWrapper``, FULL) and eager model over the same weights, groups and metadata.

    Args:
        kinds: per layer ``"sliding"`` / ``"full"`` / ``"plain"`` / ``"window"`` (:class:`Toy`).
        seed: generator seed of weights, sinks, caches and block assignment.
        init_lens: each request's KV length before the first step (per group, plus ``offsets[group]``).
        offsets: per layer, added to ``init_lens`` (default ``37 * i``).
        sizes: the graph capture sizes (batch sizes padded up to the next one).
        dtype: weights, sinks, KV caches and inputs (float32 - a simulator extension - or bfloat16).
    """

    def __init__(self, kinds, *, seed=0, init_lens=(1, 60, 120, 127, 128, 200, 250, 255), offsets=None,
                 sizes=SIZES, dtype=torch.float32):
        from vllm.config import CUDAGraphMode
        from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

        gen = torch.Generator().manual_seed(seed)
        self.kinds, self.sizes = list(kinds), tuple(sizes)
        offsets = offsets or [37 * i for i in range(len(kinds))]
        self.groups = [Group([n + off for n in init_lens], gen, dtype) for off in offsets]
        weights = [tuple((torch.randn(a, b, generator=gen) * a ** -0.5).to(attention_case.NPU, dtype)
                         for a, b in ((H, N * D), (H, KVN * D), (H, KVN * D), (N * D, H))) for _ in kinds]
        self.sinks = [(torch.randn(N, generator=gen) * 2).to(attention_case.NPU, dtype) for _ in kinds]
        self.cfg_g, self.cfg_e = _config(), _config()
        self.graph_model = Toy(self.cfg_g, kinds, weights, self.sinks, [(g.kc, g.vc) for g in self.groups])
        self.eager_model = Toy(self.cfg_e, kinds, weights, self.sinks, [(g.kc_e, g.vc_e) for g in self.groups])
        self.x = torch.zeros(MAX_REQS, H, dtype=dtype, device=attention_case.NPU)  # the runner's input buffer
        self.qsl = torch.zeros(MAX_REQS + 1, dtype=torch.int32)  # query_start_loc: host, and its NPU copy
        self.qsl_npu = torch.zeros(MAX_REQS + 1, dtype=torch.int32, device=attention_case.NPU)
        self.layout = attention_case.installed_layout()
        self.builder = attention_case.make_builder(max_model_len=MAX_BLOCKS * BLOCK)
        self.wrapper = ACLGraphWrapper(self.graph_model, self.cfg_g, runtime_mode=CUDAGraphMode.FULL)
        self.update_stream = torch.npu.Stream()
        self.num_reqs = len(init_lens)

    # -- metadata ------------------------------------------------------------------------------------------------
    def _common(self, g, b, num_tokens):
        """The common metadata of a decode step of ``b`` requests run at graph size ``num_tokens``, padded the way
        this release pads (``attention_case.DECODE_PADDING``): 0.11's builder pads itself; 0.12.0rc1's runner pads
        the request count and only the device copy of the offsets (the host offsets, ``seq_lens`` and block-table
        rows of the padding requests are whatever an earlier step left in the persistent buffers); 0.13+ pad the
        host offsets with ``arange`` and ``seq_lens`` with zeros."""
        from vllm_ascend.attention.attention_v1 import AscendAttentionState

        self.qsl[:b + 1] = torch.arange(b + 1, dtype=torch.int32)
        num_reqs = b
        padding = attention_case.DECODE_PADDING[self.layout]
        if num_tokens > b and padding != "builder":
            if padding == "runner":
                self.qsl[b + 1:num_tokens + 1] = torch.arange(b + 1, num_tokens + 1, dtype=torch.int32)
                g.seq_lens_cpu[b:] = 0
            num_reqs = num_tokens
        q_cpu = self.qsl[:num_reqs + 1]
        self.qsl_npu[:num_reqs + 1].copy_(q_cpu)  # the runner's CpuGpuBuffer.copy_to_gpu
        seq_lens = g.seq_lens_cpu[:num_reqs]
        if attention_case.SEQ_LENS_ON_DEVICE[self.layout]:
            g.seq_lens_npu[:num_reqs].copy_(seq_lens)
            seq_lens = g.seq_lens_npu[:num_reqs]
        state = AscendAttentionState.DecodeOnly
        return attention_case.common_metadata(
            query_start_loc=self.qsl_npu[:num_reqs + 1], query_start_loc_cpu=q_cpu, seq_lens_cpu=g.seq_lens_cpu,
            seq_lens=seq_lens, num_computed_tokens_cpu=g.seq_lens_cpu[:num_reqs] - 1,
            num_reqs=num_reqs, num_actual_tokens=b, max_query_len=1, max_seq_len=int(g.seq_lens_cpu.max()),
            decode_token_per_req=1, block_table_tensor=g.bt[:num_reqs], slot_mapping=g.slots,
            actual_seq_lengths_q=q_cpu[1:].tolist(), positions=None,
            attn_mask=attention_case.runner_mask(state, [], torch.float32, self.layout), attn_state=state,
            num_input_tokens=num_tokens)

    def dummy_metadata(self, size):
        """``NPUModelRunner._build_dummy_attn_metadata``: ``size`` requests of length 1, ``build_for_graph_capture``."""
        meta = {}
        for i, g in enumerate(self.groups):
            g.seq_lens_cpu[:size] = 1
            g.seq_lens_cpu[size:] = 0
            g.slots[:size] = -1  # the runner's slot buffer holds 0s here; see the module docstring
            meta[_layer_name(i)] = self.builder.build_for_graph_capture(self._common(g, size, size))
        return meta

    def step_metadata(self, active, size):
        meta = {}
        for i, g in enumerate(self.groups):
            g.schedule(active)
            g.slots[len(active):size] = -1
            meta[_layer_name(i)] = self.builder.build(0, self._common(g, len(active), size))
        return meta

    # -- forward contexts ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self, cfg, meta, mode, size):
        """``set_forward_context`` plus what ``set_ascend_forward_context`` does for graphs: ``capturing = False``."""
        from vllm.forward_context import get_forward_context, set_forward_context

        with set_forward_context(meta, cfg, cudagraph_runtime_mode=mode, batch_descriptor=batch_descriptor(size)):
            fc = get_forward_context()
            fc.capturing = False
            fc.is_draft_model = False  # set_ascend_forward_context (0.13+ read it in attention and the graph wrapper)
            yield fc

    def capture(self):
        """``NPUModelRunner._capture_aclgraphs``: per size (largest first) a warm-up run, then the FULL capture."""
        from vllm.config import CUDAGraphMode
        from vllm_ascend.compilation.acl_graph import set_graph_params

        set_graph_params(set(self.sizes))
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                meta = self.dummy_metadata(size)
                with self.context(self.cfg_g, meta, CUDAGraphMode.NONE, size):
                    self.wrapper(self.x[:size])
                with self.context(self.cfg_g, meta, CUDAGraphMode.FULL, size) as fc:
                    self.wrapper(self.x[:size])  # ACLGraphWrapper sets fc.capturing and captures
                    assert fc.capturing  # so _generate_dummy_run_hidden_states does not update here

    def step(self, active, *, update=None, check=True):
        """One decode step of the requests ``active`` padded to the next capture size: graph and eager.

        Returns ``(b, size, graph outputs, eager outputs, metadata)``.
        """
        from vllm.config import CUDAGraphMode

        b = len(active)
        size = min(s for s in self.sizes if s >= b)
        with torch.inference_mode():
            self.x[:b] = torch.randn(b, H)
            self.x[b:size] = 0
            meta = self.step_metadata(active, size)
            with self.context(self.cfg_g, meta, CUDAGraphMode.FULL, size) as fc:
                outs_g = self.wrapper(self.x[:size])  # replay: queued at the first captured ExternalEvent.wait
                pending = self.wrapper.concrete_aclgraph_entries[fc.batch_descriptor].aclgraph.sim_pending
                (update or self.update)(fc, size)
            if check:
                assert pending, "the replay should wait for the parameter update"
            with self.context(self.cfg_e, meta, CUDAGraphMode.NONE, size):
                outs_e = self.eager_model(self.x[:size])
        return b, size, outs_g, outs_e, meta

    def update(self, fc, size):
        """The runner's update call of this release (:func:`runner_update`)."""
        return runner_update(self.layout, self.update_stream, fc, size, self.cfg_g)

    def keys_values(self, layer, r):
        g = self.groups[layer]
        length = g.lengths[r]
        pos = torch.arange(length)
        blocks = torch.tensor(g.blocks[r])[pos // BLOCK]
        return g.kc_e[blocks, pos % BLOCK], g.vc_e[blocks, pos % BLOCK]


