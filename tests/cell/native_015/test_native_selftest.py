"""``verify --selftest`` in a native calibration cell (0.15.0rc1, 0.16.0rc1, 0.17.0rc1, 0.18.0, 0.19.1rc1): the cases
build their metadata with the release's own builder and run the release's attention ``forward`` - upstream's own GPT-OSS
attention with layout I's band (``attention.band_128_keys``) on 0.19.1rc1, our ``attention.sink_window_forward_impl`` on
layouts H and G (0.15.0rc1 - 0.18.0; what ``forward`` calls there, test_native_attention.py asserts which) - and the MoE
of the tiny model vLLM loads (with layout G's patch where the row applies it) in bf16 against transformers in float32.
The sliding layers are checked against GPT-OSS's 128 keys on every row (a row whose band *deviated* would be checked
against the window-129 reference of its documented band, docs/operators.md; none does since issue 30). An injected
operator deviation (``GPTOSS_PATCH_SIM_FAULT``) makes it exit 1 naming the cases: a band one key wider fails exactly the
sliding cases, so the self-test tells 128 keys from 129 on the user's device."""

import pytest

from conftest import ROW, check_selftest_without_torch_npu, run_selftest, selftest_with_query_on_host

from gptoss_patch import matrix, selftest

#: Layouts H and G: our attention runs the sliding layers (window 128); I: upstream's, built with GPT-OSS's band.
PATCHED = ROW.caps["attention"].state == matrix.PATCHED
ATTENTION = {f"attention/native/{label}/{kind}" for label, _ in selftest.NATIVE_ATTENTION
             for kind in ("sliding", "full")}
SLIDING = {c for c in ATTENTION if c.endswith("/sliding")}
MOE = "moe/swigluoai_biases/native_model_layer0_inter360"
CASES = ATTENTION | {MOE}


@pytest.fixture(scope="module")
def clean_run():
    return run_selftest()


def test_selftest_passes_on_the_rows_attention(clean_run):
    proc, report = clean_run
    st = report["selftest"]
    assert proc.returncode == 0, (report["problems"], st["failed"])
    assert {c["case"] for c in st["cases"]} == CASES
    for c in st["cases"]:
        assert c["ok"] and c["error"] is None, c
        assert not c["skipped"] and 0 <= c["max_error"] <= c["tolerance"], c
        if c["case"] in ATTENTION:
            assert c["tolerance"] == selftest.ATTENTION_TOL, c
        if c["case"] in SLIDING:
            assert ("reference window 129" in c["note"]) == (not PATCHED), c
    moe = next(c for c in st["cases"] if c["case"] == MOE)
    assert 2 ** -8 < moe["tolerance"] < 2 ** -4 and "transformers-bf16" in moe["note"], moe
    assert any("YaRN of a native row" in n for n in st["not_covered"])


def test_injected_dropped_sink_fails_every_case_that_runs():
    proc, report = run_selftest("drop_sink")
    assert proc.returncode == 1
    assert set(report["selftest"]["failed"]) == ATTENTION  # the MoE case does not use the attention operator
    assert "attention/native/decode_127_128_129_130/full" in report["problems"][-1]


def test_injected_wider_band_fails_the_sliding_cases():
    """The band one key wider (129 keys where our patched call keeps 128; 130 where upstream's documented band has
    129): the sliding cases fail (each holds a query at position >= 129), the full ones pass."""
    proc, report = run_selftest("band129")
    assert proc.returncode == 1
    assert set(report["selftest"]["failed"]) == SLIDING


def test_a_query_left_in_host_memory_fails_every_attention_case_naming_the_operator_argument():
    """The placement audit (npu_sim/placement.py) on the release's own attention path: the query left on the host by
    the harness fails every attention case at the fused attention operator's ``query``; the MoE case passes."""
    st = selftest_with_query_on_host()
    assert set(st["failed"]) == ATTENTION
    for c in st["cases"]:
        if c["case"] in ATTENTION:
            assert c["error"].startswith("PlacementError: torch_npu.npu_fused_infer_attention_score"), c
            assert ": query (" in c["error"] and "is in host memory" in c["error"], c


def test_selftest_without_torch_npu_fails_naming_the_fix_and_still_writes_the_report(tmp_path):
    """As in the patched cells: no ``torch_npu`` to import, ``verify --selftest --report`` exits 1 with the hint as a
    failed ``bring-up`` line (the native harness's vLLM bring-up asks for torch_npu first) and writes the report."""
    check_selftest_without_torch_npu(tmp_path / "report.md")
