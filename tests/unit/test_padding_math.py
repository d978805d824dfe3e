"""Issue 5, the math: NZ alignment sizes, per-rank layouts, zero padding of the GPT-OSS expert weights, the decision.

Expected values are written out here (sizes read off the configs and the rule ``I % 16 == 0``), built independently
(``torch.cat`` with zeros), or computed by an in-order reference MoE MLP written in this file - plain elementwise
float32 accumulation over ``k`` in index order, no BLAS - so that "padding adds exactly zero" is checked bit for bit.
No upstream wheel is needed (torch only).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from gptoss_patch import matrix
from gptoss_patch.kernels import padding as P
from gptoss_patch.patches import nz_padding as W

# ------------------------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("n, want", [(360, 368), (368, 368), (180, 192), (90, 96), (2880, 2880), (1440, 1440),
                                     (720, 720), (1, 16), (16, 16), (17, 32), (0, 0)])
def test_aligned_size(n, want):
    assert P.aligned_size(n) == want
    assert P.padded_size(n) == (None if want == n else want)


def test_aligned_size_rejects_nonsense():
    with pytest.raises(ValueError):
        P.aligned_size(-1)
    with pytest.raises(ValueError):
        P.aligned_size(8, 0)


def test_nz_multiple_per_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.int8):
        assert P.nz_multiple(dtype) == 16
    with pytest.raises(ValueError, match="no FRACTAL_NZ alignment rule"):
        P.nz_multiple(torch.float32)


# gpt-oss-120b: 128 experts, hidden 2880, intermediate 2880 (transformers GptOssConfig defaults);
# gpt-oss-20b: 32 experts, same hidden / intermediate.
@pytest.mark.parametrize("experts, tp, dp, ep, want_experts, want_i, want_pad", [
    (128, 1, 1, False, 128, 2880, None),
    (128, 2, 1, False, 128, 1440, None),
    (128, 4, 1, False, 128, 720, None),
    (128, 8, 1, False, 128, 360, 368),
    (128, 16, 1, False, 128, 180, 192),
    (128, 4, 2, False, 128, 360, 368),   # vLLM flattens TP across DP for the MoE
    (128, 8, 1, True, 16, 2880, None),   # expert parallel: whole experts per rank
    (128, 16, 1, True, 8, 2880, None),
    (128, 1, 1, True, 128, 2880, None),  # one rank: vLLM turns EP off
    (32, 8, 1, False, 32, 360, 368),
    (32, 8, 1, True, 4, 2880, None),
])
def test_rank_layout(experts, tp, dp, ep, want_experts, want_i, want_pad):
    lay = P.moe_rank_layout(experts, 2880, 2880, tp, dp, ep)
    assert (lay.experts, lay.hidden, lay.intermediate, lay.padded) == (want_experts, 2880, want_i, want_pad)
    i = want_pad or want_i
    assert lay.shapes(padded=True) == {"w13_weight": (want_experts, 2 * i, 2880), "w13_bias": (want_experts, 2 * i),
                                       "w2_weight": (want_experts, 2880, i), "w2_bias": (want_experts, 2880)}


def test_rank_layout_bytes_120b_tp8():
    lay = P.moe_rank_layout(128, 2880, 2880, 8)
    before = P.expert_bytes(lay.shapes())
    after = P.expert_bytes(lay.shapes(padded=True))
    # 128 * (720*2880 + 720 + 2880*360 + 2880) * 2 bytes, and with 736 / 368
    assert before == 128 * (720 * 2880 + 720 + 2880 * 360 + 2880) * 2 == 797_184_000
    assert after == 128 * (736 * 2880 + 736 + 2880 * 368 + 2880) * 2 == 814_882_816


def test_rank_layout_errors():
    with pytest.raises(ValueError, match="not divisible"):
        P.moe_rank_layout(128, 2880, 2880, 7)
    with pytest.raises(ValueError, match="cannot be split"):
        P.moe_rank_layout(128, 2880, 2880, 3, expert_parallel=True)
    with pytest.raises(ValueError):
        P.moe_rank_layout(128, 2880, 2880, 0)


# ---------------------------------------------------------------------------------------------------- tensor padding


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pad_w13_appends_whole_zero_pairs(dtype):
    e, i, h, ip = 3, 10, 8, 16
    w13 = _rand(e, 2 * i, h, dtype=dtype)
    out = P.pad_w13(w13, ip)
    want = torch.cat([w13, torch.zeros(e, 2 * (ip - i), h, dtype=dtype)], dim=1)
    assert out.shape == (e, 2 * ip, h) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, want)
    # the pairing: gate j = row 2j, up j = row 2j+1, for every real j; pairs j >= I are (0, 0)
    assert torch.equal(out[:, 0::2][:, :i], w13[:, 0::2]) and torch.equal(out[:, 1::2][:, :i], w13[:, 1::2])
    assert not out[:, 0::2][:, i:].any() and not out[:, 1::2][:, i:].any()


def test_pad_bias_and_w2():
    e, i, h, ip = 2, 6, 5, 16
    b13, w2 = _rand(e, 2 * i, seed=1), _rand(e, h, i, seed=2)
    assert torch.equal(P.pad_w13_bias(b13, ip), torch.cat([b13, torch.zeros(e, 2 * (ip - i))], dim=1))
    assert torch.equal(P.pad_w2(w2, ip), torch.cat([w2, torch.zeros(e, h, ip - i)], dim=2))


def test_aligned_tensors_are_returned_as_is():
    w13, b13, w2 = _rand(2, 32, 4), _rand(2, 32), _rand(2, 4, 16)
    assert P.pad_w13(w13, 16) is w13 and P.pad_w13_bias(b13, 16) is b13 and P.pad_w2(w2, 16) is w2


def test_padding_never_truncates_or_guesses_layouts():
    with pytest.raises(ValueError):
        P.pad_w2(_rand(2, 4, 20), 16)
    with pytest.raises(ValueError):
        P.pad_w13(_rand(2, 7, 4), 16)  # odd row count: not interleaved pairs
    with pytest.raises(ValueError):
        P.pad_w13_bias(_rand(2, 3), 16)


class _Layer(torch.nn.Module):
    """The parameters of vLLM's FusedMoE with has_bias=True, in vLLM's layout."""

    def __init__(self, e, i, h, dtype=torch.float32, seed=0):
        super().__init__()
        mk = lambda *s, k: torch.nn.Parameter(_rand(*s, dtype=dtype, seed=seed + k), requires_grad=False)  # noqa: E731
        self.w13_weight = mk(e, 2 * i, h, k=0)
        self.w13_bias = mk(e, 2 * i, k=1)
        self.w2_weight = mk(e, h, i, k=2)
        self.w2_bias = mk(e, h, k=3)
        self.activation = "swigluoai"


def test_pad_layer_in_place_one_tensor_at_a_time(monkeypatch):
    layer = _Layer(4, 360, 32)
    params = {n: getattr(layer, n) for n in ("w13_weight", "w13_bias", "w2_weight", "w2_bias")}
    originals = {n: p.detach().clone() for n, p in params.items()}
    alive = {}
    for n in ("w13_weight", "w13_bias", "w2_weight"):
        alive[n] = True
        weakref.finalize(params[n].data.untyped_storage(), alive.__setitem__, n, False)
    seen = []
    real_pad_dim = P.pad_dim

    def spy(t, dim, size):  # when each allocation happens, which old storages are still alive
        seen.append({n for n, a in alive.items() if a})
        return real_pad_dim(t, dim, size)

    monkeypatch.setattr(P, "pad_dim", spy)
    changed = P.pad_moe_layer_(layer, 368)
    assert changed == {"w13_weight": ((4, 720, 32), (4, 736, 32)), "w13_bias": ((4, 720), (4, 736)),
                       "w2_weight": ((4, 32, 360), (4, 32, 368))}
    # the old tensor being padded is alive while its copy is made; every earlier one is already released
    assert seen == [{"w13_weight", "w13_bias", "w2_weight"}, {"w13_bias", "w2_weight"}, {"w2_weight"}]
    assert not any(alive.values())
    for n, p in params.items():  # same Parameter objects, padded contents
        assert getattr(layer, n) is p
    assert torch.equal(layer.w13_weight[:, :720], originals["w13_weight"]) and not layer.w13_weight[:, 720:].any()
    assert torch.equal(layer.w13_bias[:, :720], originals["w13_bias"]) and not layer.w13_bias[:, 720:].any()
    assert torch.equal(layer.w2_weight[..., :360], originals["w2_weight"]) and not layer.w2_weight[..., 360:].any()
    assert torch.equal(layer.w2_bias, originals["w2_bias"])


def test_aligned_layer_is_not_copied():
    layer = _Layer(2, 368, 16)
    ptrs = {n: getattr(layer, n).data_ptr() for n in ("w13_weight", "w13_bias", "w2_weight")}
    assert P.pad_moe_layer_(layer, 368) == {}
    assert {n: getattr(layer, n).data_ptr() for n in ptrs} == ptrs


def test_pad_layer_rejects_inconsistent_shapes():
    layer = _Layer(2, 10, 8)
    layer.w2_weight = torch.nn.Parameter(_rand(2, 8, 9), requires_grad=False)
    with pytest.raises(ValueError, match="vLLM's layout"):
        P.pad_moe_layer_(layer, 16)


# ------------------------------------------------------------------------- exactness (in-order float32 accumulation)


def _swigluoai_scalar_rule(v: torch.Tensor) -> torch.Tensor:
    """GPT-OSS activation written out here: gate = even columns clamped above at 7, up = odd columns clamped to +-7,
    (up + 1) * gate * sigmoid(1.702 * gate).

    Evaluated one output column at a time on a contiguous ``(T,)`` vector, so every element goes through the same CPU
    code path whatever the row width (a vectorised elementwise kernel may round its scalar tail differently from its
    SIMD body: the same input can differ in the last bit between a 20-wide and a 32-wide row)."""
    cols = []
    for j in range(v.size(1) // 2):
        gate = torch.clamp(v[:, 2 * j].contiguous(), max=7.0)
        up = torch.clamp(v[:, 2 * j + 1].contiguous(), -7.0, 7.0)
        cols.append((up + 1) * gate * torch.sigmoid(1.702 * gate))
    return torch.stack(cols, dim=1)


def _inorder_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x (T, K) @ w (K, N)`` accumulated in float32 over k = 0, 1, ..., K-1 (elementwise ops, no BLAS)."""
    acc = torch.zeros(x.size(0), w.size(1), dtype=torch.float32)
    xf, wf = x.float(), w.float()
    for k in range(x.size(1)):
        acc = acc + xf[:, k:k + 1] * wf[k:k + 1, :]
    return acc


def _inorder_expert(x, w13, b13, w2, b2):
    """One expert in vLLM's layout: w13 (2I, H), b13 (2I,), w2 (H, I), b2 (H,) -> (T, H) and the activation."""
    pre = _inorder_matmul(x, w13.T) + b13.float()
    act = _swigluoai_scalar_rule(pre)
    return _inorder_matmul(act, w2.T) + b2.float(), act


@pytest.mark.parametrize("inter, padded", [(360, 368), (180, 192), (20, 32)])
def test_zero_pairs_add_exactly_nothing_in_float32(inter, padded):
    e, h, t = 2, 48, 6
    layer = _Layer(e, inter, h, seed=7)
    with torch.no_grad():
        layer.w13_weight.mul_(3.0 / h ** 0.5)  # pre-activations of a few units: the +-7 clamps are reached
        layer.w13_bias.mul_(2.0)
    x = _rand(t, h, seed=9)
    ref = [_inorder_expert(x, layer.w13_weight[k], layer.w13_bias[k], layer.w2_weight[k], layer.w2_bias[k])
           for k in range(e)]
    P.pad_moe_layer_(layer, padded)
    for k in range(e):
        out, act = _inorder_expert(x, layer.w13_weight[k], layer.w13_bias[k], layer.w2_weight[k], layer.w2_bias[k])
        assert act.shape == (t, padded) and torch.equal(act[:, :inter], ref[k][1])
        assert torch.equal(act[:, inter:], torch.zeros(t, padded - inter))  # swigluoai(0 + 0, 0 + 0) == 0
        assert torch.equal(out, ref[k][0])  # the zero w2 rows add nothing: bit-identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swigluoai_of_a_zero_pair_is_zero(dtype):
    from gptoss_patch.kernels.moe import swigluoai

    z = torch.zeros(3, 8, dtype=dtype)
    assert torch.equal(swigluoai(z), torch.zeros(3, 4, dtype=dtype))
    assert torch.equal(_swigluoai_scalar_rule(z), torch.zeros(3, 4, dtype=dtype))


# -------------------------------------------------------------------------------------------------- release NZ rules


@pytest.mark.parametrize("release, env, eagle, want", [
    ("0.11.0rc0", 0, False, True),
    ("0.11.0rc1", 1, False, True), ("0.11.0rc2", 0, False, False),
    ("0.11.0rc3", 1, True, False),
    ("0.11.0", 1, False, False), ("0.11.0", 1, True, True), ("0.11.0", 2, True, True), ("0.11.0", 0, True, False),
    ("0.12.0rc1", 1, False, True), ("0.12.0rc1", 0, False, False),
    ("0.13.0", 1, False, False), ("0.13.0", 2, False, True), ("0.14.0rc1", 2, False, True),
])
def test_release_nz_rules(release, env, eagle, want):
    assert matrix.nz_rule(release).casts(env, eagle) is want


def test_unknown_release_has_no_rule():
    assert matrix.nz_rule("0.10.2") is None


# ------------------------------------------------------------------------------------------------------ the decision


def _fake_upstream(is_310p=False, is_enable_nz="dtype", value=True):
    """A function whose module globals hold upstream-like ``is_310p`` / ``is_enable_nz`` (or neither)."""
    calls = []
    ns: dict = {}
    if is_enable_nz == "dtype":
        def nz(dtype=None, vllm_config=None):
            calls.append(("dtype", dtype))
            return value
    elif is_enable_nz == "noargs":
        def nz(vllm_config=None):
            calls.append(("noargs",))
            return value
    else:
        nz = None
    if nz is not None:
        ns["is_enable_nz"] = nz
        ns["is_310p"] = lambda: is_310p
    exec("def process_weights_after_loading(self, layer):\n    pass\n", ns)
    return ns["process_weights_after_loading"], calls


class _Method:
    transpose = True


def test_decision(monkeypatch):
    monkeypatch.delenv(W.POLICY_ENV, raising=False)
    bf16 = _Layer(2, 360, 16, dtype=torch.bfloat16)
    up, calls = _fake_upstream()
    d = W.decide(_Method(), bf16, up)
    assert (d.intermediate, d.target) == (360, 368) and calls == [("dtype", torch.bfloat16)]
    assert W.decide(_Method(), bf16, _fake_upstream(value=False)[0]).target is None
    assert W.decide(_Method(), bf16, _fake_upstream(value=0)[0]).target is None  # env value 0 is falsy upstream
    assert W.decide(_Method(), bf16, _fake_upstream(value=2)[0]).target == 368  # VLLM_ASCEND_ENABLE_NZ=2
    assert W.decide(_Method(), bf16, _fake_upstream(is_310p=True)[0]).target is None
    up, calls = _fake_upstream(is_enable_nz="noargs")  # 0.11.0rc1/rc2, 0.12.0rc1 signature
    assert W.decide(_Method(), bf16, up).target == 368 and calls == [("noargs",)]
    assert W.decide(_Method(), bf16, _fake_upstream(is_enable_nz=None)[0]).target == 368  # unknown: pad
    fp32 = _Layer(2, 360, 16)
    assert W.decide(_Method(), fp32, _fake_upstream()[0]).target is None  # fp32 NZ is rejected whatever the shape
    silu = _Layer(2, 360, 16, dtype=torch.bfloat16)
    silu.activation = "silu"
    assert W.decide(_Method(), silu, _fake_upstream()[0]).target is None
    aligned = _Layer(2, 368, 16, dtype=torch.bfloat16)
    assert W.decide(_Method(), aligned, _fake_upstream()[0]).target is None
    done = _Method()
    done.transpose = False
    assert W.decide(done, bf16, _fake_upstream()[0]).target is None
    monkeypatch.setenv(W.POLICY_ENV, "always")
    assert W.decide(_Method(), fp32, _fake_upstream(value=False)[0]).target == 368
    monkeypatch.setenv(W.POLICY_ENV, "NEVER")
    assert W.decide(_Method(), bf16, _fake_upstream()[0]).target is None
    monkeypatch.setenv(W.POLICY_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, always, never"):
        W.decide(_Method(), bf16, _fake_upstream()[0])


def test_wrapper_pads_then_calls_upstream(monkeypatch):
    monkeypatch.delenv(W.POLICY_ENV, raising=False)
    layer = _Layer(2, 360, 16, dtype=torch.bfloat16)
    layer.layer_name = "model.layers.0.mlp.experts"
    seen = []
    ns = {"is_310p": lambda: False, "is_enable_nz": lambda dtype=None, vllm_config=None: True, "seen": seen}
    exec("def process_weights_after_loading(layer):\n"
         "    seen.append(tuple(layer.w2_weight.shape))\n"
         "    return 'upstream result'\n", ns)
    original = ns["process_weights_after_loading"]
    assert W._process_weights_after_loading(original, _Method(), (layer,), {}) == "upstream result"
    assert seen == [(2, 16, 368)] and layer._gptoss_moe_padding == (360, 368)
    assert W.padded_layers()["model.layers.0.mlp.experts"] == (360, 368)
    ns["is_enable_nz"] = lambda dtype=None, vllm_config=None: False
    other = _Layer(2, 360, 16, dtype=torch.bfloat16)
    ptr = other.w2_weight.data_ptr()
    assert W._process_weights_after_loading(original, _Method(), (), {"layer": other}) == "upstream result"
    assert seen[-1] == (2, 16, 360) and other.w2_weight.data_ptr() == ptr


def _fake_upstream_013(device_type="A2", nz_env=1):
    """Module globals like vllm-ascend 0.13.0+ ``ops/fused_moe/fused_moe.py``: ``get_ascend_device_type`` /
    ``AscendDeviceType`` and ``maybe_trans_nz`` (its rule from ``vllm_ascend/utils.py``: env 0 -> as is; fp32 -> as is;
    bf16/fp16 -> NZ only with env 2; other dtypes -> NZ; "NZ" = a new tensor, here a copy)."""
    import enum

    class AscendDeviceType(enum.Enum):
        A2 = 0
        A3 = 1
        _310P = 2

    calls = []

    def maybe_trans_nz(weight):
        calls.append((weight.dtype, tuple(weight.shape)))
        if not nz_env or weight.dtype == torch.float:
            return weight
        if weight.dtype in {torch.bfloat16, torch.float16}:
            return weight.clone() if nz_env == 2 else weight
        return weight.clone()

    ns = {"get_ascend_device_type": lambda: AscendDeviceType[device_type], "AscendDeviceType": AscendDeviceType,
          "maybe_trans_nz": maybe_trans_nz}
    exec("def process_weights_after_loading(self, layer):\n    pass\n", ns)
    return ns["process_weights_after_loading"], calls


def _fake_upstream_012(device_type="A2", value=1):
    """Module globals like vllm-ascend 0.12.0rc1 ``ops/fused_moe/fused_moe.py``: ``get_ascend_device_type`` /
    ``AscendDeviceType`` (no ``is_310p``) and ``is_enable_nz()`` (no arguments: the ``VLLM_ASCEND_ENABLE_NZ`` value)."""
    up, _ = _fake_upstream_013(device_type)
    g = up.__globals__
    del g["maybe_trans_nz"]
    g["is_enable_nz"] = lambda: value
    return up


def test_decision_with_012_and_013_globals(monkeypatch):
    """0.12.0rc1 asks ``get_ascend_device_type() != _310P and is_enable_nz()``; 0.13.0+ ``maybe_trans_nz(weight)``,
    which :func:`upstream_nz_cast` probes with a one-fractal tensor of the weights' dtype (cast = a new tensor)."""
    monkeypatch.delenv(W.POLICY_ENV, raising=False)
    bf16 = _Layer(2, 360, 16, dtype=torch.bfloat16)
    assert W.decide(_Method(), bf16, _fake_upstream_012()).target == 368
    assert W.decide(_Method(), bf16, _fake_upstream_012(value=0)).target is None
    assert W.decide(_Method(), bf16, _fake_upstream_012(device_type="_310P")).target is None
    assert W.upstream_nz_cast(_fake_upstream_012(), torch.float32) is True  # 0.12.0rc1 ignores the dtype
    for env, want in ((0, None), (1, None), (2, 368)):
        up, calls = _fake_upstream_013(nz_env=env)
        assert W.decide(_Method(), bf16, up).target == want
        assert calls == [(torch.bfloat16, (1, 16, 16))]  # the probe, never the layer's weights
    assert W.upstream_nz_cast(_fake_upstream_013(nz_env=2)[0], torch.float32) is False
    assert W.upstream_nz_cast(_fake_upstream_013(nz_env=2)[0], torch.float16) is True
    assert W.upstream_nz_cast(_fake_upstream_013(nz_env=1)[0], torch.int8) is True
    assert W.upstream_nz_cast(_fake_upstream_013(device_type="_310P", nz_env=2)[0], torch.bfloat16) is False
    assert W.decide(_Method(), bf16, _fake_upstream_013(device_type="_310P", nz_env=2)[0]).target is None
