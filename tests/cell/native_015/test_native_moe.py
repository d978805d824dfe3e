"""MoE calibration: vllm-ascend's native unquantised GPT-OSS MoE on the simulator vs transformers, per native cell.

The layer is built and loaded the way vLLM does it: :func:`gptoss_patch.selftest.native.load_native_model`
runs vLLM's ``get_model`` on a tiny GPT-OSS checkpoint (written by transformers' own classes), so the MoE is
vLLM's ``MLPBlock`` whose ``FusedMoE`` became vllm-ascend's ``AscendFusedMoE`` (``register_ascend_customop``),
loaded through ``GptOssModel._load_weights_other`` and ``AscendUnquantizedFusedMoEMethod.
process_weights_after_loading``. The forward is upstream's: ``AscendFusedMoE.forward_impl`` ->
``AscendUnquantizedFusedMoEMethod.apply`` (``select_experts``) -> the comm method's ``fused_experts`` ->
``unified_apply_mlp`` -> ``unquant_apply_mlp(w1_bias, w2_bias, activation=...)`` with ``npu_grouped_matmul``
(float32 biases), ``AscendSwigluOAIAndMul.swiglu_oai_forward`` (vLLM's interleaved, clamped
``SwigluOAIAndMul.forward_native``) and the token dispatcher's routing/unpermute operators (docs/upstream.md
§3). The oracle is transformers' ``GptOssMLP`` from ``GptOssForCausalLM.from_pretrained`` on the same checkpoint.

The activation per release (read from the wheels): vLLM 0.15/0.16 hand ``FusedMoE.activation`` on as the string
``"swigluoai"``; vLLM >= 0.17 as the Enum ``MoEActivation.SWIGLUOAI`` (not a ``str`` subclass). vllm-ascend up to
0.18.0 compares ``activation == "swigluoai"`` in ``moe_mlp.unquant_apply_mlp`` - False for the Enum, so the experts
run ``npu_swiglu`` (plain SwiGLU: no clamp, no ``alpha``, no ``+1``, halves instead of interleaved) - and
0.19.1rc1 compares ``getattr(activation, "value", activation)`` (PR #8465). Hence the matrix's MoE verdicts: native on 0.15.0rc1, 0.16.0rc1
(layout H patches only their attention) and 0.19.1rc1; patched on 0.17.0rc1 and 0.18.0 (layout G's
``moe.activation_name``). The last test runs the MoE in
a child interpreter with ``GPTOSS_PATCH_DISABLE=1`` to show what upstream alone computes in each cell.

Geometry (preset "tiny": gpt-oss-120b's per-rank expert shapes at TP=8): hidden 64, 8 experts, top-4,
intermediate 360 (``w13_weight`` ``[8, 64, 720]``, ``w2_weight`` ``[8, 360, 64]`` after processing), 4 layers;
float32 model dtype; inputs ``[T, 64]``.
"""

import json

import pytest
import torch
from conftest import ROW, run_python

from gptoss_patch import matrix
from gptoss_patch.selftest import native as n015

#: The cell row's MoE verdict: ``patched`` on layout G (0.17.0rc1, 0.18.0), ``native`` on the others.
MOE_PATCHED = ROW.caps["moe"].state == matrix.PATCHED


@pytest.fixture(scope="module")
def models():
    cfg, ckpt = n015.vllm_context()
    native = n015.load_native_model(cfg)
    return native, n015.load_reference_model(ckpt)


@pytest.fixture
def mlp_calls(monkeypatch):
    """Records ``unquant_apply_mlp``'s keyword arguments and the input of the swigluoai activation.

    ``unified_apply_mlp`` looks ``unquant_apply_mlp`` up in its module's globals at call time, and
    ``unquant_apply_mlp`` calls ``AscendSwigluOAIAndMul.swiglu_oai_forward`` through the class, so both can be
    wrapped in place."""
    import vllm_ascend.ops.fused_moe.moe_mlp as moe_mlp

    calls = {"mlp": [], "act_in": []}
    real_mlp = moe_mlp.unquant_apply_mlp
    real_act = moe_mlp.AscendSwigluOAIAndMul.swiglu_oai_forward

    def mlp_spy(*args, **kwargs):
        calls["mlp"].append(kwargs)
        return real_mlp(*args, **kwargs)

    def act_spy(x, *args, **kwargs):
        calls["act_in"].append(x.detach().clone())
        return real_act(x, *args, **kwargs)

    monkeypatch.setattr(moe_mlp, "unquant_apply_mlp", mlp_spy)
    monkeypatch.setattr(moe_mlp.AscendSwigluOAIAndMul, "swiglu_oai_forward", act_spy)
    return calls


def test_layers_are_vllm_ascends_native_moe(models):
    native, _ = models
    for layer in native.model.model.layers:
        experts = layer.mlp.experts
        assert type(experts).__name__ == "AscendFusedMoE"
        assert type(experts.quant_method).__name__ == "AscendUnquantizedFusedMoEMethod"
        assert _name(experts.activation) == "swigluoai" and experts.moe_config.has_bias
        assert tuple(experts.w13_weight.shape) == (8, 64, 720) and tuple(experts.w2_weight.shape) == (8, 360, 64)
        assert tuple(experts.w13_bias.shape) == (8, 720) and tuple(experts.w2_bias.shape) == (8, 64)


def _name(activation):
    """The activation's string: vLLM >= 0.17's ``MoEActivation`` member's ``.value``, else the string itself."""
    return getattr(activation, "value", activation)


def test_activation_type_and_patch_state_match_the_row(models):
    """What vLLM hands the experts and what gptoss-patch did about it, against the matrix row: an Enum with the
    ``moe.activation_name`` patch applied on ``unquant_apply_mlp`` (layout G), a string or an Enum that upstream
    handles with no MoE patch (0.15.0rc1, 0.16.0rc1 / 0.19.1rc1; layout H patches only the attention)."""
    import enum

    import wrapt

    import gptoss_patch
    import vllm_ascend.ops.fused_moe.moe_mlp as moe_mlp

    native, _ = models
    activation = native.model.model.layers[0].mlp.experts.activation
    from vllm import __version__ as vllm_version

    from packaging.version import Version

    is_enum = isinstance(activation, enum.Enum)
    assert is_enum == (Version(vllm_version) >= Version("0.17"))
    assert isinstance(activation, str) != is_enum  # a plain string, or an Enum that is no str: != "swigluoai"
    assert (activation == "swigluoai") != is_enum
    status = gptoss_patch.status()
    wrapped = isinstance(moe_mlp.unquant_apply_mlp, wrapt.FunctionWrapper)
    moe = [p for p in status.patches if p.name.startswith("moe.")]
    if MOE_PATCHED:
        assert [(p.name, p.state) for p in moe] == [("moe.activation_name", "applied")]
        assert moe[0].target == "vllm_ascend.ops.fused_moe.moe_mlp:unquant_apply_mlp" and wrapped
        assert any(g.startswith("moe: patched") for g in status.gaps)
    else:
        assert moe == [] and not wrapped
        assert not any(g.startswith("moe:") for g in status.gaps)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_native_moe_matches_transformers_float32(models, mlp_calls, layer, tokens):
    """``MLPBlock.forward`` of the cell's vllm-ascend (with layout G's patch where the row applies it) ==
    transformers ``GptOssMLP`` (float32 relative error
    ``||got - want|| / ||want|| <= 1e-4``).

    Inputs are N(0, 9) so that the gate/up pre-activations cross both clamps (``gate <= 7``,
    ``-7 <= up <= 7``) of GPT-OSS's activation; the test checks that they did and that the native path took the
    bias + swigluoai branch of ``unquant_apply_mlp`` with the layer's own biases. Calibration result: the
    simulated ``npu_grouped_matmul`` (float32 bias added per expert), routing (``moe_gating_top_k`` with
    renormalisation, ``npu_moe_init_routing_custom``) and ``npu_moe_token_unpermute`` agree with transformers to
    ~1e-7 relative - no discrepancy to explain.
    """
    native, hf = models
    rel = n015.moe_relative_error(native, hf, layer, n015.moe_input(layer, tokens))
    print(f"cell {ROW.vllm_ascend} layer {layer} tokens {tokens}: relative error {rel:.2e}")
    assert rel <= 1e-4, f"relative error {rel}"
    experts = native.model.model.layers[layer].mlp.experts
    assert len(mlp_calls["mlp"]) == 1
    kw = mlp_calls["mlp"][0]
    assert _name(kw["activation"]) == "swigluoai"  # the Enum on vLLM >= 0.17 (the spy sits outside our wrapper)
    assert kw["w1_bias"] is experts.w13_bias and kw["w2_bias"] is experts.w2_bias
    gate_up = torch.cat(mlp_calls["act_in"])
    assert gate_up.shape[-1] == 720
    if tokens >= 5:  # enough rows that the clamps are reached (checked, not assumed)
        assert gate_up[:, ::2].max() > 7 and gate_up[:, 1::2].min() < -7 and gate_up[:, 1::2].max() > 7



UNPATCHED_CHILD = """
import json, sys
import torch
import wrapt
import gptoss_patch
from gptoss_patch.selftest import native as n015
cfg, ckpt = n015.vllm_context()
native = n015.load_native_model(cfg)
hf = n015.load_reference_model(ckpt)
import vllm_ascend.ops.fused_moe.moe_mlp as moe_mlp
calls = {"swiglu_oai_forward": 0, "npu_swiglu": 0}
real_oai = moe_mlp.AscendSwigluOAIAndMul.swiglu_oai_forward
real_swiglu = moe_mlp.torch_npu.npu_swiglu
def oai(*a, **k):
    calls["swiglu_oai_forward"] += 1
    return real_oai(*a, **k)
def swiglu(*a, **k):
    calls["npu_swiglu"] += 1
    return real_swiglu(*a, **k)
moe_mlp.AscendSwigluOAIAndMul.swiglu_oai_forward = oai
moe_mlp.torch_npu.npu_swiglu = swiglu
errors = {f"{layer}-{tokens}": n015.moe_relative_error(native, hf, layer, n015.moe_input(layer, tokens))
          for layer in range(4) for tokens in (5, 64)}
st = gptoss_patch.status()
print("MOE-RESULT " + json.dumps({"decision": st.decision, "patches": [p.name for p in st.patches],
                                  "wrapped": isinstance(moe_mlp.unquant_apply_mlp, wrapt.FunctionWrapper),
                                  "errors": errors, "calls": calls}))
"""


def test_moe_without_gptoss_patch_matches_the_matrix_verdict():
    """Upstream alone, in a fresh interpreter with ``GPTOSS_PATCH_DISABLE=1`` (nothing patched) and
    ``GPTOSS_PATCH_ALLOW_UNPATCHED=1`` (the guard lets the model load): the same 4 layers x (5, 64) tokens as above.

    * layout G (0.17.0rc1, 0.18.0; the matrix says ``moe: patched``): every case DIFFERS from transformers by more
      than 10 % relative (plain SwiGLU instead of swigluoai; measured 2.1-2.4 in both cells), and the experts took
      ``npu_swiglu``, never ``swiglu_oai_forward`` - so the in-process equality above is the patch's doing.
    * the other rows (0.15.0rc1, 0.16.0rc1: layout H; 0.19.1rc1: stand-down; ``moe: native``): every case EQUALS transformers
      (<= 1e-4) with nothing patched, through ``swiglu_oai_forward``.
    """
    proc = run_python(UNPATCHED_CHILD, GPTOSS_PATCH_DISABLE="1", GPTOSS_PATCH_ALLOW_UNPATCHED="1")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MOE-RESULT ")), None)
    assert line is not None, f"child gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    res = json.loads(line[len("MOE-RESULT "):])
    print(f"cell {ROW.vllm_ascend} without gptoss-patch: relative errors {res['errors']}, calls {res['calls']}")
    assert res["decision"] == "disabled" and res["patches"] == [] and res["wrapped"] is False
    errors = res["errors"]
    assert len(errors) == 8
    if MOE_PATCHED:
        assert min(errors.values()) > 0.1, errors
        assert res["calls"]["swiglu_oai_forward"] == 0 and res["calls"]["npu_swiglu"] == 8
    else:
        assert max(errors.values()) <= 1e-4, errors
        assert res["calls"]["swiglu_oai_forward"] == 8 and res["calls"]["npu_swiglu"] == 0
