"""Calibration on upstream's plain paths: models that are not GPT-OSS, served through ``vllm serve`` on the simulated
NPU, answer with transformers' tokens (issue 32).

GPT-OSS's layers take gptoss-patch's attention on the patched releases, so the main job alone never exercises the
operators vllm-ascend launches for every other model (on 0.11.0: ATB ``_npu_flash_attention`` for a prefill without
cache, with the causal mask of ``attention_mask.py`` ``_generate_attn_mask``; ``_npu_paged_attention`` for decode).
The simulator must be right on those too: that is what calibrating it against upstream's code means, and a shared
mistake would otherwise hide in "other models are untouched" tests that compare two runs of the same simulator.

``python -m gptoss_patch_testkit.jobs.plain_models [--arch llama|qwen2] [--mode eager|PIECEWISE] [--workdir DIR]``,
in a matrix-cell environment:

1. a deterministic tiny checkpoint of transformers' own ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (hidden 64, two
   layers, 4 query heads : 2 KV heads of 16, bf16 safetensors; vocabulary 201088 so the main job's tokenizer files
   serve it unchanged);
2. ``vllm serve`` with the main job's flags (:func:`gptoss_patch_testkit.jobs.serve_job.serve_command`: float32, 128-token
   blocks, prefix caching, chunked prefill), the simulator in every process;
3. the main job's four raw completions (a prompt longer than 128 tokens, a second one, a prefix-cache hit, one longer
   than the step's token budget: chunked prefill), greedy, with log-probabilities;
4. transformers in float32, greedy, from the same ids: every token equal, every log-probability within
   :data:`gptoss_patch_testkit.jobs.serve_job.LOGPROB_TOLERANCE`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: name -> (transformers config class, model class, extra config): transformers' own architectures, not ours.
ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
}
#: The completions asked, in order (the main job's raw completions).
COMPLETIONS = ("conversation 0", "conversation 1", "prefix hit on conversation 0", "chunked prefill")
#: The tokenizer files of the main job's checkpoint that serve the plain models too (same vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class PlainReport:
    """One served run: per completion ``(label, prompt length, served ids, reference ids, max |logprob diff|)``."""

    arch: str
    mode: str
    started: bool = False
    completions: list[tuple[str, int, list[int], list[int], float]] = field(default_factory=list)
    log_tail: str = ""
    request_error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: what the server's log shows (:func:`gptoss_patch_testkit.jobs.serve_job.read_log`): the processes and their
    #: gptoss-patch decision, GPT-OSS first uses of a patched path (none for these models), graph captures
    evidence: object = None

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self, decision: str | None = None) -> list[str]:
        """What is wrong, one line each (empty when the run is right): the server down or a request failed; the
        four completions not all there; a token not equal to transformers' or a log-probability further than
        :data:`gptoss_patch_testkit.jobs.serve_job.LOGPROB_TOLERANCE`; a GPT-OSS patched path taken (these models
        must take upstream's code); with ``decision``, no engine-core process activated with that gptoss-patch
        decision; in PIECEWISE mode, no PIECEWISE graph captured."""
        from gptoss_patch_testkit.jobs.serve_job import LOGPROB_TOLERANCE

        if not self.started:
            return [f"vllm serve of the {self.arch} checkpoint did not come up:\n{self.log_tail}"]
        if self.request_error:
            return [f"request failed: {self.request_error}\n{self.log_tail}"]
        out = []
        labels = [c[0] for c in self.completions]
        if labels != list(COMPLETIONS):
            out.append(f"completions {labels}, expected {list(COMPLETIONS)}")
        for label, n, got, ref, diff in self.completions:
            if got != ref:
                out.append(f"{self.arch} {self.mode} {label} ({n} prompt tokens): served {got}, transformers {ref}")
            elif not diff <= LOGPROB_TOLERANCE:
                out.append(f"{self.arch} {self.mode} {label}: |logprob - transformers'| {diff} > {LOGPROB_TOLERANCE}")
        ev = self.evidence
        if ev is not None:
            if ev.first_use:
                out.append(f"a non-GPT-OSS model took a GPT-OSS patched path: {ev.first_use}")
            if decision is not None and not any(p["name"].startswith("EngineCore") and p["decision"] == decision
                                                for p in ev.processes):
                out.append(f"no engine core activated with decision {decision}: {ev.processes}")
            if self.mode == "PIECEWISE" and not any("PIECEWISE" in kind for kind in ev.graph_captures):
                out.append(f"no PIECEWISE graphs captured: {ev.graph_captures}")
        return out


def write_checkpoint(directory: Path, arch: str, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the tiny ``arch`` checkpoint (a key of :data:`ARCHES`) into ``directory`` with transformers'
    ``save_pretrained`` (bf16 safetensors; weights from ``torch.manual_seed(seed)`` and the class's own init, biases
    of Qwen2's q/k/v projections included), the tokenizer files copied from ``tokenizer_from``.

    Raises:
        KeyError: an unknown ``arch``.
    """
    import torch
    import transformers

    config_cls, model_cls, extra = ARCHES[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=201088, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
        initializer_range=0.2, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, directory / name)
    return directory


def ensure_checkpoint(workdir: Path, arch: str, seed: int = 0) -> Path:
    """The ``arch`` checkpoint under ``workdir`` (written once, whole, then renamed), its tokenizer files those of the
    main job's checkpoint (:func:`gptoss_patch_testkit.jobs.main_job.ensure_checkpoint`)."""
    import transformers

    from gptoss_patch_testkit.jobs import main_job

    gptoss = main_job.ensure_checkpoint(workdir, seed)
    checkpoint = workdir / f"{arch}-tiny-seed{seed}-tf{transformers.__version__}"
    if not (checkpoint / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-tiny-", dir=workdir))
        write_checkpoint(tmp, arch, gptoss, seed)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(checkpoint, ignore_errors=True)
        os.replace(tmp, checkpoint)
    return checkpoint


def reference(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers in float32, greedy: per prompt the generated ids and the log-probability of each."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=model.config.pad_token_id)[0, len(prompt):].tolist()
            logits = model(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
            lps = torch.log_softmax(logits, -1)
            out.append((gen, [float(lps[i, t]) for i, t in enumerate(gen)]))
    return out


def run(workdir: Path, arch: str = "llama", mode: str = "eager", max_tokens: int = 12,
        startup_timeout: float = 600.0) -> PlainReport:
    """Serve the ``arch`` checkpoint in ``mode`` (:data:`gptoss_patch_testkit.jobs.serve_job.MODES`) and compare its
    completions with transformers; never raises for a server that fails (``report.log_tail`` says why)."""
    from gptoss_patch.tools import tokenizer
    from gptoss_patch_testkit.jobs import main_job, serve_job

    report = PlainReport(arch, mode)
    t0 = time.perf_counter()
    checkpoint = ensure_checkpoint(workdir, arch)
    vocab = tokenizer.prepare(workdir / "vocab")
    rendered = main_job.render_prompts(main_job.harmony_encoding(workdir / "vocab"))
    prompts = list(zip(COMPLETIONS, (rendered[0], rendered[1], rendered[0][:130] + rendered[3][-24:],
                                     rendered[2] + rendered[4][:40])))
    port = serve_job.free_port()
    cmd = [a for a in serve_job.serve_command(checkpoint, port, mode) if a not in ("--reasoning-parser", "openai_gptoss")]
    log = workdir / f"serve-{arch}-{mode}-{os.getpid()}.log"
    # vLLM's compile caches off: vLLM 0.12's AOT cache (torch_aot_compile, keyed by the compilation config and the
    # model's forward code) handed a second start of the same Llama a compiled graph that failed at its first profile
    # run ("mat1 and mat2 shapes cannot be multiplied (4x2 and 128x64)"); each start compiles afresh instead
    env = serve_job.serve_env(vocab.env, VLLM_DISABLE_COMPILE_CACHE="1")
    with serve_job.Server(cmd, env, log, port) as server:
        report.started = server.wait_ready(startup_timeout)
        report.seconds["startup"] = round(time.perf_counter() - t0, 1)
        if not report.started:
            report.log_tail = "\n".join(server.log().splitlines()[-40:])
            return report
        try:
            first = serve_job.complete(server.url, prompts[0][1], max_tokens)  # fills the prefix cache
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                served = [first] + list(pool.map(lambda p: serve_job.complete(server.url, p[1], max_tokens),
                                                 prompts[1:]))
        except Exception as exc:  # noqa: BLE001 - reported with the server's log
            report.request_error = f"{type(exc).__name__}: {exc}"
            report.log_tail = "\n".join(server.log().splitlines()[-40:])
            return report
        report.evidence = serve_job.ServeReport(mode=mode, checkpoint=arch)
        serve_job.read_log(report.evidence, server.log())
    t1 = time.perf_counter()
    refs = reference(checkpoint, [p for _, p in prompts], max_tokens)
    report.seconds["reference"] = round(time.perf_counter() - t1, 1)
    for (label, prompt), (ids, lps, _), (ref_ids, ref_lps) in zip(prompts, served, refs):
        diff = max((abs(a - b) for a, b in zip(lps, ref_lps)), default=float("inf"))
        report.completions.append((label, len(prompt), list(ids), ref_ids, diff))
    report.seconds["total"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gptoss_patch_testkit.jobs.plain_models", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHES), default="llama")
    ap.add_argument("--mode", choices=("eager", "PIECEWISE"), default="eager")
    from gptoss_patch import config

    ap.add_argument("--workdir", type=Path,
                    default=Path(config.path(config.CACHE_DIR, "/tmp/gptoss_patch-cache")) / "main-job")
    args = ap.parse_args(argv)
    r = run(args.workdir, args.arch, args.mode)
    problems = r.problems()
    print(json.dumps({"arch": r.arch, "mode": r.mode, "started": r.started, "ok": not problems, "seconds": r.seconds,
                      "problems": problems, "completions": r.completions}, indent=1))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
