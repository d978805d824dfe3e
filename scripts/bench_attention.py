#!/usr/bin/env python3
"""Benchmark: host time per decode step of GPT-OSS attention, our patched 0.11.0 forward vs native 0.15.0rc1.

One decode step = the attention ``forward`` of all 36 layers of gpt-oss-120b on one rank at TP=8 (18 sliding-window
layers, window 128, and 18 full-attention layers; 8 query heads, 1 KV head, head_dim 64, bf16, learned sinks), for
a batch of 1 and of 64 decoding sequences (context lengths ``200 + (37 * i) % 800``, the same in both runs).

* patched 0.11.0: vllm-ascend 0.11.0's ``AscendAttentionBackendImpl.forward`` wrapped by gptoss-patch
  (``attention.sink_window_forward``), metadata from 0.11.0's builder (:mod:`gptoss_patch.selftest.attention`);
  runs in the 0.11.0 venv, where the ``.pth`` applies the patches.
* native 0.15.0rc1: vllm-ascend 0.15.0rc1's own forward (gptoss-patch disabled in that worker: layout H would route
  the sink/window layers to our call), metadata from 0.15's builder (:mod:`gptoss_patch.selftest.native`), inside
  ``set_ascend_forward_context``; runs in the 0.15.0rc1 venv.

Only host-side Python is measured: the timed steps run inside
:func:`gptoss_patch_testkit.npu_sim.host_time.host_time_only`, where the simulated attention operators return a
preallocated result instead of emulating the kernel (on an NPU the kernel runs on the device; the host pays the
launch). Before timing, layers run once with the real emulation and their outputs are checked to be finite (a
sliding and a full layer for 0.11.0; a full layer for 0.15.0rc1, whose sliding layers pass a ``swa_mask`` that
the simulator refuses - see tests/cell/native_015/test_native_attention.py). The per-call work common to both
(building the metadata once per step, the forward context) is outside the timed region. ``gc`` is disabled
while timing.

Usage::

    python scripts/bench_attention.py [--py011 /tmp/v11/bin/python] [--py015 /tmp/v15/bin/python]
                                      [--steps 200] [--rounds 2]

The script runs itself in each venv (``--worker``), alternating, and prints one table: host milliseconds per decode
step (36 layers) as median and 10th percentile, per layer call, and the ratio patched / native (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 36  # gpt-oss-120b: even layers sliding (window 128), odd layers full
N, KVN, D, WINDOW = 8, 1, 64, 128
BATCHES = (1, 64)


def seqs_for(batch: int) -> list[tuple[int, int]]:
    """Decode batch: ``(context_len, 1)`` per sequence."""
    return [(200 + (37 * i) % 800, 1) for i in range(batch)]


def _sinks(layer: int):
    import torch

    return (torch.randn(N, generator=torch.Generator().manual_seed(layer)) * 2).to(torch.bfloat16)


class _Layer:
    _k_scale_float = 1.0
    _v_scale_float = 1.0
    layer_name = "model.layers.0.self_attn.attn"


def _time_steps(step, steps: int) -> list[float]:
    from gptoss_patch_testkit.npu_sim.host_time import host_time_only

    times = []
    with host_time_only():
        for _ in range(5):  # warm-up inside the switch
            step()
        gc.collect()
        gc.disable()
        try:
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return times


def worker_011(steps: int) -> dict:
    import torch

    import gptoss_patch
    import vllm_ascend.attention.attention_v1 as aa
    from gptoss_patch.registry import MARKER
    from gptoss_patch.selftest.attention import build_case

    st = gptoss_patch.status()
    # the registry installs each patch as a function carrying its name (registry.MARKER), not as a wrapt wrapper
    if st.decision != "apply" or getattr(aa.AscendAttentionBackendImpl.__dict__["forward"], MARKER, None) is None:
        raise SystemExit(f"gptoss-patch is not applied in this venv ({st.decision}: {st.reason})")
    result = {}
    for batch in BATCHES:
        # fresh layers per batch size: an impl binds the KV cache of its first call (upstream's reshape_and_cache)
        impls = [aa.AscendAttentionBackendImpl(N, D, D ** -0.5, KVN, None, WINDOW if i % 2 == 0 else None, "auto",
                                               None, "decoder", None, sinks=_sinks(i)) for i in range(LAYERS)]
        case = build_case(seqs_for(batch), num_heads=N, num_kv_heads=KVN, dtype=torch.bfloat16, seed=batch)
        kv = (case.key_cache, case.value_cache)
        out = torch.empty(case.num_tokens, N, D, dtype=torch.bfloat16)

        def step():
            for impl in impls:
                impl.forward(_Layer(), case.query, case.key, case.value, kv, case.metadata, output=out,
                             trace_flag=False)

        for impl in impls[:2]:  # one sliding and one full layer with the emulated operators: finite outputs
            out.fill_(float("nan"))
            impl.forward(_Layer(), case.query, case.key, case.value, kv, case.metadata, output=out, trace_flag=False)
            assert torch.isfinite(out).all()
        result[batch] = _time_steps(step, steps)
    return result


def worker_015(steps: int) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    import gptoss_patch
    from gptoss_patch.selftest import native as n015

    cfg, _ = n015.vllm_context()
    st = gptoss_patch.status()
    if st.decision != "disabled":  # run_worker starts this worker with GPTOSS_PATCH_DISABLE=1
        raise SystemExit(f"expected gptoss-patch disabled in the native 0.15.0rc1 worker, got {st.decision}")
    result = {}
    for batch in BATCHES:
        impls = [n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW if i % 2 == 0 else None,
                                sinks=_sinks(i)) for i in range(LAYERS)]
        case = n015.build_case(cfg, seqs_for(batch), num_heads=N, num_kv_heads=KVN, dtype=torch.bfloat16, seed=batch)
        kv = (case.key_cache, case.value_cache)
        out = torch.empty(case.num_tokens, N, D, dtype=torch.bfloat16)
        md = case.metadata

        def step():
            for impl in impls:
                impl.forward(_Layer(), case.query, case.key, case.value, kv, md, output=out)

        with set_current_vllm_config(cfg), set_ascend_forward_context({_Layer.layer_name: md}, cfg,
                                                                      num_tokens=case.num_tokens):
            for impl in impls[1:2]:  # one full-attention layer with the emulated operators: finite outputs
                out.fill_(float("nan"))
                impl.forward(_Layer(), case.query, case.key, case.value, kv, md, output=out)
                assert torch.isfinite(out).all()
            result[batch] = _time_steps(step, steps)
    return result


def run_worker(py: str, which: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}
    env.update(GPTOSS_PATCH_SIMULATE_NPU="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "ERROR"))
    if which == "0.15.0rc1":  # upstream's own attention: layout H would route the sink/window layers to ours
        env.update(GPTOSS_PATCH_DISABLE="1", GPTOSS_PATCH_ALLOW_UNPATCHED="1")
    proc = subprocess.run([py, str(Path(__file__).resolve()), "--worker", which, "--steps", str(steps)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            return {int(k): v for k, v in json.loads(line[6:]).items()}
    raise SystemExit(f"worker {which} ({py}) failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def _p10(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 10]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--py011", default=os.environ.get("GPTOSS_BENCH_PY011", "/tmp/v11/bin/python"),
                    help="python of a venv with vllm 0.11.0 + vllm-ascend 0.11.0 + gptoss-patch")
    ap.add_argument("--py015", default=os.environ.get("GPTOSS_BENCH_PY015", "/tmp/v15/bin/python"),
                    help="python of a venv with vllm 0.15.0 + vllm-ascend 0.15.0rc1 + gptoss-patch")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each venv")
    ap.add_argument("--worker", choices=("0.11.0", "0.15.0rc1"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        os.environ.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")  # for vLLM's child interpreters
        from gptoss_patch_testkit import npu_sim

        npu_sim.install()
        res = worker_011(args.steps) if args.worker == "0.11.0" else worker_015(args.steps)
        print("BENCH " + json.dumps(res), flush=True)
        return 0
    samples: dict[str, dict[int, list[float]]] = {"0.11.0": {}, "0.15.0rc1": {}}
    for _ in range(args.rounds):
        for which, py in (("0.11.0", args.py011), ("0.15.0rc1", args.py015)):
            for batch, times in run_worker(py, which, args.steps).items():
                samples[which].setdefault(batch, []).extend(times)
    print(f"GPT-OSS attention forward, host time per decode step ({LAYERS} layers: 18 sliding + 18 full; "
          f"{N} q heads, {KVN} kv head, head_dim {D}, bf16; simulated operators return preallocated results)")
    print(f"{args.rounds} alternating rounds x {args.steps} steps per cell; median and 10th percentile (p10, less "
          "sensitive to other load on the machine)")
    print("batch | patched 0.11.0 ms/step median (p10) | native 0.15.0rc1 ms/step median (p10) | "
          "ratio patched/native median (p10), goal <= 1.0")
    for batch in BATCHES:
        a, b = samples["0.11.0"][batch], samples["0.15.0rc1"][batch]
        am, bm = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        ap, bp = _p10(a) * 1e3, _p10(b) * 1e3
        print(f"{batch:>5} | {am:>8.3f} ({ap:.3f}) = {am * 1e3 / LAYERS:.0f} us/layer | "
              f"{bm:>8.3f} ({bp:.3f}) = {bm * 1e3 / LAYERS:.0f} us/layer | {am / bm:.2f} ({ap / bp:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
