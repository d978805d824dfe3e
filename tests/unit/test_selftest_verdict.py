"""The self-test's verdict: a case family the row requires and that ran no case fails it (issue 32: the self-test passed
with zero attention cases when the installed torch_npu offered no operator path)."""

import types

from gptoss_patch.selftest import REQUIRED_NATIVE, REQUIRED_PATCHED, CaseResult, SelfTest, _no_path_reason


def _case(name: str, ok: bool = True) -> CaseResult:
    return CaseResult(name, 0.0 if ok else 1.0, 0.5, ok)


def test_a_required_family_without_a_case_fails_the_self_test_naming_it():
    some = [_case("moe/swigluoai_biases/120b_tp8_rank/padded_368"), _case("yarn/cos_sin_cache/truncate_false")]
    st = SelfTest("npu", "row", cases=some, required=REQUIRED_PATCHED)
    assert st.missing == ["attention", "graph"]
    assert not st.ok
    assert st.failed == ["attention (no case ran)", "graph (no case ran)"]
    assert st.lines()[-1].startswith("self-test FAILED: attention (no case ran), graph (no case ran)")
    d = st.as_dict()
    assert d["ok"] is False and d["missing"] == ["attention", "graph"] and d["required"] == list(REQUIRED_PATCHED)


def test_every_required_family_run_and_passed_passes():
    every = [_case("attention/v2/decode_127_128_129/sliding"), _case("graph/v2/full_decode_only/capture_replay_update"),
             _case("moe/swigluoai_biases/120b_tp8_rank/padded_368"), _case("yarn/cos_sin_cache/truncate_false")]
    assert SelfTest("npu", "row", cases=every, required=REQUIRED_PATCHED).ok
    native = [_case("attention/native/decode/sliding"), _case("moe/swigluoai_biases/native_model_layer0_inter360")]
    assert SelfTest("npu", "row", cases=native, required=REQUIRED_NATIVE).ok
    assert not SelfTest("npu", "row", cases=native[:1], required=REQUIRED_NATIVE).ok
    assert not SelfTest("npu", "row", cases=[*native[:1], _case("moe/x", ok=False)], required=REQUIRED_NATIVE).ok


def test_a_torch_npu_without_a_sink_operator_is_named_as_the_reason():
    reason = _no_path_reason(types.SimpleNamespace())  # neither fused-attention operator
    assert "npu_fused_infer_attention_score_v2(learnable_sink=...)" in reason
    assert "softmax_lse_flag" in reason
