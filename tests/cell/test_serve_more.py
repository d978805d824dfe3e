"""More ``vllm serve`` runs, in the 0.11.0 cell only (noxfile.py ``CELLS``: one server start costs about a minute of
CI; these exercise code that is the same on every patched layout - the guard, the MXFP4 loading patches - which the
other cells' tests cover without a server):

* the unpatched server (``GPTOSS_PATCH_DISABLE=1``) is stopped at start-up by the guard;
* let through anyway (``GPTOSS_PATCH_ALLOW_UNPATCHED=1``) it answers with other tokens: what the patches are for;
* the tiny model in the official MXFP4 layout is dequantized while loading and answers with transformers' tokens;
* tensor parallel 2 with FULL_DECODE_ONLY graphs and workers started by ``fork`` (the other start method).
"""

from test_serve import WORKDIR, _checks

from gptoss_patch.testing import serve_job


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


def test_unpatched_vllm_serve_answers_with_other_tokens():
    """The same server with the patches off and the guard overridden gives tokens that differ from transformers."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=12,
                           extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
    serve_job.print_report(report)
    assert report.started, report.log_tail
    assert all(p["decision"] != "apply" for p in report.processes), report.processes
    assert report.exchanges and not any(e.ok for e in report.exchanges)


def test_vllm_serve_official_mxfp4_checkpoint():
    """The tiny model in the official MXFP4 layout: the patched server dequantizes the experts while loading and
    answers with the tokens of transformers' run of the same checkpoint (dequantized by transformers' own code)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="mxfp4")
    _checks(report, "PIECEWISE")


def test_vllm_serve_tensor_parallel_2_full_decode_only_fork():
    """TP 2, FULL_DECODE_ONLY (the decode graph is captured eagerly: ``torch.distributed.all_reduce`` on the ``hccl``
    group is what the capture records), workers forked: tokens equal transformers'."""
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"})
    _checks(report, "FULL_DECODE_ONLY", tensor_parallel_size=2, forked=True)
