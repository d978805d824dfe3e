"""``vllm serve`` on a natively supporting release, through vLLM's real engine and vllm-ascend's real NPUWorker on the
simulated NPU: FULL_DECODE_ONLY, which these rows refuse (the graph path drops the sinks up to 0.19.1rc1, vllm-ascend
PR #9165), stops at start-up - in the engine-core process, while the model is built - with the guard's message naming
the capability and the setting that avoids it, and the server never answers.

Token-level calibration of the native releases through the real engine is open (docs/simulator.md, "What vLLM's real
engine needs"): 0.15.0rc1 - 0.18.0 stop at the first sliding-window prefill on ``swa_mask`` (docs/upstream.md §4.4),
0.19.1rc1's runner computes its slot mapping with a Triton kernel the simulator does not run.
"""

import os
from pathlib import Path

from conftest import ROW

from gptoss_patch import matrix
from gptoss_patch.testing import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"


def test_native_full_decode_only_is_refused_at_startup():
    assert ROW.caps["attention_graph"].state == matrix.REFUSED  # every native cell row (0.15.0rc1 ... 0.19.1rc1)
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=4, startup_timeout=600)
    assert not report.started and not report.exchanges
    log = report.log_text
    assert "refusing to build a GPT-OSS model on vllm-ascend" in log, report.log_tail
    assert "attention_graph" in log and "PIECEWISE" in log, report.log_tail
    engine = [p for p in report.processes if p["name"].startswith("EngineCore")]
    assert engine and all(p["decision"] == ROW.verdict for p in engine), report.processes
