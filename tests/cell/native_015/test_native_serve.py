"""Calibration at engine level: ``vllm serve`` on a natively supporting release (upstream's own GPT-OSS code, layout G's
one patch where the row has it) through vLLM's real engine and vllm-ascend's real NPUWorker on the simulated NPU.

* Where the release passes the documented mask (0.19.1rc1), PIECEWISE and eager answer with transformers' tokens: the
  simulator reproduces a release validated on hardware.
* 0.15.0rc1 - 0.18.0 give the sliding-window layers ``swa_mask`` with ``sparse_mode=4`` (docs/upstream.md §4.4): the
  engine stops at the first sliding-window prefill with the simulator's message naming the documented constraint
  (calibration finding 1, now seen through the whole engine), and with upstream's fix backported in the engine process
  (``GPTOSS_PATCH_SIM_BACKPORT_8387=1``, :mod:`gptoss_patch.testing.npu_sim.backports`) it answers with transformers'
  tokens.
* FULL_DECODE_ONLY, which these rows refuse (the graph path drops the sinks up to 0.19.1rc1, vllm-ascend PR #9165),
  stops at start-up with the guard's message naming the capability and the setting that avoids it.
"""

import os
from pathlib import Path

from conftest import ROW

from gptoss_patch import matrix
from gptoss_patch.testing import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"
GRAPH_REFUSED = ROW is not None and ROW.caps["attention_graph"].state == matrix.REFUSED
SWA_MASK = ROW is not None and "swa_mask" in ROW.caps["attention"].note
BACKPORT = {"GPTOSS_PATCH_SIM_BACKPORT_8387": "1"} if SWA_MASK else {}


def _tokens_equal(report: serve_job.ServeReport, mode: str) -> None:
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


def test_native_vllm_serve_piecewise_answers_with_transformers_tokens():
    _tokens_equal(serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, extra_env=BACKPORT), "PIECEWISE")


def test_native_vllm_serve_eager():
    """0.19.1rc1: tokens equal. 0.15.0rc1 - 0.18.0 unmodified: the sliding-window prefill stops on swa_mask."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=12)
    if not SWA_MASK:
        _tokens_equal(report, "eager")
        return
    assert report.started  # the server starts; its first sliding-window prefill meets the undocumented mask
    assert not report.exchanges or not all(e.ok for e in report.exchanges)
    log = report.log_text
    assert "atten_mask for sparse_mode=4 must be the lower-triangular template" in log, report.log_tail


def test_native_full_decode_only_graphs():
    """Refused rows stop ``vllm serve`` at start-up with the guard's message; a row whose graph path is native
    answers with transformers' tokens."""
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=12, startup_timeout=600, extra_env=BACKPORT)
    if GRAPH_REFUSED:
        assert not report.started and not report.exchanges
        log = report.log_text
        assert "refusing to build a GPT-OSS model on vllm-ascend" in log, report.log_tail
        assert "attention_graph" in log and "PIECEWISE" in log, report.log_tail
    else:
        _tokens_equal(report, "FULL_DECODE_ONLY")
