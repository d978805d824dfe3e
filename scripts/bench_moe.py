"""Host time per GPT-OSS MoE layer call on the CPU NPU simulator: patched vllm-ascend 0.11.0 vs native 0.15.0rc1.

Builds one MoE layer the way vLLM's ``gpt_oss.py`` does (``FusedMoE(..., has_bias=True, activation="swigluoai")``,
turned into ``AscendFusedMoE`` by vllm-ascend) with gpt-oss-120b's per-rank shapes at TP=8 (hidden 2880, expert
intermediate 360; fewer experts than 128 by default, for memory), and times ``layer(hidden_states, router_logits)``
inside vllm-ascend's forward context (AllGather, the method the runner picks without expert parallelism) for several
token counts. It runs under whichever venv's Python starts it:

* vllm-ascend 0.11.x (patched by gptoss-patch): also times upstream's unpatched path on the same layer (wrong
  results, for the overhead of the patch);
* vllm-ascend >= 0.15.0rc1 (native GPT-OSS MoE: no MoE patch on 0.15.0rc1, 0.16.0rc1 and from 0.19.1rc1; layout G
  patches only the activation name).

``--save FILE`` stores inputs-derived outputs; ``--compare FILE`` reports the max difference against a file saved by
the other venv (same seed, same inputs). ``--other PYTHON`` runs the script under a second interpreter first and
compares. The numbers are host (CPU) time of the simulator's operator emulation plus the Python of vLLM / vllm-ascend /
gptoss-patch - they compare code paths on this machine; they are not NPU latencies.

Usage::

    /tmp/v11/bin/python scripts/bench_moe.py --other /tmp/v15/bin/python
    /tmp/v11/bin/python scripts/bench_moe.py --experts 16 --tokens 1 16 512 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16, help="number of experts (gpt-oss-120b: 128)")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=360, help="expert intermediate size per rank (2880 / TP)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per token count (after one warm-up call)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="save outputs to this file (torch.save)")
    ap.add_argument("--compare", help="compare outputs with a file saved by --save")
    ap.add_argument("--other", help="python of another venv: run this script there first, then compare")
    ap.add_argument("--no-upstream", action="store_true", help="0.11: skip timing the unpatched upstream path")
    return ap.parse_args(argv)


#: vllm-ascend's worker patches (adapt_patch) - off on 0.15.0rc1, whose patches import torchvision (not installed);
#: the MoE path does not use them.
WORKER_PATCHES = True


def _versions():
    from importlib.metadata import version

    return version("vllm"), version("vllm-ascend")


def _checkpoint(tmp, args):
    from gptoss_patch.selftest.tiny import write_checkpoint

    # only the config matters here (model type, dtype); tiny shapes keep the engine-config step fast
    write_checkpoint(tmp, preset="tiny", seed=0, tokenizer=False, num_hidden_layers=2, num_local_experts=4,
                     vocab_size=512, pad_token_id=511, eos_token_id=510)
    return tmp


def _inputs(args, dtype):
    import torch

    g = torch.Generator().manual_seed(args.seed)
    e, h, i = args.experts, args.hidden, args.intermediate
    w = {
        "router_w": torch.randn(e, h, generator=g) * (2.0 / h ** 0.5),
        "router_b": torch.randn(e, generator=g),
        "w13": torch.randn(e, h, 2 * i, generator=g) * (4.0 / h ** 0.5),
        "b13": torch.randn(e, 2 * i, generator=g),
        "w2": torch.randn(e, i, h, generator=g) * (1.0 / i ** 0.5),
        "b2": torch.randn(e, h, generator=g),
    }
    w = {k: v.to(dtype) for k, v in w.items()}
    x = torch.randn(max(args.tokens), h, generator=g).to(dtype)
    return w, x


def _build(cfg, w, dtype, args):
    import torch
    from vllm.model_executor.layers.fused_moe import FusedMoE
    try:
        from vllm.model_executor.model_loader.utils import set_default_torch_dtype  # vLLM 0.11
    except ImportError:
        from vllm.utils.torch_utils import set_default_torch_dtype  # vLLM 0.15

    from gptoss_patch.selftest import worker as vllm_setup

    e, h, i = args.experts, args.hidden, args.intermediate
    with vllm_setup.ascend_context(vllm_config=cfg, worker_patches=WORKER_PATCHES), set_default_torch_dtype(dtype):
        layer = FusedMoE(num_experts=e, top_k=4, hidden_size=h, intermediate_size=i, reduce_results=True,
                         renormalize=True, quant_config=None, prefix="bench.experts",
                         apply_router_weight_on_input=False, has_bias=True, activation="swigluoai",
                         is_sequence_parallel=False)
        with torch.no_grad():  # as vLLM's GptOssModel._load_weights_other (TP = 1)
            layer.w13_weight.copy_(w["w13"].permute(0, 2, 1))
            layer.w2_weight.copy_(w["w2"].permute(0, 2, 1))
            layer.w13_bias.copy_(w["b13"])
            layer.w2_bias.copy_(w["b2"])
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def _time(cfg, layer, w, x, tokens, repeat, variants):
    """Per token count: one warm-up call per variant, then ``repeat`` rounds that call every variant once in turn
    (interleaved, so load from other processes hits all variants alike). Returns ``{variant: {n: output}}`` and
    ``{variant: {n: (min, median)}}`` in seconds. ``variants``: ``{name: context-manager factory or None}``."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from gptoss_patch.selftest import worker as vllm_setup

    outs = {v: {} for v in variants}
    samples = {v: {n: [] for n in tokens} for v in variants}
    with vllm_setup.ascend_context(vllm_config=cfg, worker_patches=WORKER_PATCHES), torch.no_grad():
        for n in tokens:
            xs = x[:n]
            logits = F.linear(xs, w["router_w"], w["router_b"])
            for r in range(repeat + 1):
                for name, ctx in variants.items():
                    with (ctx() if ctx else contextlib.nullcontext()), \
                            vllm_setup.forward_context(cfg, n, with_prefill=False):
                        t0 = time.perf_counter()
                        y = layer(hidden_states=xs, router_logits=logits)
                        dt = time.perf_counter() - t0
                    if r:
                        samples[name][n].append(dt)
                    outs[name][n] = y
    times = {v: {n: (min(ts), statistics.median(ts)) for n, ts in per.items()} for v, per in samples.items()}
    return outs, times


class _Upstream:
    """0.11.x: the three MoE patches off (originals back, the by-value name too) for the duration."""

    def __enter__(self):
        import vllm_ascend.ops.common_fused_moe as cfm
        import vllm_ascend.ops.moe.moe_comm_method as mcm
        import vllm_ascend.ops.moe.moe_mlp as mlp

        self._saved = [(cfm.AscendUnquantizedFusedMoEMethod, "apply"), (mcm.MoECommMethod, "fused_experts"),
                       (mlp, "unified_apply_mlp"), (mcm, "unified_apply_mlp")]
        self._saved = [(o, a, o.__dict__[a]) for o, a in self._saved]
        for o, a, v in self._saved:
            setattr(o, a, getattr(v, "__wrapped__", v))
        return self

    def __exit__(self, *exc):
        for o, a, v in self._saved:
            setattr(o, a, v)


def run(args) -> dict:
    import torch

    from gptoss_patch.selftest import worker as vllm_setup

    global WORKER_PATCHES
    vllm_v, va_v = _versions()
    WORKER_PATCHES = va_v.startswith("0.11")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = vllm_setup.engine_config(_checkpoint(tmp, args), dtype=args.dtype)
    w, x = _inputs(args, dtype)
    layer = _build(cfg, w, dtype, args)
    native = not va_v.startswith("0.11")
    label = f"vllm-ascend {va_v} ({'native' if native else 'gptoss-patch'})"
    variants = {"main": None}
    if not native and not args.no_upstream:
        variants["upstream"] = _Upstream
    outs, times = _time(cfg, layer, w, x, args.tokens, args.repeat, variants)
    result = {"label": label, "times": times["main"], "out": {n: y.float() for n, y in outs["main"].items()}}
    if "upstream" in times:
        result["upstream_times"] = times["upstream"]
    return result


def _report(res, other=None):
    e = ARGS.experts
    print(f"GPT-OSS MoE layer, E={e} top-4, hidden {ARGS.hidden}, intermediate/rank {ARGS.intermediate}, "
          f"{ARGS.dtype}, AllGather; host ms per call, min / median of {ARGS.repeat} (CPU simulator)")
    cols = [res["label"]] + (["0.11 upstream, unpatched (wrong)"] if "upstream_times" in res else []) + (
        [other["label"]] if other else [])
    print(f"{'tokens':>7} | " + " | ".join(f"{c:>34}" for c in cols))
    for n in ARGS.tokens:
        cells = [res["times"][n]] + ([res["upstream_times"][n]] if "upstream_times" in res else []) + (
            [other["times"][n]] if other else [])
        print(f"{n:>7} | " + " | ".join(f"{lo * 1e3:>15.2f} / {med * 1e3:>9.2f} ms" for lo, med in cells))
    if other:
        for n in ARGS.tokens:
            a, b = res["out"][n], other["out"][n]
            rel = ((a - b).abs().max() / b.abs().max()).item()
            mine, theirs = res["label"].split()[1], other["label"].split()[1]
            print(f"  tokens {n:>4}: max|{mine} - {theirs}| / max|out| = {rel:.2e}"
                  f"{'  (bit-identical)' if torch_equal(a, b) else ''}")


def torch_equal(a, b):
    import torch

    return bool(torch.equal(a, b))


def main(argv=None) -> int:
    global ARGS
    ARGS = _parse(argv)
    from gptoss_patch_testkit import npu_sim

    npu_sim.install()
    import torch

    other = None
    if ARGS.other:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "other.pt")
            fwd = [a for a in (argv if argv is not None else sys.argv[1:])]
            i = fwd.index("--other")
            fwd = fwd[:i] + fwd[i + 2:]
            subprocess.run([ARGS.other, os.path.abspath(__file__), *fwd, "--save", path], check=True,
                           stdout=subprocess.DEVNULL)
            other = torch.load(path)
    elif ARGS.compare:
        other = torch.load(ARGS.compare)
    res = run(ARGS)
    if ARGS.save:
        torch.save(res, ARGS.save)
    _report(res, other)
    return 0


if __name__ == "__main__":
    sys.exit(main())
