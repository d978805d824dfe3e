"""``vllm serve`` on a natively supporting release, through vLLM's real engine and vllm-ascend's real NPUWorker on the
simulated NPU.

* FULL_DECODE_ONLY, which these rows refuse (the graph path drops the sinks up to 0.19.1rc1, vllm-ascend PR #9165),
  stops at start-up - in the engine-core process, while the model is built - with the guard's message naming the
  capability and the setting that avoids it, and the server never answers.
* Layouts H and G (0.15.0rc1 - 0.18.0): the main job (PIECEWISE, tensor parallel 2) answers with transformers'
  tokens with the patches; without them (``GPTOSS_PATCH_DISABLE=1`` + ``GPTOSS_PATCH_ALLOW_UNPATCHED=1``) the first prefill hands the
  simulated operator what its documentation excludes - upstream's ``swa_mask`` with sparse_mode 4 (the device accepts
  it and computes something undocumented: docs/upstream.md §4.4) and, from 0.17.0rc1 on, in a PrefillNoCache batch
  before that a non-contiguous ``value`` - and it refuses, so no request is answered. With upstream's later fix of the
  mask (PR #8387) substituted by hand, 0.15.0rc1 answers exactly the tokens of transformers with a 129-key window -
  the band deviation (docs/upstream.md §4.3) - and not GPT-OSS's.

0.19.1rc1's runner computes its slot mapping with a Triton kernel the simulator does not run: its tokens through the
real engine are open (docs/simulator.md, "What vLLM's real engine needs").
"""

import os
from pathlib import Path

import pytest
from conftest import ROW
from packaging.version import Version

from gptoss_patch import matrix
from gptoss_patch.testing import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"


@pytest.mark.expensive(30)
def test_native_full_decode_only_is_refused_at_startup():
    assert ROW.caps["attention_graph"].state == matrix.REFUSED  # every native cell row (0.15.0rc1 ... 0.19.1rc1)
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=4, startup_timeout=600)
    assert not report.started and not report.exchanges
    log = report.log_text
    assert "refusing to build a GPT-OSS model on vllm-ascend" in log, report.log_tail
    assert "attention_graph" in log and "PIECEWISE" in log, report.log_tail
    engine = [p for p in report.processes if p["name"].startswith("EngineCore")]
    assert engine and all(p["decision"] == ROW.verdict for p in engine), report.processes


if not matrix.native_attention(ROW):  # layouts H and G: our attention runs the sink and sliding layers
    @pytest.mark.expensive(100)
    def test_main_job_tokens_equal_transformers_with_the_patch_and_not_without():
        """The main job (PIECEWISE, tensor parallel 2: two worker processes of vLLM's multiprocessing executor, each
        holding gpt-oss-120b's per-rank shapes at TP 8) through this release's real engine: every exchange's greedy
        tokens and log-probabilities equal transformers' with the patches, and the first GPT-OSS forwards on both ranks
        took our attention path (and, on layout G, our MoE activation path), with the all-reduces captured into each
        rank's graphs; without the patches (TP 1, eager) the server answers no request.
        """
        report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=8, startup_timeout=600,
                               checkpoint_format="bf16-tp2", tensor_parallel_size=2)
        serve_job.print_report(report)
        assert report.started, report.log_tail
        assert all(p["decision"] == "apply" for p in report.processes), report.processes
        ranks = {u["pid"] for u in report.first_use if "Worker" in u["process"]}
        assert len(ranks) == 2, report.first_use
        for pid in ranks:
            used = {(u["capability"], u["path"]) for u in report.first_use if u["pid"] == pid}
            assert ("attention", "patched") in used, report.first_use
            assert (("moe", "patched") in used) == (ROW.layout == "G"), report.first_use
        assert any("PIECEWISE" in k for k in report.graph_captures), report.graph_captures
        # per forward the embedding's all-reduce and, in each of the 4 layers, the attention output's and the MoE's (9),
        # once per capture size (1, 2, 4): as in the patched cells (tests/cell/test_serve.py)
        assert report.hccl_tasks == {pid: 9 * 3 for pid in ranks}, report.hccl_tasks
        assert len(report.exchanges) == 6 and all(len(e.generated) == 8 for e in report.exchanges)
        for e in report.exchanges:
            assert e.generated == e.reference and e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, \
                (e.label, e.generated, e.reference, e.max_logprob_diff)
        assert report.verify_ok and report.ok

        bare = serve_job.run(WORKDIR, mode="eager", max_tokens=8, startup_timeout=600,
                             extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
        print("--- the same job without gptoss-patch:")
        serve_job.print_report(bare)
        assert bare.started and not bare.exchanges and bare.request_error, bare.request_error
        # the simulated operator refuses what upstream hands it in the first prefill: the swa_mask (0.15.0rc1 -
        # 0.18.0), and before it, from 0.17.0rc1 on, a non-contiguous value in a PrefillNoCache batch (docs/upstream.md
        # §4.4). The four requests arrive together, so the first batch the scheduler forms decides which one the
        # server meets first from 0.17.0rc1 on (both seen on 0.18.0); before 0.17.0rc1 the value is contiguous.
        mask = "npu_fused_infer_attention_score_v2: atten_mask for sparse_mode=4 must be the lower-triangular template"
        value = "npu_fused_infer_attention_score_v2: value must be contiguous"
        if ROW.version >= Version("0.17.0rc1"):
            assert value in bare.log_text or mask in bare.log_text, bare.log_tail
        else:
            assert mask in bare.log_text and value not in bare.log_text, bare.log_tail
