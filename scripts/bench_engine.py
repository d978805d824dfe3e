"""Benchmark of vLLM's real engine on the simulated NPU: start-up phases of ``vllm serve`` and the host-side cost of a
decode step, for the installed vllm / vllm-ascend pair (run it in a matrix cell, e.g. the patched 0.11.0 cell and the
native 0.15.0rc1 cell, and compare). Figures are printed, never asserted.

``python scripts/bench_engine.py [--workdir DIR] [--steps 32] [--skip-serve] [--skip-decode]
[--tensor-parallel-size 2] [--upstream-attention]``

* Start-up (``vllm serve``, PIECEWISE, the main job's flags): seconds from launch to each phase vLLM and vllm-ascend
  log (model loaded, torch.compile done, ACL graphs captured, engine initialised, ``/health`` answering), read from
  the server's own log lines. At ``--tensor-parallel-size 2`` (the model whose ranks hold gpt-oss-120b's per-rank
  shapes at TP 8), per rank: the weights vLLM loaded, the peak simulated device memory of the profiling run
  (``0.9 * total - available`` from vllm-ascend's worker log line; the simulator counts the worker process's
  resident-set growth, so it includes the host-side runtime) and the MoE padding the NZ patch applied (``nz_padding.pad_moe_intermediate``'s
  log line; none where the release does not NZ-cast, e.g. float32 on 0.12.0rc1; ``GPTOSS_PATCH_MOE_PAD=always`` forces
  it). On the tiny model the padding itself adds ~0.2 MB per rank; the loaded-weights figure still grows by ~22 MB
  with it (0.128 -> 0.150 GB in the 0.11.0 cell, 2026-12-02): the simulator counts resident-set growth, which also
  holds the transient copies the padding makes (freed heap memory need not return to the OS; not traced further). The padding overhead at real shapes is
  ``scripts/pad_report.py``'s (gpt-oss-120b at TP 8: 607.6 MiB per rank, 2.22 % of its experts).
* Decode step (in-process ``LLM``, eager, batch of 4 harmony prompts, greedy): wall time per decode step and, the
  figure that does not depend on the machine's load, the number of simulated ``torch_npu`` operator calls per decode
  step (the launches an NPU would see from the host). The wall time includes the simulator's emulation of every
  operator on the CPU: compare it only between cells on the same machine, same load. ``--upstream-attention`` (cells
  0.15.0rc1 - 0.18.0): the same decode through upstream's own attention instead of ours - gptoss-patch disabled and the
  ``swa_mask`` the simulator refuses replaced by the template of upstream's later fix (PR #8387) - so patched and
  native are compared on one release, one model and one batch.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
from pathlib import Path

PHASES = [
    ("model weights loaded", re.compile(r"Loading (?:model )?weights took")),
    ("torch.compile done", re.compile(r"torch\.compile takes")),
    ("ACL graphs captured", re.compile(r"Graph capturing finished")),
    ("engine initialised", re.compile(r"init engine .* took")),
    ("API server ready", re.compile(r"Application startup complete")),
]


_RANK = re.compile(r"\((?:Worker_TP|VllmWorker[-_]?)(\d+)[^)]*pid=(\d+)\)")
_WEIGHTS = re.compile(r"Loading (?:model )?weights took ([\d.]+) GB")
_MEMORY = re.compile(r"Available memory: (\d+), total memory: (\d+)")
_PAD = re.compile(r"MoE intermediate size per rank (\d+) -> (\d+)")
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization (serve_job.serve_command does not set it)


def per_rank(text: str) -> dict[int, dict[str, str]]:
    """Per-rank figures from a ``vllm serve`` log whose lines carry vLLM's ``(Worker_TP<r> pid=...)`` prefix."""
    ranks: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = _RANK.search(line)
        if not m:
            continue
        r = ranks.setdefault(int(m.group(1)), {})
        if (w := _WEIGHTS.search(line)):
            r["weights loaded"] = f"{float(w.group(1)):.3f} GB"
        if (a := _MEMORY.search(line)):
            # vllm-ascend's worker logs available = total * gpu_memory_utilization - peak (worker_v1.py); the serve
            # command keeps vLLM's default utilisation, 0.9
            total = int(a.group(2))
            peak = GPU_MEMORY_UTILIZATION * total - int(a.group(1))
            r["peak simulated device memory while profiling"] = f"{peak / 2**30:.2f} GiB of {total / 2**30:.0f} GiB"
        if (p := _PAD.search(line)):
            r["MoE intermediate padded"] = f"{p.group(1)} -> {p.group(2)} per rank"
    return ranks


def bench_startup(workdir: Path, tensor_parallel_size: int = 1) -> None:
    from gptoss_patch.tools import tokenizer
    from gptoss_patch_testkit.jobs import main_job, serve_job

    ckpt = main_job.ensure_checkpoint(workdir, checkpoint_format="bf16" if tensor_parallel_size == 1 else "bf16-tp2")
    vocab = tokenizer.prepare(workdir / "vocab")
    port = serve_job.free_port()
    log = workdir / f"bench-serve-tp{tensor_parallel_size}-{os.getpid()}.log"
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    cmd = serve_job.serve_command(ckpt, port, "PIECEWISE", tensor_parallel_size=tensor_parallel_size)
    with serve_job.Server(cmd, serve_job.serve_env(vocab.env), log, port) as server:
        while server.proc.poll() is None and len(seen) < len(PHASES):
            text = server.log()
            for name, pat in PHASES:
                if name not in seen and pat.search(text):
                    seen[name] = time.monotonic() - t0
            if time.monotonic() - t0 > 900:
                break
            time.sleep(0.2)
        if server.wait_ready(60):
            seen["/health answers"] = time.monotonic() - t0
        text = server.log()
    print(f"vllm serve start-up (PIECEWISE, TP {tensor_parallel_size}, simulated NPU), seconds from launch:")
    for name, _ in PHASES + [("/health answers", None)]:
        print(f"  {name:24s} {seen[name]:7.1f}" if name in seen else f"  {name:24s}     n/a")
    if tensor_parallel_size > 1:
        for rank, figures in sorted(per_rank(text).items()):
            print(f"  rank {rank}: " + "; ".join(f"{k} {v}" for k, v in figures.items())
                  + ("" if "MoE intermediate padded" in figures else "; MoE intermediate not padded"))


def upstream_template_mask() -> str:
    """For ``--upstream-attention``: make vllm-ascend 0.15.0rc1 - 0.18.0's own sliding layers runnable on the simulator
    by handing them the template mask instead of ``swa_mask`` - what upstream's fix (PR #8387, 0.19.1rc1) passes
    (docs/upstream.md §4.4). Wraps ``AscendAttentionMetadataBuilder.build`` in this process; returns what was done.

    Raises:
        SystemExit: the installed vllm-ascend has no ``swa_mask`` (nothing to substitute: 0.11-0.14, or 0.19.1rc1+).
    """
    import dataclasses

    import vllm_ascend.attention.attention_v1 as aa

    if "swa_mask" not in {f.name for f in dataclasses.fields(aa.AscendMetadata)}:
        raise SystemExit("--upstream-attention is for vllm-ascend 0.15.0rc1 - 0.18.0 (their AscendMetadata.swa_mask); "
                         "elsewhere run without it")
    build = aa.AscendAttentionMetadataBuilder.build

    def build_with_template(self, *args, **kwargs):
        md = build(self, *args, **kwargs)
        return dataclasses.replace(md, swa_mask=md.attn_mask)

    aa.AscendAttentionMetadataBuilder.build = build_with_template
    return "upstream's own attention (gptoss-patch disabled), swa_mask replaced by the template (PR #8387)"


def bench_decode(workdir: Path, steps: int, upstream_attention: bool = False) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from gptoss_patch.tools import tokenizer
    from gptoss_patch_testkit import npu_sim
    from gptoss_patch_testkit.jobs import main_job

    npu_sim.install()
    import torch_npu
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import gptoss_patch

    st = gptoss_patch.status()
    what = upstream_template_mask() if upstream_attention else \
        f"gptoss-patch {st.decision}, patches: {', '.join(p.name for p in st.patches) or 'none'}"

    ckpt = main_job.ensure_checkpoint(workdir)
    os.environ.update(tokenizer.prepare(workdir / "vocab").env)
    prompts = main_job.render_prompts(main_job.harmony_encoding(workdir / "vocab"))[:4]
    llm = LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=4,
              block_size=128, num_gpu_blocks_override=48, max_num_batched_tokens=2048)
    calls = {"n": 0}
    originals = {}
    for name in dir(torch_npu):
        fn = torch_npu.__dict__.get(name)
        if callable(fn) and not isinstance(fn, type) and \
                getattr(fn, "__module__", "").startswith("gptoss_patch_testkit.npu_sim.ops"):
            originals[name] = fn

            @functools.wraps(fn)  # keeps the signature (gptoss_patch.kernels.attention.detect_path reads it)
            def counted(*a, _fn=fn, **k):
                calls["n"] += 1
                return _fn(*a, **k)

            setattr(torch_npu, name, counted)
    params = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    llm.generate(params, one, use_tqdm=False)  # warm-up

    def timed(sampling) -> tuple[float, int]:
        calls["n"] = 0
        t = time.perf_counter()
        llm.generate(params, sampling, use_tqdm=False)
        return time.perf_counter() - t, calls["n"]

    # the fastest of 3 runs each (a difference of two noisy wall times went negative at --steps 2 on a loaded host)
    prefill_s, prefill_calls = min(timed(one) for _ in range(3))
    total_s, total_calls = min(timed(many) for _ in range(3))
    for name, fn in originals.items():
        setattr(torch_npu, name, fn)
    step_s = max(total_s - prefill_s, 0.0) / steps
    step_calls = (total_calls - prefill_calls) / steps
    print(f"decode step (eager, batch 4, {steps} steps after a prefill of {sum(map(len, prompts))} tokens; {what}):")
    print(f"  wall time per decode step: {step_s * 1e3:.1f} ms (simulator emulation included)")
    print(f"  simulated torch_npu operator calls per decode step: {step_calls:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path,
                    default=Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-serve", action="store_true", help="no vllm serve start-up measurement")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, choices=[1, 2],
                    help="ranks of the start-up measurement (2: per-rank memory and padding)")
    ap.add_argument("--skip-decode", action="store_true", help="no decode-step measurement")
    ap.add_argument("--upstream-attention", action="store_true",
                    help="decode step through vllm-ascend 0.15.0rc1-0.18.0's own attention: gptoss-patch disabled, "
                         "upstream's swa_mask replaced by the template of its later fix (PR #8387); implies "
                         "--skip-serve")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.upstream_attention and args.skip_decode:
        ap.error("--upstream-attention measures the decode step: drop --skip-decode")
    if args.upstream_attention and not (os.environ.get("GPTOSS_PATCH_DISABLE") == "1"
                                        and os.environ.get("GPTOSS_PATCH_ALLOW_UNPATCHED") == "1"):
        # the .pth hook activates at interpreter start-up: start again with the patches off (the guard let through)
        env = dict(os.environ, GPTOSS_PATCH_DISABLE="1", GPTOSS_PATCH_ALLOW_UNPATCHED="1")
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                  env)
    if args.upstream_attention:
        args.skip_serve = True
    import importlib.metadata as md

    print(f"vllm {md.version('vllm')} + vllm-ascend {md.version('vllm-ascend')}")
    if not args.skip_serve:
        bench_startup(args.workdir, args.tensor_parallel_size)
    if not args.skip_decode:
        bench_decode(args.workdir, args.steps, args.upstream_attention)
    return 0


if __name__ == "__main__":
    sys.exit(main())
