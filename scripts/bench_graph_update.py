#!/usr/bin/env python3
"""Benchmark: host time of one decode step's ACL-graph parameter update, GPT-OSS layers vs plain layers.

FULL_DECODE_ONLY graphs are updated before every replay (``vllm_ascend.compilation.acl_graph.update_attn_params``,
called by ``NPUModelRunner._generate_process_reqs_hidden_states``); that host time is on the critical path of every
decode step. This script captures one graph of ``--layers`` GPT-OSS attention layers (sinks; even layers with the
128-token window, as gpt-oss) through the patched path, and one graph of the same number of plain layers through
upstream's own ``_npu_paged_attention`` capture, in the same cell (vllm 0.11.0 + vllm-ascend 0.11.0, real vLLM
``Attention`` layers, ``AscendAttentionMetadataBuilder``, ``ACLGraphWrapper``), and times ``update_attn_params`` for
each step:

* ours: the patched ``update_attn_params`` on the GPT-OSS graph (pairs records by layer name, re-issues the fused
  ``.out`` launch with the step's lengths);
* upstream: the same patched entry point on the plain graph (no GPT-OSS record: it goes straight to upstream), and
  upstream's function itself (``__wrapped__``) - the difference is our pass-through cost for non-GPT-OSS models.

Each step uses the op-plugin documentation order (update, then replay) so the timed call contains no replayed work.
The torch_npu operators and the NPU graph runtime are the CPU simulator's (``gptoss_patch_testkit.npu_sim``): the
absolute times include the simulator's emulation of ``graph_task_update_begin/end``, the intercepted launch and
``ExternalEvent.record`` - they are host times on this machine, not NPU measurements; the ratio compares the Python
work of the two update paths under the same emulation.

Usage (in the 0.11.0 cell venv)::

    /tmp/v11/bin/python scripts/bench_graph_update.py [--layers 36] [--size 8] [--steps 60] [--path lse|v2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

N, KVN, D, BLOCK, WINDOW = 8, 1, 64, 128, 128  # gpt-oss-120b per rank at TP=8


def _setup_graph(kind: str, layers: int, size: int):
    """Capture one FULL graph of ``layers`` attention layers at ``size``; return (wrapper, cfg, step function)."""
    import torch
    from vllm.attention import Attention
    from vllm.config import CacheConfig, CUDAGraphMode, VllmConfig, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder, AscendAttentionState
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata
    from vllm_ascend.compilation import acl_graph

    cfg = VllmConfig(cache_config=CacheConfig(block_size=BLOCK))
    gen = torch.Generator().manual_seed(0)
    max_blocks = 4
    nb = size * max_blocks + 2
    attns = []
    with set_current_vllm_config(cfg):
        for i in range(layers):
            extra = {}
            window = None
            if kind == "gptoss":
                extra = {"sinks": torch.randn(N, generator=gen)}
                window = WINDOW if i % 2 == 0 else None
            attn = Attention(N, D, D ** -0.5, num_kv_heads=KVN, cache_config=cfg.cache_config,
                             prefix=f"model.layers.{i}.self_attn.attn", per_layer_sliding_window=window, **extra)
            attn.kv_cache = [(torch.randn(nb, BLOCK, KVN, D, generator=gen),
                              torch.randn(nb, BLOCK, KVN, D, generator=gen))]
            attns.append(attn)
    q = torch.randn(size, N * D, generator=gen)
    k = torch.randn(size, KVN * D, generator=gen)
    v = torch.randn(size, KVN * D, generator=gen)

    def model(x):
        return tuple(a(x, k, v) for a in attns)

    bt = torch.zeros(size, max_blocks, dtype=torch.int32)
    for r in range(size):
        bt[r] = torch.arange(1 + r * max_blocks, 1 + (r + 1) * max_blocks, dtype=torch.int32)
    slots = torch.full((size,), -1, dtype=torch.int32)  # no KV write: the benchmark times the update only
    seq_lens = torch.ones(size, dtype=torch.int32)
    qsl = torch.arange(size + 1, dtype=torch.int32)
    builder_cfg = type("C", (), {"model_config": type("M", (), {"max_model_len": max_blocks * BLOCK}),
                                 "speculative_config": None})
    builder = AscendAttentionMetadataBuilder(None, [], builder_cfg, torch.device("cpu"))

    def metadata():
        common = AscendCommonAttentionMetadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, seq_lens=seq_lens,
            num_computed_tokens_cpu=seq_lens - 1, num_reqs=size, num_actual_tokens=size, max_query_len=1,
            decode_token_per_req=1, block_table_tensor=bt, slot_mapping=slots, actual_seq_lengths_q=qsl[1:].tolist(),
            positions=None, attn_mask=None, attn_state=AscendAttentionState.DecodeOnly, num_input_tokens=size)
        meta = builder.build(0, common)  # one KV-cache group: every layer shares it (vllm-ascend 0.11)
        return {a.layer_name: meta for a in attns}

    wrapper = acl_graph.ACLGraphWrapper(model, cfg, runtime_mode=CUDAGraphMode.FULL)
    acl_graph._graph_params = None
    acl_graph.set_graph_params({size})
    bd = BatchDescriptor(num_tokens=size, uniform_decode=True)
    with torch.inference_mode():
        with set_forward_context(metadata(), cfg, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=bd):
            get_forward_context().capturing = False
            wrapper(q)
    graph_params = acl_graph.get_graph_params()
    acl_graph._graph_params = None  # the other graph gets its own; each step swaps its own back in
    update_stream = torch.npu.Stream()

    def step(update, lengths):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        meta = metadata()
        acl_graph._graph_params = graph_params
        try:
            with torch.inference_mode(), set_forward_context(meta, cfg, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                                                             batch_descriptor=bd):
                fc = get_forward_context()
                fc.capturing = False
                t0 = time.perf_counter()
                update(update_stream, fc, size, None)
                dt = time.perf_counter() - t0
                wrapper(q)  # replay after the update: nothing waits
                torch.npu.synchronize()
        finally:
            acl_graph._graph_params = None
        return dt

    return graph_params, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36, help="attention layers per graph (gpt-oss-120b: 36)")
    ap.add_argument("--size", type=int, default=8, help="capture size (decode batch)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--path", choices=["lse", "v2"], default=None,
                    help="force GPTOSS_PATCH_ATTENTION_PATH (default: what this torch_npu supports)")
    args = ap.parse_args(argv)
    if args.path:
        os.environ["GPTOSS_PATCH_ATTENTION_PATH"] = args.path

    from gptoss_patch_testkit import npu_sim

    npu_sim.install()
    import torch

    torch.set_num_threads(1)
    import vllm_ascend.attention.attention_v1 as av
    import vllm_ascend.compilation.acl_graph as ag
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    import gptoss_patch
    from gptoss_patch.patches.attention_graph.capture import GptOssAttnParams
    from gptoss_patch.patches.attention_graph.update import is_patched

    if not is_patched(ag.update_attn_params):
        print(f"gptoss-patch's update patch is not applied: {gptoss_patch.status().reason}", file=sys.stderr)
        return 2
    # vllm-ascend's compiled _C_ascend.weak_ref_tensor is not simulated: an alias (same memory) stands in
    ag.weak_ref_tensors = lambda t: t
    av.weak_ref_tensors = lambda t: t
    set_cudagraph_capturing_enabled(True)

    ours_params, ours_step = _setup_graph("gptoss", args.layers, args.size)
    plain_params, plain_step = _setup_graph("plain", args.layers, args.size)
    recs = ours_params.attn_params[args.size]
    assert len(recs) == args.layers and all(type(r) is GptOssAttnParams for r in recs)
    assert len(plain_params.attn_params[args.size]) == args.layers
    path = recs[0].path

    patched = ag.update_attn_params
    upstream = patched.__wrapped__
    series = {"ours": [], "upstream via patched entry": [], "upstream (unpatched function)": []}
    for i in range(args.warmup + args.steps):
        lengths = [1 + (i * 7 + r * 61) % 500 for r in range(args.size)]
        t_ours = ours_step(patched, lengths)
        t_plain = plain_step(patched, lengths)
        t_raw = plain_step(upstream, lengths)
        if i >= args.warmup:
            series["ours"].append(t_ours)
            series["upstream via patched entry"].append(t_plain)
            series["upstream (unpatched function)"].append(t_raw)

    import torch_npu

    print(f"ACL-graph parameter update, host time per decode step: {args.layers} layers, capture size {args.size}, "
          f"{args.steps} steps (median)")
    from importlib.metadata import version

    print(f"cell: vllm-ascend {version('vllm-ascend')}, vllm {version('vllm')}, "
          f"torch_npu {torch_npu.__version__} (CPU simulator), GPT-OSS graph path: {path}, 1 thread")
    print()
    print(f"| {'update':<46} | {'ms / step':>9} | {'us / layer':>10} |")
    print(f"|{'-' * 48}|{'-' * 11}|{'-' * 12}|")
    med = {k: statistics.median(v) for k, v in series.items()}
    labels = {"ours": f"ours: {args.layers} GPT-OSS layers (fused .out, {path})",
              "upstream via patched entry": f"upstream: {args.layers} plain PA layers (patched entry)",
              "upstream (unpatched function)": f"upstream: {args.layers} plain PA layers (its function)"}
    for k, v in med.items():
        print(f"| {labels[k]:<46} | {v * 1e3:>9.3f} | {v * 1e6 / args.layers:>10.1f} |")
    print()
    ratio = med["ours"] / med["upstream (unpatched function)"]
    passthrough = med["upstream via patched entry"] / med["upstream (unpatched function)"]
    print(f"ratio ours / upstream: {ratio:.2f}x   (patched entry on a plain graph / upstream: {passthrough:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
