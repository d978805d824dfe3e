"""Calibration at engine level: ``vllm serve`` on a natively supporting release (upstream's own GPT-OSS code, layout G's
one patch where the row has it) through vLLM's real engine and vllm-ascend's real NPUWorker on the simulated NPU.

PIECEWISE and eager must answer with transformers' tokens: that is the simulator reproducing a release validated on
hardware. FULL_DECODE_ONLY, where the row refuses the graph path (it drops the sinks up to 0.19.1rc1, vllm-ascend PR
#9165), must stop at start-up with the guard's message naming the capability and the setting that avoids it.
"""

import os
from pathlib import Path

import pytest

from gptoss_patch import matrix
from gptoss_patch.testing import serve_job
from conftest import ROW

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"
GRAPH_REFUSED = ROW is not None and ROW.caps["attention_graph"].state == matrix.REFUSED


@pytest.mark.parametrize("mode", ["PIECEWISE", "eager"])
def test_native_vllm_serve_answers_with_transformers_tokens(mode):
    report = serve_job.run(WORKDIR, mode=mode, max_tokens=12)
    serve_job.print_report(report)
    assert report.started, f"vllm serve did not come up:\n{report.log_tail}"
    engine = [p for p in report.processes if p["name"].startswith("EngineCore")]
    assert engine and all(p["decision"] == ROW.verdict for p in engine), (report.processes, ROW.verdict)
    if mode == "PIECEWISE":
        assert any("PIECEWISE" in k and n == 3 for k, n in report.graph_captures.items()), report.graph_captures
        assert report.npu_graphs.get("replays", 0) >= 4, report.npu_graphs
    for e in report.exchanges:
        assert e.generated == e.reference[:len(e.generated)] and len(e.generated) == 12, (e.label, e.generated,
                                                                                          e.reference)
        assert e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, (e.label, e.max_logprob_diff)
    assert len(report.exchanges) == 6 and report.verify_ok and report.ok


def test_native_full_decode_only_graphs():
    """Refused rows stop ``vllm serve`` at start-up with the guard's message; a row whose graph path is native
    answers with transformers' tokens."""
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=12, startup_timeout=600)
    if GRAPH_REFUSED:
        assert not report.started and not report.exchanges
        log = report.log_text
        assert "refusing to build a GPT-OSS model on vllm-ascend" in log, report.log_tail
        assert "attention_graph" in log and "PIECEWISE" in log, report.log_tail
    else:
        serve_job.print_report(report)
        assert report.ok
