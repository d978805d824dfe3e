"""MoE calibration: vllm-ascend 0.15.0rc1's native unquantised GPT-OSS MoE on the simulator vs transformers.

The layer is built and loaded the way vLLM does it: :func:`gptoss_patch.testing.native_015.load_native_model`
runs vLLM's ``get_model`` on a tiny GPT-OSS checkpoint (written by transformers' own classes), so the MoE is
vLLM's ``MLPBlock`` whose ``FusedMoE`` became vllm-ascend's ``AscendFusedMoE`` (``register_ascend_customop``),
loaded through ``GptOssModel._load_weights_other`` and ``AscendUnquantizedFusedMoEMethod.
process_weights_after_loading``. The forward is upstream's: ``AscendFusedMoE.forward_impl`` ->
``AscendUnquantizedFusedMoEMethod.apply`` (``select_experts``) -> ``AllGatherCommImpl.fused_experts`` ->
``unified_apply_mlp`` -> ``unquant_apply_mlp(w1_bias, w2_bias, activation="swigluoai")`` with
``npu_grouped_matmul`` (float32 biases), ``AscendSwigluOAIAndMul.swiglu_oai_forward`` (vLLM's interleaved,
clamped ``SwigluOAIAndMul.forward_native``) and the token dispatcher's routing/unpermute operators
(upstream_targets.md §7.2). The oracle is transformers' ``GptOssMLP`` from
``GptOssForCausalLM.from_pretrained`` on the same checkpoint.

Geometry (preset "tiny": gpt-oss-120b's per-rank expert shapes at TP=8): hidden 64, 8 experts, top-4,
intermediate 360 (``w13_weight`` ``[8, 64, 720]``, ``w2_weight`` ``[8, 360, 64]`` after processing), 4 layers;
float32 model dtype; inputs ``[T, 64]``.
"""

import pytest
import torch

from gptoss_patch.testing import native_015 as n015


@pytest.fixture(scope="module")
def models():
    from transformers import GptOssForCausalLM

    cfg, ckpt = n015.vllm_context()
    native = n015.load_native_model(cfg)
    hf = GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return native, hf


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
        assert experts.activation == "swigluoai" and experts.moe_config.has_bias
        assert tuple(experts.w13_weight.shape) == (8, 64, 720) and tuple(experts.w2_weight.shape) == (8, 360, 64)
        assert tuple(experts.w13_bias.shape) == (8, 720) and tuple(experts.w2_bias.shape) == (8, 64)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_native_moe_matches_transformers_float32(models, mlp_calls, layer, tokens):
    """``MLPBlock.forward`` of vllm-ascend 0.15.0rc1 == transformers ``GptOssMLP`` (float32 relative error
    ``||got - want|| / ||want|| <= 1e-4``).

    Inputs are N(0, 9) so that the gate/up pre-activations cross both clamps (``gate <= 7``,
    ``-7 <= up <= 7``) of GPT-OSS's activation; the test checks that they did and that the native path took the
    bias + swigluoai branch of ``unquant_apply_mlp`` with the layer's own biases. Calibration result: the
    simulated ``npu_grouped_matmul`` (float32 bias added per expert), routing (``moe_gating_top_k`` with
    renormalisation, ``npu_moe_init_routing_custom``) and ``npu_moe_token_unpermute`` agree with transformers to
    ~1e-7 relative - no discrepancy to explain.
    """
    native, hf = models
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(100 * layer + tokens)) * 3
    got = n015.run_native_moe(native, layer, x)
    with torch.no_grad():
        want, _ = hf.model.layers[layer].mlp(x.unsqueeze(0))
    want = want[0]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-4, f"relative error {rel}"
    experts = native.model.model.layers[layer].mlp.experts
    assert len(mlp_calls["mlp"]) == 1
    kw = mlp_calls["mlp"][0]
    assert kw["activation"] == "swigluoai"
    assert kw["w1_bias"] is experts.w13_bias and kw["w2_bias"] is experts.w2_bias
    gate_up = torch.cat(mlp_calls["act_in"])
    assert gate_up.shape[-1] == 720
    if tokens >= 5:  # enough rows that the clamps are reached (checked, not assumed)
        assert gate_up[:, ::2].max() > 7 and gate_up[:, 1::2].min() < -7 and gate_up[:, 1::2].max() > 7
