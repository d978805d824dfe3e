"""``vllm serve`` on a natively supporting release, through vLLM's real engine and vllm-ascend's real NPUWorker on the
simulated NPU.

* FULL_DECODE_ONLY: upstream's graph path drops the sinks up to 0.19.1rc1 (vllm-ascend PR #9165). Our call is
  captured and updated instead - by our forward on layouts H and G (0.15.0rc1 - 0.18.0), by
  ``attention_graph.capture_sinks`` in upstream's ``full_graph_fia`` on layout I (0.19.1rc1): served at TP 2, the tokens
  equal transformers' (and on 0.15.0rc1, unpatched, they do not).
* Layouts H and G (0.15.0rc1 - 0.18.0): the main job (PIECEWISE, tensor parallel 2) answers with transformers'
  tokens with the patches. Without them (``GPTOSS_PATCH_DISABLE=1`` + ``GPTOSS_PATCH_ALLOW_UNPATCHED=1``) the first
  prefill would hand the simulated operator what its documentation excludes - upstream's ``swa_mask`` with sparse_mode
  4 (the device accepts it and computes something undocumented: docs/upstream.md §4.4); served with the documented
  template there instead (upstream's later fix, PR #8387, as a test fault: :mod:`gptoss_patch_testkit.faults`), the
  unpatched release answers other tokens than transformers' - on layout H those of the 129-key band.
* Layout I (0.19.1rc1): upstream's own attention with GPT-OSS's sliding layers built with pre_tokens 127
  (``attention.band_128_keys``): the main job answers with transformers' tokens. Without the patch the same job answers
  exactly the tokens of transformers with a 129-key window - the release's documented band - and not GPT-OSS's 128
  (calibration through the real engine; its slot-mapping Triton kernel is emulated, docs/simulator.md).
"""

import os
from pathlib import Path

import pytest
from conftest import ROW

from gptoss_patch import matrix
from gptoss_patch_testkit import faults
from gptoss_patch_testkit.jobs import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"


def _patched_tp2_checks(report: serve_job.ServeReport, capture_kind: str) -> None:
    """What every patched TP 2 run of this file shows: both workers built GPT-OSS with the layout's patches in force,
    took our attention path where our forward runs (layouts H, G) and our MoE activation path on G, captured
    ``capture_kind`` graphs holding their all-reduces (per forward the embedding's and, in each of the 4 layers, the
    attention output's and the MoE's: 9, once per capture size 1, 2, 4, as in tests/cell/test_serve.py), and answered
    every exchange with transformers' greedy tokens and log-probabilities."""
    serve_job.print_report(report)
    assert report.started, report.log_tail
    assert all(p["decision"] == "apply" for p in report.processes), report.processes
    workers = {p["pid"] for p in report.processes if "Worker" in p["name"]}
    assert len(workers) == 2 and set(report.built) >= workers, (report.processes, report.built)
    for pid in workers:
        assert set(matrix.LAYOUT_PATCHES[ROW.layout]) <= set(report.built[pid]), report.built
        used = {(u["capability"], u["path"]) for u in report.first_use if u["pid"] == pid}
        assert (("attention", "patched") in used) == (not matrix.native_attention(ROW)), report.first_use
        assert (("moe", "patched") in used) == (ROW.layout == "G"), report.first_use
    assert any(capture_kind in k and n == 3 for k, n in report.graph_captures.items()), report.graph_captures
    assert report.hccl_tasks == {pid: 9 * 3 for pid in workers}, report.hccl_tasks
    assert len(report.exchanges) == 6 and all(len(e.generated) == 8 for e in report.exchanges)
    for e in report.exchanges:
        assert e.generated == e.reference and e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, \
            (e.label, e.generated, e.reference, e.max_logprob_diff)


@pytest.mark.expensive(70)
def test_full_decode_only_tensor_parallel_2_tokens_equal_transformers():
    """FULL_DECODE_ONLY ACL graphs at tensor parallel 2 (issue 30: upstream's capture drops the sinks and the window
    up to PR #9165): every decode step of every exchange replays a captured graph whose GPT-OSS attention is our
    call - captured by our forward (layouts H, G) or, where upstream's forward runs (layout I), by
    ``attention_graph.capture_sinks`` in its ``full_graph_fia`` - re-issued with the step's lengths by
    ``attention_graph.update_graph_params``; the greedy tokens and
    log-probabilities equal transformers', and both ranks' graphs hold their all-reduces. Without the patches:
    the next test (0.15.0rc1)."""
    # layouts H, G, I: our call is captured, attention_graph.update_graph_params re-issues it every step
    assert ROW.caps["attention_graph"].state == matrix.PATCHED
    report = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=8, startup_timeout=600,
                           checkpoint_format="bf16-tp2", tensor_parallel_size=2, verify_server=False)
    _patched_tp2_checks(report, "FULL")
    assert "attention_graph.update_graph_params" in matrix.LAYOUT_PATCHES[ROW.layout]
    # the decode steps were answered from replayed NPU graphs
    assert report.npu_graphs.get("captures", 0) >= 3 and report.npu_graphs.get("replays", 0) >= 4, \
        report.npu_graphs


@pytest.mark.expensive(70)
def test_main_job_tokens_equal_transformers_with_the_patch():
    """The main job (PIECEWISE, tensor parallel 2: two worker processes of vLLM's multiprocessing executor, each
    holding gpt-oss-120b's per-rank shapes at TP 8) through this release's real engine: every exchange's greedy
    tokens and log-probabilities equal transformers' with the patches, with the all-reduces captured into each rank's
    graphs. On layouts H and G the first GPT-OSS forwards on both ranks took our attention path (and, on G, our MoE
    activation path); on layout I both ranks built GPT-OSS with ``attention.band_128_keys`` and upstream's forward
    ran. Without the patches: the next test.
    """
    report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=8, startup_timeout=600,
                           checkpoint_format="bf16-tp2", tensor_parallel_size=2)
    _patched_tp2_checks(report, "PIECEWISE")
    assert report.verify_ok and report.ok


if not matrix.native_attention(ROW):  # layouts H and G: our attention runs the sink and sliding layers
    @pytest.mark.expensive(40)
    def test_main_job_without_the_patch_answers_other_tokens():
        """The same job without the patches (TP 1, eager). Upstream hands the fused operator its band-shaped swa_mask
        with sparse_mode 4, which the operator's documentation excludes and the simulator refuses
        (test_native_attention.py). Given the causal template there instead - the one substitution upstream's PR #8387
        made (:mod:`gptoss_patch_testkit.faults`) - the unpatched release answers, and its tokens are not GPT-OSS's: on
        layout H they are transformers' with the 129-key band (as 0.19.1rc1's), on layout G (0.17.0rc1, 0.18.0) the
        MoE activation bug changes them further."""
        bare = serve_job.run(WORKDIR, mode="eager", max_tokens=8, startup_timeout=600,
                             extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1",
                                        **faults.env("swa_mask_as_template")}, verify_server=False)
        print("--- the same job without gptoss-patch, upstream's swa_mask replaced by the template:")
        serve_job.print_report(bare)
        assert bare.started and not bare.first_use, (bare.log_tail, bare.first_use)
        assert faults.TEMPLATE_LINE in bare.log_text, bare.log_tail
        assert len(bare.exchanges) == 6 and all(len(e.generated) == 8 for e in bare.exchanges), bare.request_error
        differ = [e.label for e in bare.exchanges if e.generated != e.reference]
        print(f"unpatched: {len(differ)} of 6 exchanges with other tokens than transformers': {differ}")
        assert len(differ) >= 3, [(e.label, e.generated, e.reference) for e in bare.exchanges]
        band = serve_job.greedy_under(Path(bare.command[4]), bare.exchanges, serve_job.sliding_window(129))
        # layout H: exactly the 129-key band; layout G: not even that (upstream's MoE takes the wrong activation)
        assert ([e.generated for e in bare.exchanges] == band) == (ROW.layout == "H"), band

if ROW.vllm_ascend == "0.15.0rc1":  # the negative control once: a server start per cell would cost CI minutes
    @pytest.mark.expensive(60)
    def test_full_decode_only_without_the_patch_loses_the_sinks():
        """The job above (at tensor parallel 1: the capture is per rank) without gptoss-patch (``GPTOSS_PATCH_DISABLE=1``
        + ``GPTOSS_PATCH_ALLOW_UNPATCHED=1``, and the
        template fault so that the prefill runs: see the eager test above). Upstream captures its decode attention with
        ``full_graph_fia`` - FIA v1, ``sparse_mode 3``, no sinks, no window (docs/upstream.md §4.2) - so the replayed
        decode steps compute another attention than the eager path of the same release: the tokens are neither
        transformers' nor those of the release's own eager band (transformers with 129 keys, which the eager run
        above equals on this layout)."""
        bare = serve_job.run(WORKDIR, mode="FULL_DECODE_ONLY", max_tokens=8, startup_timeout=600, verify_server=False,
                             extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1",
                                        **faults.env("swa_mask_as_template")})
        print("--- the same job without gptoss-patch:")
        serve_job.print_report(bare)
        assert bare.started and not bare.first_use, (bare.log_tail, bare.first_use)
        assert any("FULL" in k for k in bare.graph_captures), bare.graph_captures
        assert len(bare.exchanges) == 6 and all(len(e.generated) == 8 for e in bare.exchanges), bare.request_error
        differ = [e.label for e in bare.exchanges if e.generated != e.reference]
        band = serve_job.greedy_under(Path(bare.command[4]), bare.exchanges, serve_job.sliding_window(129))
        not_band = [e.label for e, b in zip(bare.exchanges, band) if e.generated != b]
        print(f"unpatched FULL_DECODE_ONLY: {len(differ)} of 6 differ from transformers, {len(not_band)} of 6 from the "
              f"release's eager 129-key band: {not_band}")
        assert len(differ) >= 3 and not_band, [(e.label, e.generated, e.reference) for e in bare.exchanges]


if matrix.native_attention(ROW):  # layout I: upstream's own attention serves GPT-OSS, unpatched with its band
    @pytest.mark.expensive(70)
    def test_main_job_without_the_patch_serves_transformers_with_the_documented_129_key_band():
        """Calibration through the real engine, and what layout I's patch changes: the main job (PIECEWISE; at tensor
        parallel 1, where the patched run above is at 2 - the band is per layer, not per rank) without gptoss-patch (``GPTOSS_PATCH_DISABLE=1`` +
        ``GPTOSS_PATCH_ALLOW_UNPATCHED=1``). This release runs GPT-OSS natively (validated on hardware upstream); its
        sliding layers take the fused operator's ``sparse_mode 4`` band of ``pre_tokens + 1`` = 129 keys
        (docs/upstream.md §4.3). Every exchange's greedy tokens equal transformers' float32 GPT-OSS with
        ``sliding_window: 129``, and the served log-probabilities are within LOGPROB_TOLERANCE of that model; from
        GPT-OSS's own 128-key window they are far (every prompt is longer than 128 tokens) - where the patched run
        (the test above) equals it.

        Upstream's ``BlockTable.compute_slot_mapping`` launches vLLM's Triton kernel ``_compute_slot_mapping_kernel``:
        the simulator emulates it (:mod:`gptoss_patch_testkit.npu_sim.triton_kernels`).
        """
        report = serve_job.run(WORKDIR, mode="PIECEWISE", max_tokens=8, startup_timeout=600, verify_server=False,
                               extra_env={"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"})
        print("--- the same job without gptoss-patch:")
        serve_job.print_report(report)
        assert report.started, report.log_tail
        assert report.processes and all(p["decision"] == "disabled" for p in report.processes), report.processes
        assert not report.first_use, report.first_use  # nothing of ours runs: upstream's attention and MoE
        assert not any(p for patches in report.built.values() for p in patches if p.startswith("attention.")), \
            report.built
        assert any("PIECEWISE" in k for k in report.graph_captures), report.graph_captures
        assert len(report.exchanges) == 6 and all(len(e.generated) == 8 for e in report.exchanges)
        checkpoint = Path(report.command[4])  # [python, -m, vllm.entrypoints.cli.main, serve, CHECKPOINT, ...]
        band = serve_job.greedy_under(checkpoint, report.exchanges, serve_job.sliding_window(129))
        assert [e.generated for e in report.exchanges] == band
        at_129 = serve_job.logprob_diff_under(checkpoint, report.exchanges, serve_job.sliding_window(129))
        at_128 = serve_job.logprob_diff_under(checkpoint, report.exchanges, serve_job.sliding_window(128))
        print(f"max |served logprob - transformers|: sliding_window 129 {at_129:.1e}, 128 {at_128:.2e}")
        assert at_129 <= serve_job.LOGPROB_TOLERANCE < at_128 / 10, (at_129, at_128)
        assert [e.generated for e in report.exchanges] != [e.reference for e in report.exchanges]
