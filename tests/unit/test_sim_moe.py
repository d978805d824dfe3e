"""The NPU simulator's MoE operators, FRACTAL_NZ label and _C_ascend ops against naive references.

Every expected value is produced here by independent code - explicit per-expert / per-token / per-slot loops written
from the documented formulas (docs/operators.md §4, §4.2), or transformers' GPT-OSS MLP - never by the operator under test.
"""

from __future__ import annotations

import gc

import pytest
import torch


from hypothesis import given, settings, strategies as st  # noqa: E402

from gptoss_patch.kernels.moe import route_gptoss, swigluoai  # noqa: E402
from gptoss_patch_testkit.npu_sim._base import NotEmulatedError  # noqa: E402
from gptoss_patch_testkit.npu_sim.ops import OPS as ALL_OPS  # noqa: E402
from gptoss_patch_testkit.npu_sim.ops import moe as sim  # noqa: E402

NAN = float("nan")
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed=0, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed), dtype=F64) * scale).to(dtype)


def counts_to_cumsum(counts):
    out, acc = [], 0
    for c in counts:
        acc += c
        out.append(acc)
    return out


def dot_rows(x_row: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_row (K,) @ w (K, N) as an explicit loop over N, in float64."""
    return torch.stack([sum(x_row[kk].double() * w[kk, n].double() for kk in range(w.size(0)))
                        for n in range(w.size(1))])


def naive_gmm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    """Per expert, per row: y[r] = x[r] @ w[e] + bias[e]; rows past sum(counts) stay NaN. float64."""
    y = torch.full((x.size(0), w.size(-1)), NAN, dtype=F64)
    r = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            y[r] = dot_rows(x[r], w[e]) + (bias[e].double() if bias is not None else 0)
            r += 1
    return y


def test_ops_are_merged_into_the_simulated_namespace():
    for name, fn in sim.OPS.items():  # ops/__init__ wraps every operator for the NPU-graph machinery
        assert getattr(ALL_OPS[name], "__wrapped__", ALL_OPS[name]) is fn
    x = rnd(3, 8)
    torch.testing.assert_close(ALL_OPS["npu_swiglu"](x), sim.npu_swiglu(x))
    assert {"npu_grouped_matmul", "npu_swiglu", "npu_moe_init_routing_v2", "npu_moe_token_unpermute",
            "npu_format_cast", "get_npu_format"} <= set(sim.OPS)


# ============================================================================================ npu_grouped_matmul


def test_gmm_group_list_type_0_and_1_agree_with_naive_loop():
    counts = [2, 0, 3, 1]
    x = rnd(7, 5, seed=1)  # 6 covered rows + 1 uncovered
    w = rnd(4, 5, 3, seed=2)
    b = rnd(4, 3, seed=3)
    want = naive_gmm(x, w, b, counts)
    y1 = sim.npu_grouped_matmul(x=[x], weight=[w], bias=[b], group_list=torch.tensor(counts), split_item=2,
                                group_type=0, group_list_type=1)
    y0 = sim.npu_grouped_matmul(x=[x], weight=[w], bias=[b], group_list=torch.tensor(counts_to_cumsum(counts)),
                                split_item=2, group_type=0, group_list_type=0)
    assert isinstance(y1, list) and len(y1) == 1 and y1[0].shape == (7, 3) and y1[0].dtype == F32
    torch.testing.assert_close(y1[0].double(), want, equal_nan=True, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y0[0], y1[0], equal_nan=True)


def test_gmm_uncovered_rows_are_nan_poisoned_covered_rows_finite():
    x = rnd(10, 4, seed=4)
    w = rnd(3, 4, 6, seed=5)
    y = sim.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2, 1]), split_item=3, group_type=0,
                               group_list_type=1)[0]
    assert torch.isfinite(y[:4]).all()
    assert torch.isnan(y[4:]).all()


def test_gmm_experts_without_tokens_first_middle_last():
    counts = [0, 2, 0, 0, 3, 0]
    x = rnd(5, 3, seed=6)
    w = rnd(6, 3, 2, seed=7)
    y = sim.npu_grouped_matmul([x], [w], group_list=torch.tensor(counts), split_item=2, group_type=0,
                               group_list_type=1)[0]
    torch.testing.assert_close(y.double(), naive_gmm(x, w, None, counts), rtol=1e-5, atol=1e-5)


def test_gmm_bf16_x_with_float32_bias():
    counts = [3, 2]
    x = rnd(5, 8, seed=8, dtype=BF16)
    w = rnd(2, 8, 4, seed=9, dtype=BF16)
    b = rnd(2, 4, seed=10, dtype=F32) * 10
    y = sim.npu_grouped_matmul(x=[x], weight=[w], bias=[b], group_list=torch.tensor(counts), split_item=2,
                               group_type=0, group_list_type=1)[0]
    assert y.dtype == BF16
    torch.testing.assert_close(y.double(), naive_gmm(x, w, b, counts), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("x_dtype,bias_dtype,required", [(BF16, BF16, "DT_FLOAT"), (torch.float16, F32, "DT_FLOAT16"),
                                                         (F32, BF16, "DT_FLOAT")])
def test_gmm_bias_dtype_rule(x_dtype, bias_dtype, required):
    x = rnd(4, 8, dtype=x_dtype)
    w = rnd(2, 8, 4, dtype=x_dtype)
    with pytest.raises(RuntimeError, match=rf"bias dtype does not match with required dtype\[{required}\]"):
        sim.npu_grouped_matmul([x], [w], bias=[torch.zeros(2, 4, dtype=bias_dtype)], group_list=torch.tensor([2, 2]),
                               split_item=2, group_type=0, group_list_type=1)


def test_gmm_bias_shape_checks():
    x, w = rnd(4, 8), rnd(2, 8, 4)
    gl = torch.tensor([2, 2])
    with pytest.raises(RuntimeError, match="batch size"):
        sim.npu_grouped_matmul([x], [w], bias=[torch.zeros(3, 4)], group_list=gl, split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="NDim"):
        sim.npu_grouped_matmul([x], [w], bias=[torch.zeros(2, 5)], group_list=gl, split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="Dim must be 2"):
        sim.npu_grouped_matmul([x], [w], bias=[torch.zeros(8)], group_list=gl, split_item=2, group_type=0)


def test_gmm_transposed_weight_view_equals_contiguous():
    counts = [2, 3]
    x = rnd(5, 6, seed=11)
    w = rnd(2, 6, 4, seed=12)
    w_t_view = w.transpose(1, 2).contiguous().transpose(1, 2)  # (E, K, N) with strides [.., 1, K]
    assert not w_t_view.is_contiguous() and w_t_view.stride(1) == 1
    a = sim.npu_grouped_matmul([x], [w], group_list=torch.tensor(counts), split_item=2, group_type=0,
                               group_list_type=1)[0]
    b = sim.npu_grouped_matmul([x], [w_t_view], group_list=torch.tensor(counts), split_item=2, group_type=0,
                               group_list_type=1)[0]
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a.double(), naive_gmm(x, w, None, counts), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(0, 3), st.integers(1, 5), st.integers(1, 4),
       st.booleans(), st.integers(0, 1000))
def test_gmm_hypothesis_vs_naive(counts, extra_rows, k, n, cumsum, seed):
    m = sum(counts) + extra_rows
    x = rnd(m, k, seed=seed)
    w = rnd(len(counts), k, n, seed=seed + 1)
    b = rnd(len(counts), n, seed=seed + 2)
    gl = torch.tensor(counts_to_cumsum(counts) if cumsum else counts, dtype=torch.int64)
    y = sim.npu_grouped_matmul([x], [w], bias=[b], group_list=gl, split_item=2, group_type=0,
                               group_list_type=0 if cumsum else 1)[0]
    torch.testing.assert_close(y.double(), naive_gmm(x, w, b, counts), equal_nan=True, rtol=1e-5, atol=1e-5)


def test_gmm_split_item_0_and_1_return_one_tensor_per_group():
    x = rnd(5, 3, seed=13)
    w = rnd(3, 3, 2, seed=14)
    for split in (0, 1):
        ys = sim.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 1, 5]), split_item=split, group_type=0,
                                    group_list_type=0)
        assert [tuple(y.shape) for y in ys] == [(1, 2), (0, 2), (4, 2)]
        torch.testing.assert_close(ys[2].double(), naive_gmm(x[1:], w[2:], None, [4]), rtol=1e-5, atol=1e-5)


def test_gmm_multi_x_multi_weight_and_no_grouping():
    xs = [rnd(2, 3, seed=15), rnd(3, 3, seed=16)]
    ws = [rnd(3, 4, seed=17), rnd(3, 4, seed=18)]
    bs = [rnd(4, seed=19), rnd(4, seed=20)]
    want = [naive_gmm(xi, wi.unsqueeze(0), bi.unsqueeze(0), [xi.size(0)]) for xi, wi, bi in zip(xs, ws, bs)]
    cat = sim.npu_grouped_matmul(xs, ws, bias=bs, split_item=2, group_type=0)
    torch.testing.assert_close(cat[0].double(), torch.cat(want), rtol=1e-5, atol=1e-5)
    sep = sim.npu_grouped_matmul(xs, ws, bias=bs, split_item=0, group_type=-1)
    for got, exp in zip(sep, want):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)
    x3 = rnd(2, 2, 3, seed=21)  # group_type -1 accepts 2-6D x
    y3 = sim.npu_grouped_matmul([x3], [ws[0]], split_item=0, group_type=-1)[0]
    torch.testing.assert_close(y3.double(), torch.stack([naive_gmm(x3[i], ws[0].unsqueeze(0), None, [2])
                                                         for i in range(2)]), rtol=1e-5, atol=1e-5)


def test_gmm_legacy_list_group_list_is_cumulative():
    x, w = rnd(4, 3, seed=22), [rnd(3, 2, seed=23), rnd(3, 2, seed=24)]
    y = sim.npu_grouped_matmul([x], w, group_list=[1, 4], split_item=3)[0]
    torch.testing.assert_close(y.double(), naive_gmm(x, torch.stack(w), None, [1, 3]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(group_type=None), RuntimeError, "Requires manual passing group_type"),
    (dict(group_type=1), RuntimeError, "group type must be -1, 0 or 2"),
    (dict(group_type=2), NotEmulatedError, "group_type=2"),
    (dict(split_item=4), RuntimeError, "split_item"),
    (dict(group_type=-1), RuntimeError, "groupType can not be -1"),
    (dict(group_list_type=2), RuntimeError, "INT8"),
    (dict(group_list=torch.tensor([2, 2, 0])), RuntimeError, "size of groupList"),
    (dict(group_list=torch.tensor([2, 2], dtype=torch.int32)), RuntimeError, "Only int64"),
    (dict(group_list=torch.tensor([3, 3])), RuntimeError, "covers 6 rows but x has only 4"),
    (dict(group_list=torch.tensor([3, -1])), RuntimeError, "non-negative"),
    (dict(group_list=torch.tensor([3, 2]), group_list_type=0), RuntimeError, "non-decreasing"),
    (dict(group_list=None), RuntimeError, "required in this case"),
    (dict(scale=[torch.ones(2, 4)]), NotEmulatedError, "scale"),
    (dict(per_token_scale=[torch.ones(4)]), NotEmulatedError, "per_token_scale"),
    (dict(act_type=1), NotEmulatedError, "act_type"),
    (dict(output_dtype=BF16), RuntimeError, "y dtype"),
])
def test_gmm_argument_errors(kwargs, exc, match):
    call = dict(x=[rnd(4, 8)], weight=[rnd(2, 8, 4)], group_list=torch.tensor([2, 2]), split_item=2, group_type=0,
                group_list_type=1)
    call.update(kwargs)
    with pytest.raises(exc, match=match):
        sim.npu_grouped_matmul(**call)


def test_gmm_shape_and_dtype_errors():
    gl = torch.tensor([2, 2])
    with pytest.raises(RuntimeError, match="weight dtype"):
        sim.npu_grouped_matmul([rnd(4, 8)], [rnd(2, 8, 4, dtype=BF16)], group_list=gl, split_item=2, group_type=0,
                               group_list_type=1)
    with pytest.raises(RuntimeError, match="k dim value"):
        sim.npu_grouped_matmul([rnd(4, 8)], [rnd(2, 7, 4)], group_list=gl, split_item=2, group_type=0,
                               group_list_type=1)
    with pytest.raises(RuntimeError, match="transposition"):
        sim.npu_grouped_matmul([rnd(8, 4).t()], [rnd(2, 8, 4)], group_list=gl, split_item=2, group_type=0,
                               group_list_type=1)
    with pytest.raises(RuntimeError, match="InnerLimit"):
        sim.npu_grouped_matmul([torch.zeros(1, 65536)], [torch.zeros(1, 65536, 1)], group_list=torch.tensor([1]),
                               split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(RuntimeError, match="size of x 2 should equal to size of weight 3"):
        sim.npu_grouped_matmul([rnd(2, 8), rnd(2, 8)], [rnd(3, 8, 4)], split_item=2, group_type=0)
    with pytest.raises(NotEmulatedError):
        sim.npu_grouped_matmul([torch.zeros(4, 8, dtype=torch.int8)], [torch.zeros(2, 8, 4, dtype=torch.int8)],
                               group_list=gl, split_item=2, group_type=0, group_list_type=1)


# ============================================================================================ FRACTAL_NZ


def test_format_cast_labels_a_copy_and_keeps_values():
    w = rnd(2, 32, 48, dtype=BF16)
    assert sim.get_npu_format(w) == sim.ACL_FORMAT_ND == 2
    nz = sim.npu_format_cast(w, 29)
    assert sim.get_npu_format(nz) == sim.ACL_FORMAT_FRACTAL_NZ == 29
    assert sim.get_npu_format(w) == 2  # the input is not modified
    assert nz.shape == w.shape and nz.dtype == w.dtype and torch.equal(nz, w)
    assert nz.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    assert sim.npu_format_cast(nz, 29) is nz
    nd = sim.npu_format_cast(nz, 2)
    assert sim.get_npu_format(nd) == 2 and sim.get_npu_format(nz) == 29 and torch.equal(nd, w)


def test_format_label_follows_the_storage_through_parameter_data_and_views():
    # vllm-ascend 0.11 process_weights_after_loading:
    #   layer.w13_weight = Parameter(w.transpose(1, 2).contiguous()); layer.w13_weight.data = npu_format_cast(.data, 29)
    layer = torch.nn.Module()
    layer.w = torch.nn.Parameter(rnd(2, 48, 32, dtype=BF16).transpose(1, 2).contiguous(), requires_grad=False)
    layer.w.data = sim.npu_format_cast(layer.w.data, 29)
    assert sim.get_npu_format(layer.w) == 29
    rewrapped = torch.nn.Parameter(layer.w.data, requires_grad=False)  # a new tensor object, same storage
    assert rewrapped is not layer.w and sim.get_npu_format(rewrapped) == 29
    assert sim.get_npu_format(layer.w.transpose(1, 2)) == 29  # unquant_apply_mlp(need_trans=True)
    assert sim.get_npu_format(layer.w.narrow(0, 0, 1)) == 29
    assert sim.get_npu_format(layer.w.detach()) == 29
    assert sim.get_npu_format(layer.w.clone()) == 2  # a new storage


def test_format_cast_inplace_relabels_storage():
    t = rnd(4, 16)
    alias = t.view(16, 4)
    assert sim.npu_format_cast_(t, 29) is t
    assert sim.get_npu_format(t) == 29 and sim.get_npu_format(alias) == 29
    sim.npu_format_cast_(t, torch.zeros(2))  # copy the format of an ND tensor
    assert sim.get_npu_format(t) == 2


def test_format_cast_rejects_unemulated_formats():
    with pytest.raises(NotEmulatedError):
        sim.npu_format_cast(torch.zeros(2, 2), 3)
    with pytest.raises(NotEmulatedError):
        sim.npu_format_cast(torch.zeros(2, 2), 29, customize_dtype=3)
    with pytest.raises(NotEmulatedError):
        sim.npu_format_cast_(torch.zeros(2, 2), 4)
    with pytest.raises(TypeError):
        sim.get_npu_format([1, 2])


def test_nz_label_does_not_survive_address_reuse():
    """A freed NZ storage whose StorageImpl address (and memory) is reused must not make the new tensor NZ."""
    before = len(sim._FORMATS)
    reused = 0
    for _ in range(10):
        if reused >= 2:
            break
        nz = sim.npu_format_cast(torch.zeros(4096), 29)
        key, ptr = nz.untyped_storage()._cdata, nz.data_ptr()
        assert sim.get_npu_format(nz) == 29
        del nz
        gc.collect()
        for _ in range(50):
            fresh = torch.zeros(4096)
            if fresh.untyped_storage()._cdata == key or fresh.data_ptr() == ptr:
                reused += 1
                assert sim.get_npu_format(fresh) == 2
                break
    assert reused > 0, "the allocator never reused an address; the test did not exercise the hazard"
    assert len(sim._FORMATS) == before  # entries are dropped with their storage: no leak


# ---------------------------------------------------------------------------------- NZ alignment in npu_grouped_matmul


def _gmm_nz(k, n, dtype=BF16, transposed=False, nz=True):
    w = rnd(2, n, k, dtype=dtype).transpose(1, 2) if transposed else rnd(2, k, n, dtype=dtype)
    if nz:
        w = sim.npu_format_cast(w.contiguous() if not transposed else w.transpose(1, 2).contiguous(), 29)
        w = w.transpose(1, 2) if transposed else w
    x = rnd(3, k, dtype=dtype)
    return sim.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2]), split_item=2, group_type=0,
                                  group_list_type=1)[0], x, w


def test_nz_rejects_k_360_gptoss_120b_tp8_w2():
    # gpt-oss-120b at TP=8: I_rank = 2880 / 8 = 360; w2 after the Ascend transpose is (E, K=360, N=2880)
    with pytest.raises(RuntimeError, match=r"FRACTAL_NZ, weight'shape\(k\[360\], n\[64\]\)"):
        _gmm_nz(360, 64)
    with pytest.raises(RuntimeError, match=r"k\[64\], n\[360\]"):
        _gmm_nz(64, 360)
    with pytest.raises(RuntimeError, match=r"k\[360\]"):
        _gmm_nz(360, 64, transposed=True)  # w1.transpose(1, 2) of an NZ weight (need_trans=True)


@pytest.mark.parametrize("k", [368, 384])
def test_nz_accepts_multiples_of_16(k):
    y, x, w = _gmm_nz(k, 48)
    ref = sim.npu_grouped_matmul([x], [w.clone()], group_list=torch.tensor([1, 2]), split_item=2, group_type=0,
                                 group_list_type=1)[0]  # the same weight in ND
    assert sim.get_npu_format(w) == 29 and torch.equal(y, ref)


def test_nd_accepts_k_360_and_nz_rejects_fp32():
    y, _, _ = _gmm_nz(360, 64, nz=False)
    assert torch.isfinite(y).all()
    with pytest.raises(RuntimeError, match=r"weight\(DT_FLOAT\) format is FRACTAL_NZ"):
        _gmm_nz(32, 32, dtype=F32)


def test_nz_w13_of_gptoss_120b_tp8_passes_and_w2_fails_like_process_weights_after_loading():
    e, h, i_rank = 1, 2880, 360
    w13 = torch.nn.Parameter(torch.zeros(e, 2 * i_rank, h, dtype=BF16).transpose(1, 2).contiguous(),
                             requires_grad=False)
    w2 = torch.nn.Parameter(torch.zeros(e, h, i_rank, dtype=BF16).transpose(1, 2).contiguous(), requires_grad=False)
    w13.data = sim.npu_format_cast(w13.data, 29)
    w2.data = sim.npu_format_cast(w2.data, 29)
    gl = torch.tensor([2])
    out13 = sim.npu_grouped_matmul([torch.zeros(2, h, dtype=BF16)], [w13], group_list=gl, split_item=2, group_type=0,
                                   group_list_type=1)[0]
    assert out13.shape == (2, 2 * i_rank)
    with pytest.raises(RuntimeError, match=r"k\[360\], n\[2880\]"):
        sim.npu_grouped_matmul([torch.zeros(2, i_rank, dtype=BF16)], [w2], group_list=gl, split_item=2, group_type=0,
                               group_list_type=1)


# ============================================================================================ npu_swiglu


def test_swiglu_first_half_is_the_gate():
    x = rnd(3, 8, seed=30)
    want = torch.empty(3, 4, dtype=F64)
    for r in range(3):
        for c in range(4):
            a, b = x[r, c].double(), x[r, c + 4].double()
            want[r, c] = a / (1 + torch.exp(-a)) * b
    torch.testing.assert_close(sim.npu_swiglu(x).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sim.npu_swiglu(x.t(), dim=0).double(), want.t(), rtol=1e-5, atol=1e-6)
    assert sim.npu_swiglu(x.to(BF16)).dtype == BF16
    with pytest.raises(RuntimeError, match="even"):
        sim.npu_swiglu(torch.zeros(2, 5))


# ============================================================================================ gating


def naive_softmax_topk(x: torch.Tensor, k: int):
    ys, ids = [], []
    for row in x.double().tolist():
        m = max(row)
        ex = [pow(2.718281828459045, v - m) for v in row]
        s = sum(ex)
        p = [v / s for v in ex]
        order = sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]
        ys.append([p[e] for e in order])
        ids.append(order)
    return torch.tensor(ys, dtype=F64), ids


def test_gating_top_k_softmax_descending_with_column_major_row_idx():
    x = rnd(5, 7, seed=31, scale=2)
    y, idx, row_idx = sim.npu_moe_gating_top_k_softmax(x=x, finished=None, k=3)
    want_y, want_ids = naive_softmax_topk(x, 3)
    assert idx.dtype == torch.int32 and row_idx.dtype == torch.int32 and y.dtype == F32
    assert idx.tolist() == want_ids
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-6)
    assert all(a >= b for row in y.tolist() for a, b in zip(row, row[1:]))
    assert row_idx.tolist() == [[c * 5 + r for c in range(3)] for r in range(5)]


def test_gating_top_k_softmax_finished_ties_and_3d():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    y, idx, _ = sim.npu_moe_gating_top_k_softmax(x, torch.tensor([False, True]), k=2)
    assert idx.tolist() == [[1, 2], [4, 4]]  # ties: lower id first; finished rows get expert id E
    torch.testing.assert_close(y[1], torch.tensor([0.25, 0.25]))
    x3 = rnd(2, 3, 6, seed=32)
    y3, idx3, row3 = sim.npu_moe_gating_top_k_softmax(x3, k=2)
    assert y3.shape == idx3.shape == row3.shape == (2, 3, 2)
    assert idx3.reshape(-1, 2).tolist() == naive_softmax_topk(x3.reshape(6, 6), 2)[1]
    with pytest.raises(RuntimeError):
        sim.npu_moe_gating_top_k_softmax(x3, k=7)


def naive_gating_top_k(x, k, bias, k_group, group_count, mode, norm_type, renorm, rsf, eps=1e-20):
    ys, ids = [], []
    e_num = x.size(1)
    per = e_num // group_count
    for r, row in enumerate(x.double().tolist()):
        if norm_type == 0:
            m = max(row)
            ex = [pow(2.718281828459045, v - m) for v in row]
            norm = [v / sum(ex) for v in ex]
        else:
            norm = [1 / (1 + pow(2.718281828459045, -v)) for v in row]
        sel = [norm[e] + (bias[e].item() if bias is not None else 0.0) for e in range(e_num)]
        allowed = set(range(e_num))
        if group_count > 1 and k_group < group_count:
            scores = []
            for g in range(group_count):
                vals = sorted(sel[g * per:(g + 1) * per], reverse=True)
                scores.append(vals[0] if mode == 0 else vals[0] + vals[1])
            keep = sorted(range(group_count), key=lambda g: (-scores[g], g))[:k_group]
            allowed = {g * per + j for g in keep for j in range(per)}
        order = sorted(allowed, key=lambda e: (-sel[e], e))[:k]
        y = [norm[e] for e in order]
        if norm_type == 1 or renorm == 1:
            s = sum(y) + eps
            y = [v / s for v in y]
        ys.append([v * rsf for v in y])
        ids.append(order)
    return torch.tensor(ys, dtype=F64), ids


@pytest.mark.parametrize("norm_type,use_bias,groups,mode", [(0, False, 1, 0), (1, True, 4, 1), (1, True, 4, 0),
                                                            (0, True, 2, 1)])
def test_gating_top_k_vs_naive(norm_type, use_bias, groups, mode):
    x = rnd(6, 16, seed=33, scale=2)
    bias = rnd(16, seed=34) * 0.5 if use_bias else None
    y, idx, out = sim.npu_moe_gating_top_k(x, 3, bias=bias, k_group=2 if groups > 1 else 1, group_count=groups,
                                           group_select_mode=mode, norm_type=norm_type, out_flag=True,
                                           routed_scaling_factor=2.5)
    want_y, want_ids = naive_gating_top_k(x, 3, bias, 2 if groups > 1 else 1, groups, mode, norm_type, 0, 2.5)
    assert idx.tolist() == want_ids
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-6)
    want_norm = torch.softmax(x.double(), -1) if norm_type == 0 else torch.sigmoid(x.double())
    torch.testing.assert_close(out.double(), want_norm, rtol=1e-5, atol=1e-6)


def test_gating_top_k_checks_and_uninitialised_out():
    x = rnd(2, 8)
    _, _, out = sim.npu_moe_gating_top_k(x, 2)
    assert out.shape == (2, 8) and torch.isnan(out).all()
    for kwargs, match in [(dict(renorm=1), "renorm"), (dict(norm_type=2), "norm type"),
                          (dict(group_count=3), "not divisible"), (dict(k_group=2), "k_group"),
                          (dict(bias=torch.zeros(8, dtype=BF16)), "dtype of x and bias")]:
        with pytest.raises(RuntimeError, match=match):
            sim.npu_moe_gating_top_k(x, 2, **kwargs)
    with pytest.raises(RuntimeError, match="k is"):
        sim.npu_moe_gating_top_k(x, 9)


# ============================================================================================ _C_ascend


def test_register_c_ascend_ops_is_idempotent_and_keeps_the_schemas():
    sim.register_c_ascend_ops()
    assert sim.register_c_ascend_ops() == []
    for name, schema in sim.C_ASCEND_SCHEMAS.items():
        op = getattr(torch.ops._C_ascend, name).default
        assert str(op._schema).replace(" ", "").startswith(f"_C_ascend::{schema}".split("(")[0].replace(" ", ""))
        assert op._schema.name == f"_C_ascend::{name}"
    args = [a.name for a in torch.ops._C_ascend.npu_moe_init_routing_custom.default._schema.arguments]
    assert args == ["x", "expert_idx", "scale", "offset", "active_num", "expert_capacity", "expert_num",
                    "drop_pad_mode", "expert_tokens_num_type", "expert_tokens_num_flag", "quant_mode",
                    "active_expert_range", "row_idx_type"]


def test_c_ascend_moe_gating_top_k_as_vllm_ascend_013_calls_it_equals_gptoss_routing():
    sim.register_c_ascend_ops()
    logits = rnd(7, 32, seed=35, scale=3)
    # VA@v0.13.0 ops/fused_moe/experts_selector.py _select_experts_with_fusion_ops
    w, ids, _ = torch.ops._C_ascend.moe_gating_top_k(
        logits, k=4, k_group=1, group_count=1, group_select_mode=1, renorm=1, norm_type=0, out_flag=False,
        routed_scaling_factor=1.0, eps=float(1e-20), bias_opt=None)
    want_y, want_ids = naive_gating_top_k(logits, 4, None, 1, 1, 1, 0, 1, 1.0)
    assert ids.dtype == torch.int32 and ids.tolist() == want_ids
    torch.testing.assert_close(w.double(), want_y, rtol=1e-5, atol=1e-6)
    ref_w, ref_ids = route_gptoss(logits, 4)
    assert ids.long().tolist() == ref_ids.tolist()
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_c_ascend_ops_have_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    sim.register_c_ascend_ops()
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(5, 8))
        ids = mode.from_tensor(torch.zeros(5, 2, dtype=torch.int32))
        y, e, out = torch.ops._C_ascend.moe_gating_top_k(x, 2, 1, 1, 0, 0, 0, False, 1.0, 1e-20)
        ex, ri, tok, sc = torch.ops._C_ascend.npu_moe_init_routing_custom(
            x, ids, active_num=10, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True,
            active_expert_range=[2, 6], quant_mode=-1)
    assert (y.shape, e.dtype, out.shape) == ((5, 2), torch.int32, (5, 8))
    assert (ex.shape, ri.shape, tok.shape, sc.shape) == ((10, 8), (10,), (4,), (10,))


# ============================================================================================ init routing


def naive_route(ids: torch.Tensor, start: int, end: int):
    """Slots (j = r*K + k) of experts in [start, end), grouped by expert ascending, slot order kept."""
    flat = ids.reshape(-1).tolist()
    slots = [j for e in range(start, end) for j in range(len(flat)) if flat[j] == e]
    counts = [sum(1 for v in flat if v == e) for e in range(start, end)]
    return slots, counts


def test_init_routing_v1_matches_doc_formula():
    x = rnd(4, 3, seed=40)
    expert_idx = torch.tensor([[2, 0], [0, 1], [2, 2], [1, 0]], dtype=torch.int32)
    row_idx = torch.arange(8, dtype=torch.int32).reshape(2, 4).t().contiguous()  # k*R + r
    for active in (4, 2):
        ex, rows, experts = sim.npu_moe_init_routing(x, row_idx=row_idx, expert_idx=expert_idx, active_num=active)
        slots, _ = naive_route(expert_idx, 0, 3)
        src_rows = [row_idx.reshape(-1)[j].item() for j in slots]
        assert experts.tolist() == sorted(expert_idx.reshape(-1).tolist()) and experts.dtype == torch.int32
        want_rows = [0] * 8
        for i, s in enumerate(src_rows):
            want_rows[s] = i
        assert rows.tolist() == want_rows
        assert ex.shape == (min(active, 4) * 2, 3)
        for i in range(ex.size(0)):
            assert torch.equal(ex[i], x[src_rows[i] % 4])


@pytest.mark.parametrize("op", ["v2", "custom"])
def test_init_routing_v2_expert_parallel_range_and_minus_one(op):
    if op == "custom":
        sim.register_c_ascend_ops()
        fn = torch.ops._C_ascend.npu_moe_init_routing_custom
    else:
        fn = sim.npu_moe_init_routing_v2
    x = rnd(5, 4, seed=41)
    ids = torch.tensor([[1, 5], [4, 7], [2, 4], [6, 0], [5, 3]], dtype=torch.int32)
    start, end = 4, 8  # EP rank 1 of 2 with 8 global experts
    # VA@v0.11.0 TokenDispatcherWithAllGather.token_dispatch
    ex, row_idx, tokens, scale = fn(x, ids, active_num=10, expert_num=8, expert_tokens_num_type=1,
                                    expert_tokens_num_flag=True, active_expert_range=[start, end], quant_mode=-1)
    slots, counts = naive_route(ids, start, end)
    want_row = [-1] * 10
    for i, j in enumerate(slots):
        want_row[j] = i
    assert row_idx.dtype == torch.int32 and row_idx.tolist() == want_row
    assert tokens.dtype == torch.int64 and tokens.tolist() == counts == [2, 2, 1, 1]
    assert ex.shape == (10, 4) and ex.dtype == x.dtype
    for i, j in enumerate(slots):
        assert torch.equal(ex[i], x[j // 2])
    assert torch.isnan(ex[len(slots):]).all()  # rows past n_valid are uninitialised
    assert scale.shape == (10,) and scale.dtype == F32


def test_init_routing_v2_token_num_types_row_idx_type_and_negative_ids():
    x = rnd(4, 3, seed=42)
    ids = torch.tensor([[0, -1], [3, 1], [1, 9], [2, 1]], dtype=torch.int32)  # -1 and 9 are outside [0, 4)
    slots, counts = naive_route(ids, 0, 4)
    common = dict(expert_num=4, expert_tokens_num_flag=True, quant_mode=-1)
    _, _, cum, _ = sim.npu_moe_init_routing_v2(x, ids, expert_tokens_num_type=0, **common)
    assert cum.tolist() == counts_to_cumsum(counts)
    _, _, kv, _ = sim.npu_moe_init_routing_v2(x, ids, expert_tokens_num_type=2, active_expert_range=[0, 4],
                                              expert_num=6, expert_tokens_num_flag=True, quant_mode=-1)
    pairs = [[e, c] for e, c in enumerate(counts) if c]
    assert kv.shape == (6, 2) and kv[:len(pairs)].tolist() == pairs and kv[len(pairs)].tolist() == [0, 0]
    _, scatter, _, _ = sim.npu_moe_init_routing_v2(x, ids, row_idx_type=1, **common)
    assert scatter[:len(slots)].tolist() == slots
    _, gather, _, _ = sim.npu_moe_init_routing_v2(x, ids, row_idx_type=0, **common)
    assert gather[1].item() == -1 and gather[5].item() == -1
    ex, _, unset, _ = sim.npu_moe_init_routing_v2(x, ids, expert_num=4, quant_mode=-1, active_num=3)
    assert ex.shape == (3, 3) and (unset == torch.iinfo(torch.int64).min).all()  # flag False: uninitialised
    assert [torch.equal(ex[i], x[slots[i] // 2]) for i in range(3)] == [True] * 3


def test_init_routing_v2_scale_and_unemulated_modes():
    x = rnd(3, 2, seed=43)
    ids = torch.tensor([[1], [0], [1]], dtype=torch.int32)
    scale = torch.tensor([0.5, 1.5, 2.5])
    _, _, _, es = sim.npu_moe_init_routing_v2(x, ids, scale=scale, expert_num=2, quant_mode=-1)
    assert es.tolist() == [1.5, 0.5, 2.5]
    with pytest.raises(NotEmulatedError, match="quant_mode=0"):
        sim.npu_moe_init_routing_v2(x, ids, expert_num=2)  # the 7.2.0/7.3.0 schema default is 0
    with pytest.raises(NotEmulatedError, match="quant_mode=1"):
        sim.npu_moe_init_routing_v2(x, ids, expert_num=2, quant_mode=1)
    with pytest.raises(NotEmulatedError, match="drop_pad_mode"):
        sim.npu_moe_init_routing_v2(x, ids, expert_num=2, quant_mode=-1, drop_pad_mode=1, expert_capacity=2)
    with pytest.raises(RuntimeError, match="active_expert_range"):
        sim.npu_moe_init_routing_v2(x, ids, expert_num=2, quant_mode=-1, active_expert_range=[1, 3])
    with pytest.raises(RuntimeError, match="int32"):
        sim.npu_moe_init_routing_v2(x, ids.long(), expert_num=2, quant_mode=-1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(2, 9), st.data())
def test_init_routing_v2_hypothesis(rows, k, experts, data):
    start = data.draw(st.integers(0, experts - 1))
    end = data.draw(st.integers(start + 1, experts))
    flat = data.draw(st.lists(st.integers(-1, experts - 1), min_size=rows * k, max_size=rows * k))
    ids = torch.tensor(flat, dtype=torch.int32).reshape(rows, k)
    x = rnd(rows, 3, seed=rows * 31 + k)
    ex, row_idx, counts, _ = sim.npu_moe_init_routing_v2(
        x, ids, active_num=rows * k, expert_num=experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[start, end], quant_mode=-1)
    slots, want_counts = naive_route(ids, start, end)
    assert counts.tolist() == want_counts
    for j in range(rows * k):
        i = row_idx[j].item()
        if j in slots:
            assert i == slots.index(j) and torch.equal(ex[i], x[j // k])
        else:
            assert i == -1


def test_compute_expert_tokens():
    s = torch.tensor([0, 0, 2, 2, 2, 4], dtype=torch.int32)
    got = sim.npu_moe_compute_expert_tokens(s, 6)
    assert got.dtype == torch.int32
    assert got.tolist() == [sum(1 for v in s.tolist() if v <= e) for e in range(6)]
    with pytest.raises(RuntimeError, match="non-decreasing"):
        sim.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2)
    with pytest.raises(RuntimeError):
        sim.npu_moe_compute_expert_tokens(torch.tensor([0, 5], dtype=torch.int32), 2)


# ============================================================================================ combine


def naive_unpermute(permuted, sorted_indices, probs):
    k = probs.size(1) if probs is not None else 1
    t_num = sorted_indices.numel() // k
    out = torch.zeros(t_num, permuted.size(1), dtype=F64)
    for t in range(t_num):
        for kk in range(k):
            p = probs[t, kk].double() if probs is not None else 1.0
            out[t] += p * permuted[sorted_indices[t * k + kk]].double()
    return out


def test_token_permute_and_unpermute_vs_naive_and_roundtrip():
    tokens = rnd(5, 3, seed=50)
    indices = torch.tensor([[3, 1], [0, 3], [1, 1], [2, 0], [3, 2]])
    permuted, sorted_indices = sim.npu_moe_token_permute(tokens=tokens, indices=indices, num_out_tokens=10)
    slots, _ = naive_route(indices, 0, 4)
    assert sorted_indices.dtype == torch.int32
    for i, j in enumerate(slots):
        assert torch.equal(permuted[i], tokens[j // 2])
        assert sorted_indices[j].item() == i
    probs = rnd(5, 2, seed=51).abs()
    out = sim.npu_moe_token_unpermute(permuted_tokens=permuted, sorted_indices=sorted_indices, probs=probs)
    torch.testing.assert_close(out.double(), naive_unpermute(permuted, sorted_indices, probs), rtol=1e-5, atol=1e-6)
    half = torch.full((5, 2), 0.5)
    torch.testing.assert_close(sim.npu_moe_token_unpermute(permuted, sorted_indices, probs=half), tokens)
    no_probs = sim.npu_moe_token_unpermute(permuted, sorted_indices)
    assert no_probs.shape == (10, 3) and torch.equal(no_probs[0], permuted[sorted_indices[0]])


def test_token_permute_num_out_tokens_and_padded_mode():
    tokens = rnd(4, 2, seed=52)
    idx = torch.tensor([2, 0, 1, 0])
    p, s = sim.npu_moe_token_permute(tokens, idx, num_out_tokens=-1)
    assert p.shape == (3, 2) and s.shape == (4,)
    p2, _ = sim.npu_moe_token_permute(tokens, idx, num_out_tokens=99)
    assert p2.shape == (4, 2)
    pad_idx = torch.tensor([[1, 3], [0, 0]])
    pp, ps = sim.npu_moe_token_permute(tokens, pad_idx, padded_mode=True)
    assert torch.equal(pp, tokens[[1, 3, 0, 0]]) and torch.equal(ps, pad_idx)
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    up = sim.npu_moe_token_unpermute(pp, ps, probs=w, padded_mode=True, restore_shape=[4, 2])
    want = torch.zeros(4, 2, dtype=F64)
    for i, (tok, prob) in enumerate(zip([1, 3, 0, 0], [1.0, 2.0, 3.0, 4.0])):
        want[tok] += prob * pp[i].double()
    torch.testing.assert_close(up.double(), want)
    with pytest.raises(NotEmulatedError):
        sim.npu_moe_token_unpermute(p, s)  # slot 1 was dropped (num_out_tokens=-1): no documented semantics


@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_vs_naive(mode):
    r, k, h, e = 4, 2, 3, 5
    rows = rnd(r * k, h, seed=53)
    skip1, skip2 = rnd(r, h, seed=54), rnd(r, h, seed=55)
    bias = rnd(e, h, seed=56)
    scales = rnd(r, k, seed=57)
    experts = torch.randint(0, e, (r, k), generator=gen(58), dtype=torch.int32)
    src = torch.randperm(r * k, generator=gen(59)).to(torch.int32)
    src[3] = -1
    out = sim.npu_moe_finalize_routing(rows, skip1=skip1, skip2=skip2, bias=bias, scales=scales,
                                       expanded_src_to_dst_row=src, export_for_source_row=experts,
                                       drop_pad_mode=mode)
    want = skip1.double() + skip2.double()
    for i in range(r):
        for kk in range(k):
            v = src[kk * r + i].item() if mode == 0 else src[i * k + kk].item()
            row = torch.zeros(h, dtype=F64) if v == -1 else rows[v].double()
            want[i] += scales[i, kk].double() * (row + bias[experts[i, kk]].double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    plain = sim.npu_moe_finalize_routing(rows, None, None, None, None, torch.arange(r * k, dtype=torch.int32), None)
    torch.testing.assert_close(plain, rows)
    with pytest.raises(RuntimeError, match="skip2"):
        sim.npu_moe_finalize_routing(rows, None, skip2, None, scales, src, experts)


# ============================================================================================ pipelines


def test_allgather_expert_parallel_pipeline_matches_naive():
    """VA@v0.11.0 TokenDispatcherWithAllGather + unquant GMM + token_combine, one EP rank of two."""
    r, k, h, e_global, e_local, rank = 6, 2, 4, 8, 4, 1
    x = rnd(r, h, seed=60)
    ids = torch.tensor([[4, 1], [5, 7], [0, 2], [6, 4], [3, 5], [7, 6]], dtype=torch.int32)
    weights = rnd(r, k, seed=61).abs()
    w = rnd(e_local, h, h, seed=62)
    first, last = rank * e_local, (rank + 1) * e_local
    mask = (ids >= first) & (ids < last)  # expert_map[topk_ids] != -1
    sorted_h, row_idx, tokens, _ = sim.npu_moe_init_routing_v2(
        x, ids, active_num=r * k, expert_num=e_global, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[first, last], quant_mode=-1)
    y = sim.npu_grouped_matmul(x=[sorted_h], weight=[w], split_item=2, group_list_type=1, group_type=0,
                               group_list=tokens.to(torch.int64))[0]
    out = sim.npu_moe_token_unpermute(permuted_tokens=y, sorted_indices=torch.abs(row_idx), probs=weights * mask)
    want = torch.zeros(r, h, dtype=F64)
    for t in range(r):
        for kk in range(k):
            eid = ids[t, kk].item()
            if first <= eid < last:
                want[t] += weights[t, kk].double() * dot_rows(x[t], w[eid - first])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_allgather_combine_reads_an_uninitialised_row_when_a_rank_gets_one_slot():
    """abs(-1) = 1 points at GMM row 1; with a single routed slot that row is uninitialised, and 0 * NaN = NaN."""
    x = rnd(2, 4, seed=63)
    ids = torch.tensor([[4, 0], [1, 2]], dtype=torch.int32)  # only one slot in [4, 8)
    sorted_h, row_idx, tokens, _ = sim.npu_moe_init_routing_v2(
        x, ids, active_num=4, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[4, 8], quant_mode=-1)
    y = sim.npu_grouped_matmul(x=[sorted_h], weight=[rnd(4, 4, 4, seed=64)], split_item=2, group_list_type=1,
                               group_type=0, group_list=tokens)[0]
    probs = torch.ones(2, 2) * ((ids >= 4) & (ids < 8))
    out = sim.npu_moe_token_unpermute(y, torch.abs(row_idx), probs=probs)
    assert torch.isnan(out).all(), "the simulator must expose reads of uninitialised GMM rows"


def gptoss_on_simulator(h, router_w, router_b, w13, b13, w2, b2, top_k, activation):
    """The vllm-ascend 0.15 unquantised GPT-OSS path, with the simulated operators."""
    logits = torch.nn.functional.linear(h, router_w, router_b)
    weights, ids, _ = sim.npu_moe_gating_top_k_softmax(x=logits, finished=None, k=top_k)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    t = h.size(0)
    sorted_h, row_idx, tokens, _ = sim.npu_moe_init_routing_v2(
        h, ids, active_num=t * top_k, expert_num=w13.size(0), expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, w13.size(0)], quant_mode=-1)
    gate_up = sim.npu_grouped_matmul(x=[sorted_h], weight=[w13], bias=[b13.to(F32)], split_item=2,
                                     group_list_type=1, group_type=0, group_list=tokens)[0]
    act = activation(gate_up)
    down = sim.npu_grouped_matmul(x=[act], weight=[w2], bias=[b2.to(F32)], split_item=2, group_list_type=1,
                                  group_type=0, group_list=tokens)[0]
    return sim.npu_moe_token_unpermute(permuted_tokens=down, sorted_indices=torch.abs(row_idx), probs=weights)


def test_gptoss_moe_on_simulator_matches_transformers_and_plain_swiglu_does_not():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    cfg = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=6, num_experts_per_tok=2,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32)
    mlp = gpt_oss.GptOssMLP(cfg)
    g = gen(65)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 1.5)
    h = torch.randn(7, cfg.hidden_size, generator=g)
    want = mlp(h.unsqueeze(0))[0].squeeze(0)
    ex = mlp.experts
    args = (h, mlp.router.weight.detach(), mlp.router.bias.detach(), ex.gate_up_proj.detach(),
            ex.gate_up_proj_bias.detach(), ex.down_proj.detach(), ex.down_proj_bias.detach(), 2)
    got = gptoss_on_simulator(*args, activation=swigluoai)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unpatched = gptoss_on_simulator(*args, activation=sim.npu_swiglu)  # vllm-ascend <= 0.14 activation
    assert not torch.allclose(unpatched, want, rtol=1e-2, atol=1e-2)
