"""Measured peak memory of padding one gpt-oss-120b MoE layer per rank at TP=8 (and of the whole weight processing).

One rank's layer at TP 8: 128 experts, hidden 2880, expert intermediate 360 (-> 368), bf16 - ``w13 (128, 720, 2880)``
= 506.25 MiB, ``w2 (128, 2880, 360)`` = 253.1 MiB, biases 0.9 MiB.

Method: resident set size. Tensor storage comes from torch's CPU allocator (``posix_memalign`` -> glibc, which serves
blocks this large with ``mmap`` and returns them with ``munmap`` on free), so the RSS follows live tensor memory
page by page; ``tracemalloc`` does not see it at all (it only traces Python's own allocator - the script prints what it
reports for comparison), and torch has no CPU allocator statistics. Before each measured step the kernel's high-water
mark is reset (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0); after it ``VmHWM`` (``/proc/self/status``) is the
peak RSS during the step. Reported: peak - RSS before the step = the extra memory the step needed at its worst moment,
and RSS after - RSS before = what it kept. Every tensor is filled before measuring (untouched pages do not count).

Steps measured:

1. ``pad``: :func:`gptoss_patch.kernels.padding.pad_moe_layer_` alone on the layer's parameters (vLLM layout).
2. ``process_weights_after_loading`` through vllm-ascend 0.11.0 on the simulator, NZ on (``VLLM_ASCEND_ENABLE_NZ=1``
   with the eagle flag ``is_enable_nz`` reads): unpatched (upstream's transpose + NZ cast, no padding) and patched
   (padding, then the same). ``--no-vllm`` skips this part.

Reading the numbers (measured here, 128 experts): the padding step peaks at the padded ``w13`` (~519 MiB, less than
the 760 MiB of one layer's experts) and keeps the ~17 MiB of zero pairs. Upstream's own processing with NZ on peaks at
one whole layer of experts (~759 MiB): ``process_weights_after_loading`` keeps its ``w13_data`` / ``w2_data`` locals
(the transposed ND tensors) alive while ``npu_format_cast`` makes the NZ copies, until it returns. Patched, the same
upstream code runs on the padded tensors (~777 MiB + the kept 17 MiB); the padding step ends before upstream starts,
so it never adds to upstream's peak.

Usage::

    /tmp/v11/bin/python scripts/bench_padding.py [--experts 128] [--no-vllm]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import tracemalloc

os.environ.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


class Measure:
    """Context manager: RSS before, peak (VmHWM after a reset) and RSS after, in MiB; tracemalloc's peak too."""

    def __enter__(self):
        gc.collect()
        _reset_peak()
        tracemalloc.start()
        self.before = _status_kib("VmRSS") / 1024
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.peak = _status_kib("VmHWM") / 1024
        self.tracemalloc_peak = tracemalloc.get_traced_memory()[1] / MIB
        tracemalloc.stop()
        gc.collect()
        self.after = _status_kib("VmRSS") / 1024
        return False

    def line(self, label: str) -> str:
        return (f"{label:<44} extra peak {self.peak - self.before:8.1f} MiB   kept {self.after - self.before:+8.1f} MiB"
                f"   ({self.seconds:.2f} s; tracemalloc peak {self.tracemalloc_peak:.2f} MiB)")


def _filled(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)


def _bytes(shape, itemsize=2):
    n = 1
    for d in shape:
        n *= d
    return n * itemsize


def bench_pad(experts: int, hidden: int, inter: int, padded: int) -> None:
    from gptoss_patch.kernels.padding import pad_moe_layer_

    layer = torch.nn.Module()
    for name, shape in (("w13_weight", (experts, 2 * inter, hidden)), ("w13_bias", (experts, 2 * inter)),
                        ("w2_weight", (experts, hidden, inter)), ("w2_bias", (experts, hidden))):
        setattr(layer, name, torch.nn.Parameter(_filled(shape), requires_grad=False))
    layer_mib = sum(p.numel() * p.element_size() for p in layer.parameters()) / MIB
    largest = _bytes((experts, 2 * padded, hidden)) / MIB
    grown = (_bytes((experts, 2 * padded, hidden)) + _bytes((experts, 2 * padded)) + _bytes((experts, hidden, padded))
             - _bytes((experts, 2 * inter, hidden)) - _bytes((experts, 2 * inter)) - _bytes((experts, hidden, inter)))
    print(f"layer: {experts} experts, hidden {hidden}, intermediate {inter} -> {padded}, bf16: "
          f"{layer_mib:.1f} MiB of expert weights (w13 {_bytes((experts, 2 * inter, hidden)) / MIB:.2f} MiB)")
    print(f"expected: extra peak = the padded w13 = {largest:.1f} MiB; kept = {grown / MIB:.1f} MiB")
    with Measure() as m:
        pad_moe_layer_(layer, padded)
    print(m.line("1. pad_moe_layer_ (gptoss_patch)"))
    del layer
    gc.collect()


def bench_process_weights(experts: int, hidden: int, inter: int) -> None:
    from gptoss_patch.selftest import worker as vllm_setup
    from gptoss_patch.selftest.tiny import write_checkpoint

    ckpt = vllm_setup.process_scratch("bench-padding-")
    write_checkpoint(ckpt, preset="tiny", tokenizer=False, num_hidden_layers=2, num_local_experts=4, vocab_size=512,
                     pad_token_id=511, eos_token_id=510)
    cfg = vllm_setup.engine_config(ckpt)
    import torch_npu
    import vllm_ascend.ops.common_fused_moe as cfm
    import vllm_ascend.utils as vu
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.model_loader.utils import set_default_torch_dtype

    plain = cfm.AscendUnquantizedFusedMoEMethod.__dict__["process_weights_after_loading"].__wrapped__
    os.environ["VLLM_ASCEND_ENABLE_NZ"] = "1"
    for k, patched in enumerate((False, True)):
        with vllm_setup.ascend_context(vllm_config=cfg), set_default_torch_dtype(torch.bfloat16):
            vu._ENABLE_NZ = None
            vu.is_enable_nz(vllm_config=cfg)
            vu._IS_EAGLE_MODE = True  # what eagle/eagle3 speculative decoding sets: bf16 MoE weights become NZ
            layer = FusedMoE(num_experts=experts, top_k=4, hidden_size=hidden, intermediate_size=inter,
                             reduce_results=True, renormalize=True, quant_config=None, prefix=f"bench.{k}.experts",
                             apply_router_weight_on_input=False, has_bias=True, activation="swigluoai",
                             is_sequence_parallel=False)
            with torch.no_grad():
                for n in ("w13_weight", "w13_bias", "w2_weight", "w2_bias"):
                    getattr(layer, n).normal_(0.0, 0.02)
            label = "2. process_weights_after_loading, " + ("patched" if patched else "unpatched")
            with Measure() as m:
                if patched:
                    layer.quant_method.process_weights_after_loading(layer)
                else:
                    plain(layer.quant_method, layer)
            shapes = f"w13 {tuple(layer.w13_weight.shape)} w2 {tuple(layer.w2_weight.shape)} " \
                     f"format {torch_npu.get_npu_format(layer.w2_weight)}"
            print(m.line(label) + "   " + shapes)
            del layer
            gc.collect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=360, help="per-rank expert intermediate (2880 / TP)")
    ap.add_argument("--no-vllm", action="store_true", help="measure the padding step only (no vLLM import)")
    args = ap.parse_args(argv)
    from gptoss_patch.kernels.padding import aligned_size

    padded = aligned_size(args.intermediate)
    if padded == args.intermediate:
        print(f"intermediate {args.intermediate} is already a multiple of 16: nothing to pad")
        return 0
    bench_pad(args.experts, args.hidden, args.intermediate, padded)
    if not args.no_vllm:
        bench_process_weights(args.experts, args.hidden, args.intermediate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
