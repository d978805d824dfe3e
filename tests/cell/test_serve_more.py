"""More ``vllm serve`` runs, in the 0.11.0 cell only (noxfile.py ``CELLS``: one server start costs about a minute of
CI; these exercise code that is the same on every patched layout - the guard, the loader, the executors - which the
other cells' tests cover without a server; the served MXFP4 layout is tests/cell/test_mxfp4.py's, in every cell):

* the unpatched server (``GPTOSS_PATCH_DISABLE=1``) is stopped at start-up by the guard;
* let through anyway (``GPTOSS_PATCH_ALLOW_UNPATCHED=1``) it answers the trained harmony model's task wrong where
  transformers answers it right: what the patches are for;
* the expert ``down_proj`` bias kept on both tensor-parallel ranks (a test fault in the served loader) answers far
  from the reference, exactly as transformers with the bias doubled;
* tensor parallel 2 with FULL_DECODE_ONLY graphs and workers started by ``fork`` (the other start method), and
  through vLLM's Ray executor (a local Ray head);
* expert parallel 2, which vLLM 0.11.0 loads only through ``checkpoint_bf16.ep_expert_range`` (and not at all without it),
  on the simulated Atlas A2 (AllGather) and Atlas A3 (MC2 for decode, All2All for prefill).
"""

from pathlib import Path

import pytest
from test_serve import WORKDIR, _checks, scale_down_bias

from gptoss_patch_testkit import faults
from gptoss_patch_testkit.jobs import api_job, serve_job


def _every_token_matches(report: serve_job.ServeReport) -> None:
    """All six exchanges equal transformers' tokens and log-probabilities."""
    assert len(report.exchanges) == 6
    for e in report.exchanges:
        assert e.ok, (e.label, e.generated, e.reference, e.max_logprob_diff)


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


@pytest.mark.expensive(45)
def test_unpatched_vllm_serve_answers_the_task_wrong():
    """The same server with the patches off and the guard overridden, serving the trained harmony model
    (:mod:`gptoss_patch_testkit.jobs.api_job`): transformers answers every held-out item right, the unpatched server
    (sinks dropped, the window wrong, plain SwiGLU, no expert biases) almost none, and no answer has transformers'
    tokens. The patched server's answers: tests/cell/test_api.py (all right, every token equal)."""
    report = api_job.run(WORKDIR, "eager", 12, extra_env=api_job.UNPATCHED_ENV, checks=False)
    api_job.print_report(report)
    assert report.started, report.log_tail
    assert "on the patched path" not in report.log_text  # no GPT-OSS forward went through gptoss-patch's code
    assert report.accuracy("reference") == 1.0
    assert report.accuracy("server") <= 0.25 and report.accuracy("chat") <= 0.25, (report.accuracy("server"),
                                                                                    report.accuracy("chat"))
    assert not any(r.tokens_equal for r in report.items)


@pytest.mark.expensive(60)
def test_down_proj_bias_added_on_both_ranks_answers_wrong():
    """The double add, run for real: vLLM's loader keeps the expert ``down_proj`` bias whole on both tensor-parallel
    ranks (fault ``down_proj_bias_every_rank``: upstream's rank-0 rule removed, :mod:`gptoss_patch_testkit.faults`), so
    each rank's grouped matmul adds it and the MoE all-reduce sums it twice. The served log-probabilities leave the
    reference by far more than ``LOGPROB_TOLERANCE`` - the check tests/cell/test_serve.py's TP 2 run passes - and are
    those of transformers with the bias doubled: the check fails for the reason it is named after."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_env=faults.env("down_proj_bias_every_rank"),
                           verify_server=False)
    assert report.started, report.log_tail
    ran = sorted(line[line.index(" on TP rank"):] for line in report.log_text.splitlines() if faults.LINE in line)
    assert ran == [f" on TP rank {r}: 4 w2_bias tensors kept whole" for r in (0, 1)], ran  # 4 layers, both ranks
    assert len(report.exchanges) == 6 and all(e.generated for e in report.exchanges), report.exchanges
    served = max(e.max_logprob_diff for e in report.exchanges)
    doubled = serve_job.logprob_diff_under(Path(report.command[4]), report.exchanges, scale_down_bias(2.0))
    print(f"bias on both ranks, served: max |logprob - reference| {served:.2e}, - transformers with the bias doubled "
          f"{doubled:.1e}")
    assert served > 10 * serve_job.LOGPROB_TOLERANCE, served
    assert doubled <= serve_job.LOGPROB_TOLERANCE, doubled


@pytest.mark.expensive(60)
def test_vllm_serve_tensor_parallel_2_full_decode_only_fork():
    """TP 2, FULL_DECODE_ONLY (the decode graph is captured eagerly: ``torch.distributed.all_reduce`` on the ``hccl``
    group is what the capture records), workers forked: tokens equal transformers'."""
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"},
                           verify_server=False)
    _checks(report, "FULL_DECODE_ONLY", tensor_parallel_size=2, forked=True)


@pytest.mark.expensive(70)
def test_vllm_serve_expert_parallel_2():
    """``--tensor-parallel-size 2 --enable-expert-parallel`` (EP 2; vllm-ascend's AllGather dispatcher, which it selects
    without MC2 at this world size): vLLM 0.11.0 loads each rank's experts through ``checkpoint_bf16.ep_expert_range`` and
    the server answers with transformers' tokens.

    vllm-ascend's AllGather dispatcher multiplies rows of the grouped matmul's output that the operator never wrote by
    probability 0; the simulator's NaN for such memory would turn that into NaN logits, the device's leftover (finite)
    contents into 0. The run uses the finite setting (docs/simulator.md §7)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_args=["--enable-expert-parallel"],
                           extra_env={"GPTOSS_PATCH_SIM_UNINITIALISED": "finite"}, verify_server=False)
    _checks(report, "PIECEWISE", tensor_parallel_size=2)
    assert "Expert parallelism is enabled" in report.log_text  # vLLM's own line: EP really was on
    assert "expert-parallel weight range passed reversed" in report.log_text  # the patch did the loading
    # the MoE communication each rank used, from the simulator's operator log: AllGather's dispatch
    # (TokenDispatcherWithAllGather: npu_moe_init_routing_v2) on both ranks, neither MC2's nor All2All's operators
    workers = {u["pid"] for u in report.first_use if "Worker" in u["process"]}
    assert report.sim_ops.get("npu_moe_init_routing_v2") == workers, report.sim_ops
    assert not {"npu_moe_distribute_dispatch_v2", "npu_moe_token_permute"} & set(report.sim_ops), report.sim_ops


@pytest.mark.expensive(90)
def test_vllm_serve_expert_parallel_2_on_atlas_a3_mc2_and_all2all():
    """``--tensor-parallel-size 2 --enable-expert-parallel`` on a simulated Atlas A3
    (``GPTOSS_PATCH_SIM_SOC_VERSION=250``, Ascend910_9391). vllm-ascend 0.11.0 (``NPUModelRunner._select_moe_comm_method``) picks MC2 on A3 for batches
    within its MC2 capacity (the largest capture size, 4 tokens) and All2All above it: the decode steps run
    ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` (inside the replayed PIECEWISE graphs), the prefills
    vllm-ascend's All2All dispatcher. The model has hidden size 1024, the least the MC2 operators take on A3
    (docs/operators.md section 4.5); every rank holds 4 whole experts. Tokens equal transformers'. The server runs in
    float32, like every served test (exact comparison): MC2's operators take bf16/fp16 on the device, float32 only as the
    simulator's documented extension (``moe_distribute.ACCEPT_FLOAT32``)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="bf16-h1024",
                           tensor_parallel_size=2, extra_args=["--enable-expert-parallel"],
                           extra_env={"GPTOSS_PATCH_SIM_SOC_VERSION": "250"}, verify_server=False)
    serve_job.print_report(report)
    assert report.started, report.log_tail
    assert "Expert parallelism is enabled" in report.log_text
    workers = {u["pid"] for u in report.first_use if "Worker" in u["process"]}
    assert len(workers) == 2, report.first_use
    for op in ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "npu_moe_token_permute"):
        assert report.sim_ops.get(op) == workers, (op, report.sim_ops)  # MC2 and All2All ran on both ranks
    assert "npu_moe_init_routing_v2" not in report.sim_ops, report.sim_ops  # AllGather did not: A3 has no use for it
    assert report.npu_graphs.get("replays", 0) >= 4, report.npu_graphs
    _every_token_matches(report)


@pytest.mark.expensive(150)
def test_vllm_serve_tensor_parallel_2_ray():
    """``--distributed-executor-backend ray`` against a local Ray head (started and stopped here): the two ranks are
    Ray actors in Ray's own worker processes, started by the raylet - the patch reaches them through the ``.pth``
    hook, each logs its activation and its patched forwards, and the tokens equal transformers'. ``RAY_DEDUP_LOGS=0``:
    Ray would otherwise fold the ranks' identical log lines into one."""
    from gptoss_patch.tools import tokenizer

    env = serve_job.serve_env(tokenizer.prepare(WORKDIR / "vocab").env, RAY_DEDUP_LOGS="0")
    with serve_job.ray_head(env) as address:
        report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="bf16-tp2",
                               tensor_parallel_size=2, extra_args=["--distributed-executor-backend", "ray"],
                               extra_env={"RAY_ADDRESS": address, "RAY_DEDUP_LOGS": "0"}, verify_server=False)
    serve_job.print_report(report)
    assert report.started, report.log_tail
    assert "--distributed-executor-backend ray" in " ".join(report.command)
    actors = {p["pid"] for p in report.processes if p["name"] == "default_worker.py" and p["decision"] == "apply"}
    model_pids = {u["pid"] for u in report.first_use}
    assert len(model_pids) == 2 and model_pids <= actors, (report.processes, report.first_use)
    for pid in model_pids:  # Ray's worker processes ran the patched attention and MoE
        used = {(u["capability"], u["path"]) for u in report.first_use if u["pid"] == pid}
        assert {("attention", "patched"), ("moe", "patched")} <= used, (pid, report.first_use)
    assert report.hccl_tasks == {pid: 9 * 3 for pid in model_pids}, report.hccl_tasks  # as test_serve's TP 2
    _every_token_matches(report)


@pytest.mark.expensive(40)
def test_unpatched_expert_parallel_does_not_load():
    """The same EP 2 server with every patch off (guard overridden): vLLM 0.11.0's loader slices every expert tensor
    empty and the engine stops at start-up - the defect ``checkpoint_bf16.ep_expert_range`` fixes."""
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=4, checkpoint_format="bf16-tp2", tensor_parallel_size=2,
                           extra_args=["--enable-expert-parallel"], startup_timeout=600,
                           extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
    assert not report.started and not report.exchanges
    assert "must match the size of tensor b (0)" in report.log_text, report.log_tail
