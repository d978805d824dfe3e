"""``verify --selftest`` in a patched cell (layouts B, C, E, F): every case runs through the patched vllm-ascend code
and meets its stated tolerance against transformers; an operator deviation injected into the simulator
(``GPTOSS_PATCH_SIM_FAULT``: the 129-key band of ``sparse_mode 4``, a dropped ``learnable_sink``) makes it exit 1 and
name exactly the cases that deviation breaks (gptoss_patch/selftest/__init__.py states the cases and tolerances)."""

import pytest

from conftest import REPORT_SECRETS, check_selftest_without_torch_npu, run_selftest, selftest_with_query_on_host

from gptoss_patch import selftest

#: Every case a patched row runs: attention per operator path (the simulated torch_npu offers both), state and layer
#: kind, the FULL_DECODE_ONLY graph per path, the two MoE shapes, the YaRN cache.
EXPECTED = {f"attention/{path}/{label}/{kind}" for path in ("v2", "lse")
            for label, *_ in selftest.PATCHED_ATTENTION for kind in ("sliding", "full")}
EXPECTED |= {f"graph/{path}/full_decode_only/capture_replay_update" for path in ("v2", "lse")}
EXPECTED |= {"moe/swigluoai_biases/120b_tp8_rank/unpadded_360_nd", "moe/swigluoai_biases/120b_tp8_rank/padded_368",
             "yarn/cos_sin_cache/truncate_false"}


def test_verify_simulate_selftest_passes_every_case(verify_simulate):
    proc, report = verify_simulate  # conftest: the one `testkit verify --selftest --json` run of the session
    st = report["selftest"]
    assert proc.returncode == 0, (report["problems"], st["failed"])
    assert {c["case"] for c in st["cases"]} == EXPECTED
    for c in st["cases"]:
        assert c["ok"] and not c["skipped"] and c["error"] is None, c
        assert 0 <= c["max_error"] <= c["tolerance"], c
    tol = {c["case"]: c["tolerance"] for c in st["cases"]}
    assert tol["attention/v2/decode_127_128_129/sliding"] == 3 * 2 ** -8
    assert tol["yarn/cos_sin_cache/truncate_false"] == 1e-5
    assert st["ok"] and st["failed"] == [] and "simulator" in st["device"]


def test_selftest_human_lines_name_case_error_and_tolerance(verify_simulate):
    _, report = verify_simulate
    st = report["selftest"]
    obj = selftest.SelfTest(st["device"], st["rows"], [selftest.CaseResult(**c) for c in st["cases"]],
                            st["not_covered"], st["seconds"])
    lines = obj.lines()
    row = next(line for line in lines if line.startswith("attention/lse/prefix_hit/full "))
    case = next(c for c in st["cases"] if c["case"] == "attention/lse/prefix_hit/full")
    assert f"{case['max_error']:.2e}" in row and f"{case['tolerance']:.2e}" in row and "PASS" in row
    assert lines[-1].startswith("self-test passed")


@pytest.mark.expensive(15)
def test_a_query_left_in_host_memory_fails_every_attention_case_naming_the_operator_argument():
    """The placement audit the cases run under on the simulator (npu_sim/placement.py): the attention harness made to
    leave ``query`` on the host fails every attention case with the fused attention operator and ``query`` named - what
    an Ascend host would refuse -, while the graph, MoE and YaRN cases (other harnesses) pass. The clean run above
    passes under the same audit, so every tensor the cases hand the NPU is placed there."""
    st = selftest_with_query_on_host()
    attention = {c for c in EXPECTED if c.startswith("attention/")}
    assert set(st["failed"]) == attention and not st["ok"]
    for c in st["cases"]:
        if c["case"] in attention:
            op = "npu_fused_infer_attention_score_v2" if "/v2/" in c["case"] else "npu_fused_infer_attention_score"
            assert c["error"].startswith(f"PlacementError: torch_npu.{op}: query ("), c
            assert "is in host memory" in c["error"] and c["max_error"] is None, c


@pytest.mark.expensive(20)
def test_injected_129_key_band_fails_the_sliding_cases():
    """A ``sparse_mode 4`` band one key wider than documented: every sliding-window case on both paths fails (they
    all hold a query at position >= 128 whose window then reaches key 0), the full-attention cases still pass."""
    proc, report = run_selftest("band129")
    assert proc.returncode == 1
    failed = set(report["selftest"]["failed"])
    sliding = {c for c in EXPECTED if c.startswith("attention/") and c.endswith("/sliding")}
    assert failed == sliding
    assert any(p.startswith("self-test failed:") and "attention/v2/decode_127_128_129/sliding" in p
               for p in report["problems"])


@pytest.mark.expensive(20)
def test_injected_dropped_sink_fails_the_v2_cases_and_the_report_says_so(tmp_path, cell):
    """``learnable_sink`` ignored by the operator: every eager attention case of the v2 path fails; the LSE path,
    which applies the sink itself (``out * sigmoid(lse - sink)``), passes (and the graph cases compare graph with
    eager, which drop the sink alike). The ``--report`` file of that run (``--no-children``: the children's rows are
    checked on the shared run's report below) shows the failing rows and says NOT OK."""
    path = tmp_path / "report.md"
    proc, report = run_selftest("drop_sink", "--report", str(path))
    assert proc.returncode == 1
    assert set(report["selftest"]["failed"]) == {c for c in EXPECTED if c.startswith("attention/v2/")}
    assert "attention/v2/prefill_127_128_129/full" in report["problems"][-1]
    text = path.read_text()
    assert f"| vllm-ascend | {cell} |" in text and "`apply` - " in text and "Result: **NOT OK**" in text
    for c in report["selftest"]["cases"]:
        verdict = "PASS" if c["ok"] else "FAIL"
        assert f"| {c['case']} | {c['max_error']:.3e} | {c['tolerance']:.3e} | {verdict} |" in text, c["case"]
    assert "| fresh interpreter / spawn / forkserver | - | - | - | not checked (--no-children) |" in text
    assert "| GPTOSS_PATCH_SIM_FAULT | `drop_sink` |" in text
    assert "- self-test failed: attention/v2/" in text


def test_the_report_of_the_shared_run_shows_the_stack_and_no_secrets(verify_simulate, verify_simulate_md, cell):
    """The ``--report`` file of the shared ``testkit verify --selftest`` run (conftest ``_verify_simulate_run``,
    with an API key and a hub token in its environment), read back: versions, decision, patches with drift, the
    self-test table, activation per process kind (this process and its three children), the environment without
    secrets."""
    _, report = verify_simulate
    text = verify_simulate_md
    assert f"| vllm-ascend | {cell} |" in text and "`apply` - " in text and "Result: **OK**" in text
    for p in report["status"]["patches"]:
        assert f"| {p['name']} | applied | {p['target']} | {p['drift']} |" in text
    for c in report["selftest"]["cases"]:
        assert f"| {c['case']} | {c['max_error']:.3e} | {c['tolerance']:.3e} | PASS |" in text, c["case"]
    for label in ("this process (verify)", "fresh interpreter", "spawn", "forkserver"):
        assert f"| {label} | apply |" in text, label
    assert "| forkserver | apply | import-hook |" in text
    assert "| VLLM_WORKER_MULTIPROC_METHOD | `spawn` |" in text and "GPTOSS_PATCH_SIM_FAULT" not in text
    assert "| VLLM_API_KEY | `(set; value not shown)` |" in text
    assert REPORT_SECRETS["VLLM_API_KEY"] not in text and REPORT_SECRETS["HF_TOKEN"] not in text
    assert "HF_TOKEN" not in text


def test_selftest_without_torch_npu_fails_naming_the_fix_and_still_writes_the_report(tmp_path):
    """No ``torch_npu`` to import (an Ascend host whose CANN environment was not sourced): ``verify --selftest
    --report`` exits 1 with the hint as a failed ``bring-up`` line and writes the report - no traceback."""
    check_selftest_without_torch_npu(tmp_path / "report.md")
