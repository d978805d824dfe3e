"""gptoss_patch.kernels.moe against scalar references and transformers' GPT-OSS MoE (float32).

Expected values come from independent code: scalar ``math`` loops written here, and transformers 4.57.1
``GptOssTopKRouter`` / ``GptOssExperts`` / ``GptOssMLP`` with random weights.
"""

from __future__ import annotations

import math

import pytest
import torch


from hypothesis import given, settings, strategies as st  # noqa: E402

from gptoss_patch.kernels.moe import experts_forward, route_gptoss, swigluoai  # noqa: E402

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
GptOssConfig = pytest.importorskip("transformers").GptOssConfig


# --------------------------------------------------------------------------------------------- scalar references


def scalar_swigluoai(values: list[float], alpha: float = 1.702, limit: float = 7.0) -> list[float]:
    out = []
    for i in range(0, len(values), 2):
        gate = min(values[i], limit)
        up = max(min(values[i + 1], limit), -limit)
        out.append((up + 1.0) * gate / (1.0 + math.exp(-alpha * gate)))
    return out


def test_swigluoai_matches_scalar_formula_including_clamps():
    # pairs (gate, up): inside the clamp, gate above +7, gate very negative (not clamped), up beyond +-7
    row = [0.5, -0.25, 9.0, 1.0, -12.0, 2.0, 1.5, 8.0, -3.0, -11.0, 7.0, -7.0]
    x = torch.tensor([row, [v * -0.5 for v in row]], dtype=torch.float64)
    got = swigluoai(x)
    want = torch.tensor([scalar_swigluoai(r) for r in x.tolist()], dtype=torch.float64)
    assert got.shape == (2, 6)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=24).filter(lambda v: len(v) % 2 == 0),
       st.floats(0.5, 3.0), st.floats(1.0, 10.0))
def test_swigluoai_matches_scalar_formula_hypothesis(values, alpha, limit):
    got = swigluoai(torch.tensor(values, dtype=torch.float64), alpha=alpha, limit=limit)
    want = torch.tensor(scalar_swigluoai(values, alpha, limit), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_swigluoai_is_not_halves_swiglu():
    # the unpatched vllm-ascend path uses first-half/second-half SwiGLU; the interleaved formula must differ
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, b = x.chunk(2, dim=-1)
    assert not torch.allclose(swigluoai(x), a * torch.sigmoid(a) * b)


def test_swigluoai_rejects_odd_width():
    with pytest.raises(ValueError):
        swigluoai(torch.zeros(2, 5))


# --------------------------------------------------------------------------------------------- routing


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 16), st.data())
def test_route_equals_softmax_then_topk_then_renormalise(tokens, experts, data):
    """topk(logits) -> softmax  ==  softmax(all) -> topk -> divide by the selected sum.

    Proof: softmax is monotone, so both pick the same ids; for the selected set S,
    exp(l_i) / sum_{j in S} exp(l_j) = (exp(l_i)/Z) / sum_{j in S}(exp(l_j)/Z) for the full normaliser Z.
    """
    k = data.draw(st.integers(1, experts))
    seed = data.draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(tokens, experts, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 4
    weights, ids = route_gptoss(logits, k)

    probs = torch.softmax(logits, dim=-1)
    want_ids = []
    want_w = []
    for t in range(tokens):  # explicit selection loop, no torch.topk
        remaining = list(range(experts))
        chosen = []
        for _ in range(k):
            best = max(remaining, key=lambda e: (probs[t, e].item(), -e))
            chosen.append(best)
            remaining.remove(best)
        total = sum(probs[t, e].item() for e in chosen)
        want_ids.append(chosen)
        want_w.append([probs[t, e].item() / total for e in chosen])
    assert ids.tolist() == want_ids
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, dtype=torch.float64))


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError):
        route_gptoss(torch.zeros(2, 3, 4), 1)
    with pytest.raises(ValueError):
        route_gptoss(torch.zeros(2, 3), 4)


# --------------------------------------------------------------------------------------------- transformers


def tiny_config(**kw):
    base = dict(hidden_size=16, intermediate_size=8, num_local_experts=6, num_experts_per_tok=2,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32)
    base.update(kw)
    return GptOssConfig(**base)


def randomise(module: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_route_matches_transformers_router():
    cfg = tiny_config()
    router = gpt_oss.GptOssTopKRouter(cfg)
    randomise(router, 1)
    h = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    scores, idx = router(h)
    logits = torch.nn.functional.linear(h, router.weight, router.bias)
    weights, ids = route_gptoss(logits, cfg.num_experts_per_tok)
    assert torch.equal(ids, idx)
    torch.testing.assert_close(torch.zeros_like(logits).scatter_(1, ids, weights), scores)


def test_experts_forward_matches_transformers_experts():
    cfg = tiny_config()
    experts = gpt_oss.GptOssExperts(cfg)
    randomise(experts, 3, scale=1.5)
    router = gpt_oss.GptOssTopKRouter(cfg)
    randomise(router, 4)
    h = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
    scores, idx = router(h)
    want = experts(h.unsqueeze(0), router_indices=idx, routing_weights=scores).squeeze(0)
    # the clamps must be exercised for this comparison to cover them
    gate_up = torch.einsum("th,ehn->etn", h, experts.gate_up_proj) + experts.gate_up_proj_bias[:, None, :]
    assert bool((gate_up[..., 0::2] > 7).any()) and bool((gate_up[..., 1::2].abs() > 7).any())
    got = experts_forward(h, scores.gather(1, idx), idx, experts.gate_up_proj, experts.gate_up_proj_bias,
                          experts.down_proj, experts.down_proj_bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_router_plus_experts_match_transformers_mlp():
    cfg = tiny_config(num_local_experts=8, num_experts_per_tok=3)
    mlp = gpt_oss.GptOssMLP(cfg)
    randomise(mlp, 6)
    h = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    want, _ = mlp(h)
    flat = h.reshape(-1, cfg.hidden_size)
    logits = torch.nn.functional.linear(flat, mlp.router.weight, mlp.router.bias)
    weights, ids = route_gptoss(logits, cfg.num_experts_per_tok)
    got = experts_forward(flat, weights, ids, mlp.experts.gate_up_proj, mlp.experts.gate_up_proj_bias,
                          mlp.experts.down_proj, mlp.experts.down_proj_bias)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-4)


def test_experts_forward_without_biases_and_shape_checks():
    g = torch.Generator().manual_seed(8)
    h = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w13 = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    w2 = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0], [1], [1]])
    w = torch.tensor([[0.5], [1.0], [2.0]], dtype=torch.float64)
    got = experts_forward(h, w, ids, w13, None, w2, None)
    want = torch.stack([w[t, 0] * (torch.tensor(scalar_swigluoai((h[t] @ w13[ids[t, 0]]).tolist()),
                                                dtype=torch.float64) @ w2[ids[t, 0]]) for t in range(3)])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError):
        experts_forward(h, w, ids, w13, None, w2[:, :2], None)


# ------------------------------------------------------------------------------------------- patch plumbing (no wheels)


def test_apply_mlp_wrappers_bind_each_release_signature(monkeypatch):
    """``_apply_mlp_011`` / ``_apply_mlp_012`` map 0.11.x ``(hidden_states, w1, w1_scale, w2, w2_scale, group_list,
    ...)`` and 0.12.0rc1+ ``(hidden_states, w1, w2, group_list, w1_scale=None, ...)`` to the same expert MLP call, given
    positionally as upstream's signature orders them; without GPT-OSS extras upstream runs with the arguments as
    passed."""
    import gptoss_patch.kernels.moe as K
    from gptoss_patch.patches import moe as M

    seen = []
    monkeypatch.setattr(K, "grouped_expert_mlp", lambda *a, **k: seen.append((a, k)) or "ours")
    h, w1, w2, gl, b1, b2, ts = (object() for _ in range(7))

    def upstream(*args, **kwargs):
        return ("upstream", args, kwargs)

    want = ((h, w1, w2, gl), {"group_list_type": 0, "activation": "swigluoai", "w1_bias": b1, "w2_bias": b2,
                              "topk_scales": ts, "need_trans": False})
    with M._scope(M.MoEExtras("swigluoai", b1, b2)):
        assert M._apply_mlp_011(upstream, None, (h, w1, None, w2, None, gl, None, 0), {"topk_scales": ts,
                                                                                     "need_trans": False}) == "ours"
        assert seen.pop() == want
        assert M._apply_mlp_012(upstream, None, (h, w1, w2, gl, None, None, None, 0), {"topk_scales": ts,
                                                                                     "need_trans": False}) == "ours"
        assert seen.pop() == want
        with pytest.raises(NotImplementedError, match="quantised"):
            M._apply_mlp_012(upstream, None, (h, w1, w2, gl), {"w1_scale": [1], "w2_scale": [1], "with_quant": True})
    args = (h, w1, w2, gl)
    assert M._apply_mlp_012(upstream, None, args, {"group_list_type": 1}) == ("upstream", args, {"group_list_type": 1})
    with pytest.raises(TypeError):  # a keyword the 0.12 signature does not have is an error, as upstream's own
        with M._scope(M.MoEExtras("swigluoai")):
            M._apply_mlp_012(upstream, None, args, {"w1_scale_offset": 1})
    assert not seen


def test_check_comm_method_refuses_only_overriding_methods_for_gptoss():
    """A communication method whose class overrides the base's ``fused_experts`` (0.12.0rc1 FusedAlltoAll, 0.13.0+
    FusedMC2: fused kernels without bias/activation) is refused for swigluoai or biased calls; inheriting methods and
    plain silu calls pass."""
    from gptoss_patch.patches.moe import MoEExtras, check_comm_method

    class MoECommMethod:
        def fused_experts(self):
            return "base"

    class AllGatherCommImpl(MoECommMethod):
        pass

    class FusedMC2CommImpl(MoECommMethod):
        def fused_experts(self):
            return "fused kernel"

    for extras in (MoEExtras("swigluoai"), MoEExtras("silu", torch.zeros(1), None)):
        check_comm_method(AllGatherCommImpl(), extras)
        check_comm_method(None, extras)
        with pytest.raises(NotImplementedError, match="FusedMC2CommImpl.*fused kernel.*MoECommMethod.fused_experts"):
            check_comm_method(FusedMC2CommImpl(), extras)
    check_comm_method(FusedMC2CommImpl(), MoEExtras("silu"))  # not GPT-OSS: upstream's business
