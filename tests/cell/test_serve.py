"""``vllm serve`` through vLLM's real engine and vllm-ascend's real NPUWorker on the simulated NPU (patched cells).

Each test starts the user's own command - ``vllm serve <tiny GPT-OSS>`` with PIECEWISE ACL graphs, with
FULL_DECODE_ONLY graphs, or eager - asks it over HTTP (harmony chat completions and raw completions: a prompt past the
128-token window, a prefix-cache hit, a chunked prefill) and compares every generated token, and its log-probability,
with transformers' ``GptOssForCausalLM`` in float32 (:mod:`gptoss_patch.testing.serve_job`). The unpatched server
and the official MXFP4 layout: tests/cell/test_serve_more.py (the 0.11.0 cell).
"""

import os
from pathlib import Path

import pytest

from gptoss_patch.testing import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"

#: The capture each mode makes: vllm-ascend's runner logs "Capturing ACL graphs (<kind>)".
CAPTURE_KIND = {"PIECEWISE": "PIECEWISE", "FULL_DECODE_ONLY": "FULL", "eager": None}


def _checks(report: serve_job.ServeReport, mode: str) -> None:
    serve_job.print_report(report)
    assert report.started, f"vllm serve did not come up:\n{report.log_tail}"
    names = {p["name"] for p in report.processes}
    assert any(n.startswith("EngineCore") for n in names), report.processes  # the engine core is its own process
    assert len(report.processes) >= 2 and all(p["decision"] == "apply" for p in report.processes), report.processes
    used = {(u["capability"], u["path"]) for u in report.first_use if u["process"].startswith("EngineCore")}
    assert {("attention", "patched"), ("moe", "patched")} <= used, report.first_use
    kind = CAPTURE_KIND[mode]
    if kind is None:
        assert not report.graph_captures, report.graph_captures
    else:
        assert any(kind in k and n == 3 for k, n in report.graph_captures.items()), report.graph_captures
        # the requests were answered from replayed NPU graphs (PIECEWISE: every piece of every size is one graph)
        assert report.npu_graphs.get("captures", 0) >= 3 and report.npu_graphs.get("replays", 0) >= 4, \
            report.npu_graphs
    assert len(report.exchanges) == 6 and {e.kind for e in report.exchanges} == {"chat", "completion"}
    for e in report.exchanges:
        assert e.generated == e.reference[:len(e.generated)] and len(e.generated) == 12, (e.label, e.generated,
                                                                                          e.reference)
        assert e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, (e.label, e.max_logprob_diff)
    assert report.verify_ok, (report.verify_server_exit, report.verify_server_problems)
    assert report.ok


@pytest.mark.parametrize("mode", serve_job.MODES)
def test_vllm_serve_answers_with_transformers_tokens(mode):
    _checks(serve_job.run(WORKDIR, mode=mode, max_tokens=12), mode)
