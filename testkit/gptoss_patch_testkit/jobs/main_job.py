"""The main job: real harmony chat prompts through vLLM's GPT-OSS on patched vllm-ascend, against transformers.

``python -m gptoss_patch_testkit.jobs.main_job [--workdir DIR] [--steps 32] [--json]`` (run on the NPU
simulator, in a matrix-cell environment) writes a deterministic tiny GPT-OSS checkpoint with real
tokenizer files, renders >= 4 harmony conversations (system with a reasoning-effort line, developer
instructions, user question; 200-400 tokens; a shared prefix longer than one 128-token KV block),
runs them through :class:`gptoss_patch_testkit.jobs.runner.SimulatedGptOss` (chunked prefill, prefix
reuse, greedy decode) and through transformers' ``GptOssForCausalLM`` in float32 (teacher-forced on
the reference tokens), and reports per conversation: tokens matched / compared and the max logit
difference. Exit 0 only when every token matches.

Token comparison: the vLLM model runs in float32 by default (``--dtype bfloat16`` for the deployment
dtype; the simulator accepts float32 as a documented extension - the real fused operators take fp16/bf16),
the reference in float32. Each vLLM step is fed the reference's previous tokens (teacher forcing: the runner
emits its own argmax, compared with the reference's argmax at the same prefix), so one near-tie cannot
cascade into a different continuation. Logit tolerance: see :data:`LOGIT_TOLERANCE`.

Per vllm-ascend release (module layouts B, C, E, F of :mod:`gptoss_patch.matrix`) the runner follows that release's
``NPUModelRunner`` (:data:`gptoss_patch_testkit.jobs.runner.RUNNER_RULES`); the report names the layout, the KV-cache
groups vLLM formed (0.14.0rc1: a sliding-window group and a full-attention group) and how many sliding-window
block-table entries pointed at the null block, as vLLM's sliding-window manager does once blocks leave the window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gptoss_patch import config

#: Max |logit_vllm − logit_reference| accepted, per model dtype. The main job runs vLLM in float32 (the
#: simulator accepts float32 as a documented extension; the real fused operators take fp16/bf16), so the
#: comparison with the float32 reference isolates the *logic* of every patched path: measured hidden-state
#: differences are ~2e-5 after 4 layers (float32 summation order differs), logits of magnitude ~20 differ by
#: < 1e-4; 1e-3 leaves a 10x margin while any missing sink, window, bias or rope detail shifts logits by
#: O(0.1-10) (measured: the unpatched YaRN truncate alone gave 8.5). In bfloat16 (the deployment dtype)
#: transformers' own bf16 run deviates from its float32 run by up to 1.4 on these logits (measured), so
#: bf16 greedy tokens cannot be expected to match near ties; the bf16 mode is reported, with tolerance 3.0.
LOGIT_TOLERANCE = {"float32": 1e-3, "bfloat16": 3.0}

#: Layouts whose vllm-ascend casts float32 MoE weights to FRACTAL_NZ, which no NZ grouped matmul accepts: 0.12.0rc1's
#: ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` (ops/fused_moe/fused_moe.py) casts w13/w2 to NZ
#: whenever ``utils.is_enable_nz()`` (``VLLM_ASCEND_ENABLE_NZ``, default 1), whatever the dtype, and
#: ``aclnnGroupedMatmulWeightNz`` has alignment rules for INT8/BF16/FP16/INT4 weights only (docs/operators.md §4.2; 0.11.x's
#: ``is_enable_nz(dtype)`` and 0.13.0's ``maybe_trans_nz`` leave float32 in ND: "fp32 can not support NZ"). The float32
#: comparison run on these layouts sets vllm-ascend's own switch ``VLLM_ASCEND_ENABLE_NZ=0`` (reported in
#: ``Report.environment``); bfloat16 runs keep the default, NZ and the MoE padding patch.
FLOAT32_NZ_OFF_LAYOUTS = frozenset({"C"})


SHARED_DEVELOPER = (
    "You are the support assistant of an observatory that lends telescopes to schools. Always answer "
    "in plain English, keep answers short, and never invent opening hours, prices or telescope models "
    "that are not listed here. Opening hours: Tuesday to Saturday, 10:00 to 18:00; night sessions on "
    "Fridays from 20:00 to 23:30 when the sky is clear. Lending: schools may borrow one refractor "
    "(70 mm) or one reflector (130 mm) for two weeks; a teacher must sign the form; lenses are "
    "checked on return. Safety: never point a telescope at the Sun without a certified solar filter; "
    "children under twelve must be supervised. If a question is outside these topics, say that you "
    "can only help with the observatory and suggest writing to the front desk."
)

QUESTIONS = [
    ("low", "Can our class of twenty-four pupils come on a Friday night, and what should we bring?"),
    ("medium", "We borrowed the 130 mm reflector last month and one eyepiece now looks foggy. What do we do "
               "before returning it, and will the school be charged for the inspection?"),
    ("high", "Explain to a ten-year-old why the Moon looks different every night, then list three things "
             "they could observe with the 70 mm refractor from a city balcony, with the best time of the "
             "month for each one, and what to avoid for safety."),
    ("low", "Is the observatory open on Mondays?"),
    ("medium", "A parent asked whether it is safe to look at a solar eclipse through the refractor with "
               "sunglasses. Please give me a short answer I can forward to them."),
]


@dataclass
class ConversationResult:
    """Per conversation: prompt size, greedy tokens matched / compared, and logit agreement."""

    prompt_tokens: int
    matched: int
    compared: int
    max_logit_diff: float
    first_mismatch: int | None = None


@dataclass
class Report:
    """What the main job prints (``--json``: this as a dict)."""

    mode: str
    checkpoint: str = "bf16"  # "bf16" (the BF16 release layout) or "mxfp4" (the official MXFP4 layout)
    conversations: list[ConversationResult] = field(default_factory=list)
    states_seen: list[str] = field(default_factory=list)
    reused_prefix_blocks: int = 0
    graph_steps: int = 0
    captured_sizes: list[int] = field(default_factory=list)
    layout: str = ""  # gptoss_patch.matrix layout family of the installed vllm-ascend
    kv_groups: list[dict] = field(default_factory=list)  # per KV-cache group: spec class, sliding window, layers
    nulled_block_entries: int = 0  # sliding-window block-table entries pointed at the null block
    worker_patches_skipped: list[str] = field(default_factory=list)  # vllm-ascend worker patches needing torchvision
    environment: dict = field(default_factory=dict)  # environment variables this run set (FLOAT32_NZ_OFF_LAYOUTS)
    seconds: dict = field(default_factory=dict)
    decoded_first: str = ""
    harmony_parse: str = ""
    logit_tolerance: float = LOGIT_TOLERANCE["float32"]
    status: dict = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)  # gptoss_patch.evidence kinds whose patched path ran

    @property
    def ok(self) -> bool:
        return bool(self.conversations) and all(
            c.matched == c.compared and c.max_logit_diff <= self.logit_tolerance for c in self.conversations)


def harmony_encoding(vocab_dir: Path):
    """openai_harmony's GPT-OSS encoding, loaded offline from the o200k file laid out in ``vocab_dir``."""
    from gptoss_patch.tools import tokenizer

    prepared = tokenizer.prepare(vocab_dir)
    os.environ.update(prepared.env)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def render_prompts(encoding) -> list[list[int]]:
    """Token ids of the conversations, rendered for the assistant's completion (harmony format)."""
    from openai_harmony import (Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent)

    efforts = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
    prompts = []
    for effort, question in QUESTIONS:
        system = (SystemContent.new().with_reasoning_effort(efforts[effort])
                  .with_conversation_start_date("2026-11-29").with_knowledge_cutoff("2024-06"))
        conv = Conversation.from_messages([
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(SHARED_DEVELOPER)),
            Message.from_role_and_content(Role.USER, question),
        ])
        prompts.append(list(encoding.render_conversation_for_completion(conv, Role.ASSISTANT)))
    return prompts


def teacher_forced_reference(checkpoint: Path, prompts: list[list[int]], steps: int):
    """transformers float32 greedy continuation per prompt: (tokens, logits per step)."""
    from gptoss_patch_testkit.jobs.runner import reference_generate

    return reference_generate(checkpoint, prompts, steps, cache_dir=checkpoint.parent / "reference-cache")


def _writer_key() -> str:
    """Hash of the code that writes the checkpoint (tiny.py, tokenizer.py) and of transformers' major version: a
    workdir kept across runs (e.g. under ``~/.cache/gptoss-patch``) never serves a checkpoint an older writer made,
    nor tokenizer files saved by transformers 5.x (its ``tokenizer_config.json`` names a tokenizer class 4.x lacks)
    to a 4.x cell, or the reverse."""
    import hashlib

    import transformers

    from gptoss_patch.tools import tokenizer
    from gptoss_patch.selftest import tiny

    h = hashlib.sha256()
    from gptoss_patch.kernels import mxfp4

    from gptoss_patch_testkit import openai_reference

    for mod in (tiny, tokenizer, mxfp4, openai_reference):
        h.update(Path(mod.__file__).read_bytes())
    h.update(transformers.__version__.split(".")[0].encode())
    return h.hexdigest()[:10]


#: ``--checkpoint`` -> (tiny preset, ``write_checkpoint`` quantization). MXFP4 packs the expert intermediate dimension
#: in blocks of 32, so its preset has intermediate 384 (gptoss_patch.selftest.tiny "tiny-mxfp4"). "bf16-tp2" is the model
#: whose every rank at tensor parallel 2 holds gpt-oss-120b's per-rank shapes at TP 8 (8 q heads, 1 KV head, expert
#: intermediate 360).
CHECKPOINTS = {"bf16": ("tiny", None), "mxfp4": ("tiny-mxfp4", "mxfp4"), "bf16-tp2": ("tiny-tp2", None),
               "bf16-h1024": ("tiny-h1024", None)}


def ensure_checkpoint(workdir: Path, seed: int = 0, checkpoint_format: str = "bf16") -> Path:
    """The tiny GPT-OSS checkpoint (a key of :data:`CHECKPOINTS`, with tokenizer files) of ``seed`` under
    ``workdir``, written on first use whole into a temporary directory and then renamed, keyed by
    :func:`_writer_key`. The MXFP4 one has the official repositories' ``original/`` folder too
    (:func:`gptoss_patch_testkit.openai_reference.write_original`)."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    preset, quantization = CHECKPOINTS[checkpoint_format]
    workdir.mkdir(parents=True, exist_ok=True)
    suffix = "" if checkpoint_format == "bf16" else f"-{checkpoint_format}"
    checkpoint = workdir / f"gpt-oss-tiny{suffix}-seed{seed}-{_writer_key()}"
    if not (checkpoint / ".complete").exists():
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=".gpt-oss-tiny-", dir=workdir))
        write_checkpoint(tmp, preset=preset, seed=seed, tokenizer=True, quantization=quantization)
        if quantization == "mxfp4":  # the official repositories ship OpenAI's own layout beside, in original/
            from gptoss_patch_testkit.openai_reference import write_original

            write_original(tmp)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(checkpoint, ignore_errors=True)
        os.replace(tmp, checkpoint)
    return checkpoint


def run(workdir: Path, steps: int = 32, seed: int = 0, dtype: str = "float32", graph: bool = False,
        checkpoint_format: str = "bf16") -> Report:
    """Run the main job once (eager, or FULL_DECODE_ONLY ACL graphs for the decode steps); return the report.

    ``checkpoint_format``: a key of :data:`CHECKPOINTS`; ``"mxfp4"`` writes the tiny model in the official MXFP4
    layout, which vLLM loads through our dequantizing patch and transformers (the reference) dequantizes itself."""
    import gptoss_patch
    from gptoss_patch_testkit.jobs.runner import SimulatedGptOss, ascend_context

    report = Report(mode=f"{'FULL_DECODE_ONLY graph' if graph else 'eager'}, {dtype}",
                    logit_tolerance=LOGIT_TOLERANCE[dtype], checkpoint=checkpoint_format)
    t0 = time.perf_counter()
    checkpoint = ensure_checkpoint(workdir, seed, checkpoint_format)
    encoding = harmony_encoding(workdir / "vocab")
    prompts = render_prompts(encoding)
    report.seconds["setup"] = round(time.perf_counter() - t0, 1)

    t1 = time.perf_counter()
    ref = teacher_forced_reference(checkpoint, prompts, steps)
    report.seconds["reference"] = round(time.perf_counter() - t1, 1)

    t2 = time.perf_counter()
    from gptoss_patch.selftest import worker as vllm_setup

    if dtype == "float32" and vllm_setup.layout() in FLOAT32_NZ_OFF_LAYOUTS:
        report.environment["VLLM_ASCEND_ENABLE_NZ"] = os.environ["VLLM_ASCEND_ENABLE_NZ"] = "0"
    with ascend_context(checkpoint, dtype=dtype) as config:
        sim = SimulatedGptOss(config, num_blocks=48, graph=graph, max_decode_batch=len(prompts))
        reqs = sim.generate(prompts, steps, forced=[toks for toks, _ in ref])
        report.states_seen = sorted(sim.states_seen)
        report.reused_prefix_blocks = sim.reused_blocks
        report.graph_steps = sim.graph_steps
        report.captured_sizes = sorted(sim.captured_sizes)
        report.layout = sim.layout
        report.kv_groups = sim.kv_groups_summary()
        report.nulled_block_entries = sim.nulled_entries
        report.worker_patches_skipped = vllm_setup.worker_patch_report()["skipped"]
    report.seconds["vllm"] = round(time.perf_counter() - t2, 1)
    for p, r, (toks, logits) in zip(prompts, reqs, ref):
        matched = sum(int(a == b) for a, b in zip(r.output, toks))
        diffs = [float((a - b).abs().max()) for a, b in zip(r.logits, logits)]
        mism = next((i for i, (a, b) in enumerate(zip(r.output, toks)) if a != b), None)
        report.conversations.append(ConversationResult(len(p), matched, len(toks), max(diffs), mism))
    first = ref[0][0]
    report.decoded_first = encoding.decode(first)
    try:
        from openai_harmony import Role

        msgs = encoding.parse_messages_from_completion_tokens(first, Role.ASSISTANT)
        report.harmony_parse = "; ".join(f"{m.channel or '-'}: {m.content[0].text[:60]!r}" for m in msgs)
    except Exception as exc:  # noqa: BLE001 - random weights rarely form a well-formed harmony message
        report.harmony_parse = f"not a well-formed harmony message ({type(exc).__name__}): random tiny weights"
    report.status = gptoss_patch.status().as_dict()
    from gptoss_patch import evidence

    report.evidence = sorted(evidence.seen())
    report.seconds["total"] = round(time.perf_counter() - t0, 1)
    return report


def print_report(report: Report) -> None:
    """Human-readable report."""
    print(f"GPT-OSS main job ({report.mode}, {report.checkpoint} checkpoint) - vLLM GptOssForCausalLM on patched vllm-ascend "
          f"{report.status.get('versions', {}).get('vllm_ascend')} (NPU simulator) vs transformers float32")
    print(f"  attention states exercised: {', '.join(report.states_seen)}; KV blocks reused from the prefix "
          f"cache: {report.reused_prefix_blocks}")
    groups = "; ".join(f"{g['spec']}{'(window ' + str(g['sliding_window']) + ')' if g['sliding_window'] else ''}: "
                       f"{len(g['layers'])} layers" for g in report.kv_groups)
    print(f"  layout {report.layout}; KV-cache groups: {groups}"
          + (f"; out-of-window block-table entries pointed at the null block: {report.nulled_block_entries}"
             if report.nulled_block_entries else ""))
    if report.environment:
        print(f"  environment set for this run: {report.environment} (see FLOAT32_NZ_OFF_LAYOUTS)")
    if report.worker_patches_skipped:
        print(f"  vllm-ascend worker patches not applied (they import torchvision, absent here; vision models only): "
              f"{', '.join(report.worker_patches_skipped)}")
    if report.graph_steps:
        print(f"  decode steps replayed from captured ACL graphs: {report.graph_steps} (capture sizes "
              f"{report.captured_sizes})")
    for i, c in enumerate(report.conversations):
        flag = "ok" if c.matched == c.compared and c.max_logit_diff <= report.logit_tolerance else "MISMATCH"
        print(f"  conversation {i}: prompt {c.prompt_tokens} tokens, greedy tokens matched {c.matched}/{c.compared}, "
              f"max |logit diff| {c.max_logit_diff:.1e} (tolerance {report.logit_tolerance:g}) {flag}")
    print(f"  conversation 0 decoded: {report.decoded_first[:160]!r}")
    print(f"  harmony channels: {report.harmony_parse}")
    print(f"  time: {report.seconds}")
    print("  result: " + ("OK - every token identical" if report.ok else "FAILED"))


def run_in_child(steps: int = 32, graph: bool = False, timeout: float = 1800.0) -> dict[str, Any]:
    """Run this module's main job in a child interpreter on the simulator; its JSON report (``python -m gptoss_patch_testkit.verify``).

    ``graph``: decode steps through FULL_DECODE_ONLY ACL graphs (capture, replay, parameter update).

    A child keeps vLLM's process-wide state (distributed groups, current config) out of this process.
    """
    env = dict(os.environ, GPTOSS_PATCH_SIMULATE_NPU="1", VLLM_LOGGING_STREAM="ext://sys.stderr",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, "-m", "gptoss_patch_testkit.jobs.main_job", "--json", "--steps", str(steps)]
    proc = subprocess.run(cmd + (["--graph"] if graph else []), capture_output=True, text=True, env=env,
                          timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = proc.stderr.strip().splitlines()[-3:]
    return {"ok": False, "error": f"main job exited {proc.returncode}: {' | '.join(tail)}"}


def main(argv: list[str] | None = None) -> int:
    """CLI; exit 0 when every token matches, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="python -m gptoss_patch_testkit.jobs.main_job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path,
                    default=Path(config.path(config.CACHE_DIR, "/tmp/gptoss_patch-cache")) / "main-job")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--graph", action="store_true", help="decode steps through FULL_DECODE_ONLY ACL graphs")
    ap.add_argument("--checkpoint", default="bf16", choices=sorted(CHECKPOINTS),
                    help="tiny checkpoint layout: bf16 (BF16 releases) or mxfp4 (official MXFP4 release)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.json:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from gptoss_patch_testkit import npu_sim

    npu_sim.install()
    report = run(args.workdir, steps=args.steps, dtype=args.dtype, graph=args.graph, checkpoint_format=args.checkpoint)
    return emit(report, args.json, print_report)


def emit(report, as_json: bool, printer) -> int:
    """Print ``report`` (a dataclass with an ``ok`` property) as JSON or through ``printer``; 0 when ok, else 1."""
    if as_json:
        d = asdict(report)
        d["ok"] = report.ok
        print(json.dumps(d, default=str))
    else:
        printer(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
