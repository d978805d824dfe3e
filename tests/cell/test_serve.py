"""``vllm serve`` through vLLM's real engine and vllm-ascend's real NPUWorker on the simulated NPU (patched cells).

Each test starts the user's own command - ``vllm serve <tiny GPT-OSS>`` with PIECEWISE ACL graphs, with
FULL_DECODE_ONLY graphs, or eager - asks it over HTTP (harmony chat completions and raw completions: a prompt past the
128-token window, a prefix-cache hit, a chunked prefill) and compares every generated token, and its log-probability,
with transformers' ``GptOssForCausalLM`` in float32 (:mod:`gptoss_patch_testkit.jobs.serve_job`). The unpatched server
and the official MXFP4 layout: tests/cell/test_serve_more.py (the 0.11.0 cell).

At tensor parallel 2 (vLLM's multiprocessing executor, one worker process per rank, started with ``spawn`` as ``vllm
serve`` does) the model is the one whose every rank holds gpt-oss-120b's per-rank shapes at TP 8: 8 query heads, 1 KV
head, MoE intermediate 360; the all-reduces run over the simulated ``hccl`` groups and are captured into the graphs.
The expert ``down_proj`` bias is shown added exactly once across the ranks: transformers with the bias doubled (added
on both ranks) or zeroed (never added) is far from the served log-probabilities (``serve_job.logprob_diff_under``);
the double add itself, served, is tests/cell/test_serve_more.py's.
"""

import os
from pathlib import Path

import pytest
from conftest import ROW

from gptoss_patch import matrix
from gptoss_patch_testkit.jobs import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"

#: The capture each mode makes: vllm-ascend's runner logs "Capturing ACL graphs (<kind>)".
CAPTURE_KIND = {"PIECEWISE": "PIECEWISE", "FULL_DECODE_ONLY": "FULL", "eager": None}


def _checks(report: serve_job.ServeReport, mode: str, tensor_parallel_size: int = 1, forked: bool = False,
            verified: bool = False) -> None:
    """``verified``: the run included ``verify --server`` (``serve_job.run(verify_server=True)``), which must find
    nothing but the random model's problems - once per cell, on the main job (PIECEWISE, TP 1): the probe asks the
    API, the same on every configuration, and the trained model's server passes it outright (tests/cell/api_cases.py).
    ``forked``: the engine core and workers were forked (``VLLM_WORKER_MULTIPROC_METHOD=fork``), so they inherit the
    patched modules and log no activation line of their own; their first patched forwards show the patches active."""
    serve_job.print_report(report)
    assert report.started, f"vllm serve did not come up:\n{report.log_tail}"
    assert report.processes and all(p["decision"] == "apply" for p in report.processes), report.processes
    if not forked:  # the engine core is its own process, started fresh: the import hook activates there too
        assert any(p["name"].startswith("EngineCore") for p in report.processes), report.processes
    runner = "EngineCore" if tensor_parallel_size == 1 else "Worker"  # where the model runs: one process per rank
    model_pids = {u["pid"] for u in report.first_use if runner in u["process"]}
    assert len(model_pids) == tensor_parallel_size, report.first_use
    if not forked:
        assert model_pids <= {p["pid"] for p in report.processes}, (model_pids, report.processes)
    else:  # a forked worker inherits the parent's imported vllm_ascend: no import hook runs there, no activation line
        # (a spawned one imports vllm_ascend afresh and logs its own - the non-forked runs above)
        assert not model_pids & {p["pid"] for p in report.processes}, (model_pids, report.processes)
    for pid in model_pids:
        used = {(u["capability"], u["path"]) for u in report.first_use if u["pid"] == pid}
        assert {("attention", "patched"), ("moe", "patched")} <= used, (pid, report.first_use)
    # each process that ran the model said which patches were in force when it built GPT-OSS: the layout's, the guard
    assert set(report.built) == model_pids, (report.built, model_pids)
    for pid in model_pids:
        assert {*matrix.LAYOUT_PATCHES[ROW.layout], "guard.gpt_oss_model"} <= set(report.built[pid]), report.built
    kind = CAPTURE_KIND[mode]
    if kind is None:
        assert not report.graph_captures, report.graph_captures
    else:
        assert any(kind in k and n == 3 for k, n in report.graph_captures.items()), report.graph_captures
        # the requests were answered from replayed NPU graphs (PIECEWISE: every piece of every size is one graph)
        assert report.npu_graphs.get("captures", 0) >= 3 and report.npu_graphs.get("replays", 0) >= 4, \
            report.npu_graphs
        if tensor_parallel_size > 1:
            # every rank's graphs hold all its all-reduces: per forward the embedding's and, in each of the 4 layers,
            # the attention output's and the MoE's (9), once per capture size (1, 2, 4)
            assert report.hccl_tasks == {pid: 9 * 3 for pid in model_pids}, report.hccl_tasks
    assert len(report.exchanges) == 6 and {e.kind for e in report.exchanges} == {"chat", "completion"}
    for e in report.exchanges:
        assert e.generated == e.reference[:len(e.generated)] and len(e.generated) == 12, (e.label, e.generated,
                                                                                          e.reference)
        assert e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, (e.label, e.max_logprob_diff)
    if verified:
        assert report.verify_ok, (report.verify_server_exit, report.verify_server_problems)
        assert report.ok


def scale_down_bias(factor: float):
    """An edit for :func:`serve_job.logprob_diff_under`: every layer's expert ``down_proj`` bias times ``factor``."""
    def edit(model):
        for layer in model.model.layers:
            layer.mlp.experts.down_proj_bias.mul_(factor)
    return edit


#: The modes served here: all three in the 0.11.0 cell (the demo's); elsewhere eager is served by the MXFP4 test
#: (tests/cell/test_mxfp4.py, eager), which spares a server start per cell.
SERVED_MODES = tuple(m for m in serve_job.MODES if m != "eager" or ROW.vllm_ascend == "0.11.0")


@pytest.mark.expensive(50)
@pytest.mark.parametrize("mode", SERVED_MODES)
def test_vllm_serve_answers_with_transformers_tokens(mode):
    main_job = mode == "PIECEWISE"  # README command 1's configuration
    _checks(serve_job.run(WORKDIR, mode=mode, max_tokens=12, verify_server=main_job), mode, verified=main_job)


@pytest.mark.expensive(100)
def test_vllm_serve_tensor_parallel_2_piecewise():
    """``--tensor-parallel-size 2`` with PIECEWISE graphs: two worker processes (spawn), sinks / heads / experts split
    per rank, the row-parallel and MoE all-reduces inside the captured pieces; tokens equal transformers'.

    Each rank's MoE intermediate (360, gpt-oss-120b's at TP 8) is padded to 368 as on a release that casts the experts
    to FRACTAL_NZ (``GPTOSS_PATCH_MOE_PAD=always``: the served float32 model keeps ND weights on every patched release
    - 0.12.0rc1's NZ grouped matmul takes no float32, ``serve_job._float32_nz_off``), and both ranks
    say so in the server's output. The unpadded TP 2 path is served by tests/cell/test_serve_more.py (fork, EP, Ray)."""
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=12, checkpoint_format="bf16-tp2",
                           tensor_parallel_size=2, extra_env={"GPTOSS_PATCH_MOE_PAD": "always"},
                           verify_server=False)
    _checks(report, "PIECEWISE", tensor_parallel_size=2)
    padded = [line for line in report.log_text.splitlines()
              if "gptoss-patch: MoE intermediate size per rank 360 -> 368" in line]
    assert len(padded) == 2, padded  # one line per rank (the first padded layer of each worker)
    # The expert down_proj bias is added exactly once across the two ranks. vLLM's loader keeps it on rank 0 only
    # (``_load_weights_other`` zeroes it elsewhere) and our MoE adds each rank's copy before the all-reduce; added on
    # both ranks the sum would carry it twice, not added (vllm-ascend 0.11-0.14 unpatched) not at all. Both faults'
    # log-probabilities - transformers with the bias doubled / zeroed, teacher-forced on the served tokens - are far
    # from what the server answered, which is within LOGPROB_TOLERANCE of the reference (checked above).
    # The double add run for real (fault in the served loader): tests/cell/test_serve_more.py.
    checkpoint = Path(report.command[4])  # [python, -m, vllm.entrypoints.cli.main, serve, CHECKPOINT, ...]
    doubled = serve_job.logprob_diff_under(checkpoint, report.exchanges, scale_down_bias(2.0))
    dropped = serve_job.logprob_diff_under(checkpoint, report.exchanges, scale_down_bias(0.0))
    served = max(e.max_logprob_diff for e in report.exchanges)
    print(f"max |served logprob - model|: reference {served:.1e}, down_proj bias on both ranks {doubled:.2e}, "
          f"bias never added {dropped:.2e}")
    assert served <= serve_job.LOGPROB_TOLERANCE < min(doubled, dropped) / 10, (served, doubled, dropped)
