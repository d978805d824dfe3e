"""``python -m gptoss_patch_testkit.verify [verify's options]``: ``gptoss_patch.verify`` on the CPU NPU simulator,
plus the simulated main job (what ``verify --simulate`` was before the simulator left the product).

Sets ``GPTOSS_PATCH_SIMULATE_NPU=1`` (children inherit it; the testkit's start-up finder serves the simulator at the
first ``import torch_npu``), then runs
:func:`gptoss_patch.verify.main` with one extra report section, :func:`main_job_section`: on a patched row whose
attention path our runner covers (vllm-ascend 0.11-0.14), the tiny GPT-OSS through vLLM's ``GptOssForCausalLM`` on the
patched vllm-ascend, eager and with FULL_DECODE_ONLY graphs, against transformers
(:func:`gptoss_patch_testkit.jobs.main_job.run_in_child`); on layouts H and G it says where the engine-level check is.
Exit status as ``gptoss_patch.verify``'s.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main_job_section(report: dict[str, Any], status: Any) -> None:
    """Add ``report["main_job"]`` (``{"eager": job, "graph": job}`` or ``{"skipped": why}``); a job that does not
    reproduce the reference is a problem naming the mode."""
    from gptoss_patch import matrix

    row = next((r for r in matrix.ROWS if r.vllm_ascend == status.row), None)
    patched_attention = status.capabilities.get("attention", {}).get("state") == "patched"
    if status.decision != "apply" or not patched_attention or report.get("import_error"):
        return
    if matrix.native_sinks(row):
        report["main_job"] = {"skipped": "the runner's rules cover vllm-ascend 0.11-0.14; on layouts H and G the main "
                                         "job is vllm serve through the real engine (tests/cell/native_015/"
                                         "test_native_serve.py, or python -m gptoss_patch_testkit.jobs.serve_job)"}
        report.setdefault("section_lines", []).append(f"simulated GPT-OSS run: not run here - "
                                                      f"{report['main_job']['skipped']}")
        return
    from gptoss_patch_testkit.jobs import main_job

    report["main_job"] = {}
    for mode, graph in (("eager", False), ("graph", True)):
        job = main_job.run_in_child(graph=graph)
        report["main_job"][mode] = job
        report.setdefault("section_lines", []).extend(job_lines(job))
        if not job.get("ok"):
            report["problems"].append(f"the simulated GPT-OSS run ({mode}) did not reproduce the reference: "
                                      + (job.get("error") or "token or logit mismatch (see main job report)"))


def job_lines(job: dict[str, Any]) -> list[str]:
    """The human table's lines for one main-job run (:func:`gptoss_patch_testkit.jobs.main_job.run_in_child`'s dict);
    a run that failed before its report shows its error."""
    if "conversations" not in job:
        return [f"simulated GPT-OSS run: FAILED - {job.get('error') or job}"]
    extra = (f"; decode steps replayed from ACL graphs: {job['graph_steps']} (sizes {job['captured_sizes']})"
             if job.get("graph_steps") else "")
    lines = [f"simulated GPT-OSS run ({job['mode']}; vLLM GptOssForCausalLM on patched vllm-ascend vs transformers):",
             f"  attention states: {', '.join(job['states_seen'])}; prefix-cache blocks reused: "
             f"{job['reused_prefix_blocks']}{extra}"]
    for i, c in enumerate(job["conversations"]):
        lines.append(f"  conversation {i}: prompt {c['prompt_tokens']} tokens, tokens matched "
                     f"{c['matched']}/{c['compared']}, max |logit diff| {c['max_logit_diff']:.1e} "
                     f"(tolerance {job['logit_tolerance']:g})")
    lines += [f"  conversation 0 decoded: {job['decoded_first'][:120]!r}", f"  harmony channels: {job['harmony_parse']}",
              f"  time (s): {job['seconds']}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run ``gptoss_patch.verify`` on the simulator with :func:`main_job_section`; returns its exit status."""
    os.environ["GPTOSS_PATCH_SIMULATE_NPU"] = "1"  # children inherit it
    # the testkit's start-up finder serves the simulator at the first ``import torch_npu`` (importing the module
    # installs it where the .pth was not processed); nothing heavy is imported before verify parses its arguments,
    # so --help and --matrix need no torch
    import _gptoss_patch_testkit_startup  # noqa: F401 - its import installs the finder
    from gptoss_patch import verify

    return verify.main(argv, sections=(main_job_section,), prog_name="python -m gptoss_patch_testkit.verify")


if __name__ == "__main__":
    sys.exit(main())
