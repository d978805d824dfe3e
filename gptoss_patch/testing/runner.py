"""The main job: a GPT-OSS checkpoint through vLLM's own model and patched vllm-ascend, on the NPU simulator.

Real upstream code in the loop: vLLM's ``EngineArgs``/``VllmConfig``, ``GptOssForCausalLM`` and its
BF16 weight loader (``DefaultModelLoader``), vLLM's distributed groups (gloo, world size 1);
vllm-ascend's worker start-up sequence (``NPUWorker.__init__``: ``adapt_patch``,
``register_ascend_customop`` - FusedMoE → AscendFusedMoE, YaRN rope, ...), its attention backend
and ``AscendAttentionMetadataBuilder``, ``AttentionMaskBuilder``, ``set_ascend_forward_context`` and
the MoE communication methods; the ``torch_npu`` operators are the simulator's.

Ours: this runner's scheduling (which tokens run in which step, chunked prefill with a token
budget, prefix reuse of whole KV blocks, the block allocator) - the role of vLLM's scheduler and
of ``NPUModelRunner._prepare_inputs``, kept small and explicit - and the greedy loop.

The reference is transformers' ``GptOssForCausalLM`` in float32 on the same checkpoint and token ids.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch


def ascend_context(checkpoint: str | os.PathLike, *, dtype: str = "bfloat16", max_model_len: int = 2048,
                   **engine_args: Any):
    """vLLM + vllm-ascend worker state as ``NPUWorker.__init__`` sets it up; yields the ``VllmConfig``.

    See :func:`gptoss_patch.testing.vllm_setup.ascend_context` (world size 1, gloo, the NPU simulator).
    """
    from gptoss_patch.testing import vllm_setup

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
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """What the model is fed: the prompt, then our outputs (or the forced tokens, one per output)."""
        if self.forced is not None:
            return self.prompt + self.forced[:len(self.output)]
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class SimulatedGptOss:
    """vLLM's GptOssForCausalLM on (simulated) vllm-ascend with a paged KV cache and greedy decoding.

    Args:
        config: the ``VllmConfig`` from :func:`ascend_context`.
        num_blocks: KV-cache blocks per layer (block size 128).
        token_budget: max tokens per step (chunked prefill: prompt chunks fill what decodes leave).
    """

    block_size = 128

    def __init__(self, config: Any, *, num_blocks: int = 64, token_budget: int = 256, graph: bool = False,
                 max_decode_batch: int = 8):
        from vllm.v1.worker.utils import bind_kv_cache
        from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
        from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder

        self.config = config
        self.token_budget = token_budget
        t0 = time.perf_counter()
        from gptoss_patch.testing import vllm_setup

        self.model = vllm_setup.load_model(config)
        self.load_seconds = time.perf_counter() - t0
        self.dtype = config.model_config.dtype
        from vllm.attention import Attention

        ctx = config.compilation_config.static_forward_context
        self.layer_names = sorted((n for n, m in ctx.items() if isinstance(m, Attention)),
                                  key=lambda n: int(n.split(".")[2]))
        caches = {}
        for name in self.layer_names:
            impl = ctx[name].impl
            shape = (num_blocks, self.block_size, impl.num_kv_heads, impl.head_size)
            caches[name] = (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
        self.kv_caches: list = []
        bind_kv_cache(caches, ctx, self.kv_caches)
        self.builder = AscendAttentionMetadataBuilder(None, self.layer_names, config, torch.device("cpu"))
        self.mask_builder = AttentionMaskBuilder(config.model_config.max_model_len, self.dtype, torch.device("cpu"))
        self.free_blocks = list(range(1, num_blocks))  # block 0 stays free: padded graph rows point at it
        self.prefix_blocks: dict[tuple[int, ...], int] = {}  # full-block token prefix -> physical block
        self.states_seen: set[str] = set()
        self.reused_blocks = 0  # KV blocks served from the prefix cache instead of being computed
        self.graph = graph
        self.graph_steps = 0  # decode steps served by replaying a captured ACL graph
        self.captured_sizes: set[int] = set()
        if graph:
            self._init_graph(max_decode_batch)

    def _init_graph(self, max_batch: int) -> None:
        """FULL_DECODE_ONLY as vllm-ascend 0.11's NPUModelRunner sets it up: graph params per capture size, the
        model wrapped in vllm-ascend's own ``ACLGraphWrapper`` (FULL), static input buffers, an update stream."""
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled
        from vllm.config import CUDAGraphMode
        from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, set_graph_params

        set_graph_params(set(range(1, max_batch + 1)))
        set_cudagraph_capturing_enabled(True)
        self.graph_model = ACLGraphWrapper(self.model, self.config, runtime_mode=CUDAGraphMode.FULL)
        width = -(-self.config.model_config.max_model_len // self.block_size)
        self.static = {"input_ids": torch.zeros(max_batch, dtype=torch.long),
                       "positions": torch.zeros(max_batch, dtype=torch.long),
                       "slots": torch.zeros(max_batch, dtype=torch.int32),
                       "block_table": torch.zeros(max_batch, width, dtype=torch.int32)}
        self.update_stream = torch.npu.Stream()

    # ---------------------------------------------------------------- blocks and prefix reuse
    def _reuse_prefix(self, req: Request) -> None:
        """Point the request at cached blocks holding its longest full-block prompt prefix (prefix caching)."""
        n_full = (len(req.prompt) - 1) // self.block_size
        for b in range(n_full):
            key = tuple(req.prompt[:(b + 1) * self.block_size])
            if key not in self.prefix_blocks:
                break
            req.blocks.append(self.prefix_blocks[key])
            req.computed = (b + 1) * self.block_size
            self.reused_blocks += 1

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        while len(req.blocks) * self.block_size < upto:
            if not self.free_blocks:
                raise RuntimeError("KV cache full: raise num_blocks")
            req.blocks.append(self.free_blocks.pop(0))

    def _publish_prefix(self, req: Request) -> None:
        for b in range(min(req.computed, len(req.prompt)) // self.block_size):
            self.prefix_blocks.setdefault(tuple(req.prompt[:(b + 1) * self.block_size]), req.blocks[b])

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

    @torch.inference_mode()  # as vLLM's worker runs execute_model
    def step(self, reqs: Sequence[Request]) -> int:
        """Run one scheduled step over ``reqs``; returns the number of tokens computed (0 when all done)."""
        from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

        from gptoss_patch.testing import vllm_setup
        from gptoss_patch.testing.attention_case import attn_state_for

        plan = self._schedule(reqs)
        if not plan:
            return 0
        ids, pos, slots, q_lens, seq_lens, ctx_lens, tables = [], [], [], [], [], [], []
        for r, n in plan:
            start = r.computed
            self._ensure_blocks(r, start + n)
            toks = r.tokens[start:start + n]
            ids += toks
            pos += list(range(start, start + n))
            slots += [r.blocks[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, start + n)]
            q_lens.append(n)
            seq_lens.append(start + n)
            ctx_lens.append(start)
            tables.append(r.blocks)
        state = attn_state_for(list(zip(ctx_lens, q_lens)))
        graph_step = self.graph and state.name == "DecodeOnly" and len(plan) <= self.static["input_ids"].shape[0]
        if graph_step:  # captured graphs read fixed buffers: write this step's values into them
            b = len(plan)
            st = self.static
            st["block_table"][:b].zero_()
            for i, t in enumerate(tables):
                st["block_table"][i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            st["input_ids"][:b] = torch.tensor(ids)
            st["positions"][:b] = torch.tensor(pos)
            st["slots"][:b] = torch.tensor(slots, dtype=torch.int32)
            block_table, slot_t = st["block_table"][:b], st["slots"][:b]
        else:
            width = max(len(t) for t in tables)
            block_table = torch.zeros(len(plan), width, dtype=torch.int32)
            for i, t in enumerate(tables):
                block_table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            slot_t = torch.tensor(slots, dtype=torch.int32)
        self.states_seen.add(state.name)
        q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        n_tok = len(ids)
        mask = self._mask(state, seq_lens)
        common = AscendCommonAttentionMetadata(
            query_start_loc=q_start.clone(), query_start_loc_cpu=q_start, seq_lens_cpu=seq_t,
            seq_lens=seq_t.clone(), num_computed_tokens_cpu=torch.tensor(ctx_lens, dtype=torch.int32),
            num_reqs=len(plan), num_actual_tokens=n_tok, max_query_len=max(q_lens), decode_token_per_req=1,
            block_table_tensor=block_table, slot_mapping=slot_t,
            actual_seq_lengths_q=q_start[1:].tolist(), positions=torch.tensor(pos), attn_mask=mask,
            attn_state=state, num_input_tokens=n_tok)
        md = self.builder.build(0, common)
        per_layer = {name: md for name in self.layer_names}
        if graph_step:
            hidden = self._graph_forward(n_tok, per_layer)
        else:
            input_ids = torch.tensor(ids, dtype=torch.long)
            positions = torch.tensor(pos, dtype=torch.long)
            # the MoE communication method the model runner would pick for this step (vllm_setup.select_moe_comm_type)
            with vllm_setup.forward_context(self.config, n_tok, with_prefill=state.name != "DecodeOnly",
                                            attn_metadata=per_layer):
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

    def _graph_forward(self, b: int, per_layer: dict) -> torch.Tensor:
        """A decode step of ``b`` requests through the FULL graph of size ``b``.

        First use of a size: a capture run (``NPUModelRunner._capture_aclgraphs``: the wrapper captures while
        ``forward_context.capturing`` is set). Then, as ``_generate_process_reqs_hidden_states`` does in 0.11:
        replay, then ``update_attn_params(update_stream, forward_context, num_tokens)`` (the captured
        ``ExternalEvent.wait`` holds the replayed attention until the update has rewritten its lengths).
        """
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor
        from vllm_ascend.compilation import acl_graph

        from gptoss_patch.testing import vllm_setup

        args = {"input_ids": self.static["input_ids"][:b], "positions": self.static["positions"][:b]}
        if b not in self.captured_sizes:
            with vllm_setup.forward_context(self.config, b, with_prefill=False, attn_metadata=per_layer) as fc:
                fc.cudagraph_runtime_mode = CUDAGraphMode.FULL
                fc.batch_descriptor = BatchDescriptor(num_tokens=b, uniform_decode=True)
                self.graph_model(**args)  # captures
            self.captured_sizes.add(b)
        with vllm_setup.forward_context(self.config, b, with_prefill=False, attn_metadata=per_layer) as fc:
            fc.cudagraph_runtime_mode = CUDAGraphMode.FULL
            fc.batch_descriptor = BatchDescriptor(num_tokens=b, uniform_decode=True)
            hidden = self.graph_model(**args)  # replays (queued at the first captured event wait)
            acl_graph.update_attn_params(self.update_stream, fc, b)
        self.graph_steps += 1
        return hidden

    def _mask(self, state, seq_lens):
        # vllm-ascend 0.11 NPUModelRunner._make_attention_mask
        name = state.name
        if name == "ChunkedPrefill":
            return self.mask_builder.get_splitfuse_attn_mask()
        if name == "PrefillNoCache":
            return self.mask_builder.get_attn_mask(max(seq_lens), self.dtype, torch.device("cpu"))
        if name == "PrefillCacheHit":
            return self.mask_builder.get_attn_mask(128, self.dtype, torch.device("cpu"))
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


def reference_generate(checkpoint: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       cache_dir: str | os.PathLike | None = None) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy generation, float32: per prompt (tokens, logits ``[vocab]`` per generated token).

    The greedy tokens come from ``generate``; the logits from one teacher-forced forward pass over
    prompt + tokens (the same numbers ``generate`` scored, without its per-step overhead). With
    ``cache_dir``, the tokens are cached under a key of the checkpoint bytes, the prompts, the step count
    and the transformers version (greedy tokens are deterministic for those); logits are recomputed.
    """
    import hashlib
    import json

    import transformers
    from transformers import GptOssForCausalLM

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
