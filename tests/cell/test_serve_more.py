"""More ``vllm serve`` runs, in the 0.11.0 cell only (noxfile.py ``CELLS``: one server start costs about a minute of
CI; these exercise code that is the same on every patched layout - the guard, the MXFP4 loading patches - which the
other cells' tests cover without a server):

* the unpatched server (``GPTOSS_PATCH_DISABLE=1``) is stopped at start-up by the guard;
* let through anyway (``GPTOSS_PATCH_ALLOW_UNPATCHED=1``) it answers with other tokens: what the patches are for;
* the tiny model in the official MXFP4 layout is dequantized while loading and answers with transformers' tokens;
* tensor parallel 2 with FULL_DECODE_ONLY graphs and workers started by ``fork`` (the other start method);
* expert parallel 2, which vLLM 0.11.0 loads only through ``checkpoint.ep_expert_range`` (and not at all without it).
"""

import pytest
from test_serve import WORKDIR, _checks

from gptoss_patch.testing import serve_job


@pytest.mark.expensive(25)
def test_unpatched_vllm_serve_is_stopped_by_the_guard_at_startup(tmp_path):
    """GPTOSS_PATCH_DISABLE=1: the engine core refuses to build the GPT-OSS model, with the guard's message; the server
    never answers /health."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=4, startup_timeout=600,
                           extra_env={"GPTOSS_PATCH_DISABLE": "1"})
    assert not report.started and not report.exchanges
    log = report.log_text
    assert "refusing to build a GPT-OSS model on vllm-ascend" in log, report.log_tail
    assert "GptOssNotPatchedError" in log
    assert "GPTOSS_PATCH_DISABLE" in log  # what to do


@pytest.mark.expensive(35)
def test_unpatched_vllm_serve_answers_with_other_tokens():
    """The same server with the patches off and the guard overridden gives tokens that differ from transformers."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=12,
                           extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
    serve_job.print_report(report)
    assert report.started, report.log_tail
    assert all(p["decision"] != "apply" for p in report.processes), report.processes
    assert report.exchanges and not any(e.ok for e in report.exchanges)


@pytest.mark.expensive(40)
def test_vllm_serve_official_mxfp4_checkpoint():
    """The tiny model in the official MXFP4 layout: the patched server dequantizes the experts while loading and
    answers with the tokens of transformers' run of the same checkpoint (dequantized by transformers' own code)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="mxfp4")
    _checks(report, "PIECEWISE")


@pytest.mark.expensive(60)
def test_vllm_serve_tensor_parallel_2_full_decode_only_fork():
    """TP 2, FULL_DECODE_ONLY (the decode graph is captured eagerly: ``torch.distributed.all_reduce`` on the ``hccl``
    group is what the capture records), workers forked: tokens equal transformers'."""
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"})
    _checks(report, "FULL_DECODE_ONLY", tensor_parallel_size=2, forked=True)


@pytest.mark.expensive(70)
def test_vllm_serve_expert_parallel_2():
    """``--tensor-parallel-size 2 --enable-expert-parallel`` (EP 2; vllm-ascend's AllGather dispatcher, which it selects
    without MC2 at this world size): vLLM 0.11.0 loads each rank's experts through ``checkpoint.ep_expert_range`` and
    the server answers with transformers' tokens.

    vllm-ascend's AllGather dispatcher multiplies rows of the grouped matmul's output that the operator never wrote by
    probability 0; the simulator's NaN for such memory would turn that into NaN logits, the device's leftover (finite)
    contents into 0. The run uses the finite setting (docs/simulator.md §7)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_args=["--enable-expert-parallel"],
                           extra_env={"GPTOSS_PATCH_SIM_UNINITIALISED": "finite"})
    _checks(report, "PIECEWISE", tensor_parallel_size=2)
    assert "Expert parallelism is enabled" in report.log_text  # vLLM's own line: EP really was on
    assert "expert-parallel weight range passed reversed" in report.log_text  # the patch did the loading


@pytest.mark.expensive(40)
def test_unpatched_expert_parallel_does_not_load():
    """The same EP 2 server with every patch off (guard overridden): vLLM 0.11.0's loader slices every expert tensor
    empty and the engine stops at start-up - the defect ``checkpoint.ep_expert_range`` fixes."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=4, checkpoint_format="bf16-tp2", tensor_parallel_size=2,
                           extra_args=["--enable-expert-parallel"], startup_timeout=600,
                           extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
    assert not report.started and not report.exchanges
    assert "must match the size of tensor b (0)" in report.log_text, report.log_tail
