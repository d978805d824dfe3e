"""Attention operators of the NPU simulator against independent references.

Every expected value here comes from code in this file: a naive per-query, per-head float64 attention
(``ref_attention``) whose allowed-key predicates are written straight from docs/operators.md §3.3, §3.7, paged caches
filled and read with explicit per-position loops (docs/operators.md §3.7), and - for the sink and sliding-window math - Hugging
Face transformers' GPT-OSS ``eager_attention_forward`` with a mask built from transformers' own
``causal_mask_function`` / ``sliding_window_overlay``. Nothing is computed by the code under test.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_patch_testkit.npu_sim import ops as sim_ops
from gptoss_patch_testkit.npu_sim._base import NotEmulatedError
from gptoss_patch_testkit.npu_sim.ops import attention as A

FIA = A.npu_fused_infer_attention_score
FIA2 = A.npu_fused_infer_attention_score_v2
TOL = dict(atol=1e-5, rtol=1e-5)
INT_MAX = 2147483647
TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)  # vllm-ascend get_splitfuse_attn_mask


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run single-threaded: on a shared 2-core host, OpenMP barriers of 2 threads stall under load (seen: 5-30x)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# ------------------------------------------------------------------------------------------------
# independent references
# ------------------------------------------------------------------------------------------------

def ref_attention(q, k, v, scale, allowed, sink=None):
    """Naive attention in float64: an explicit loop over query rows, keys chosen by a Python predicate.

    q (Sq, N, D), k (Skv, KV_N, D), v (Skv, KV_N, Dv); ``allowed(i, j) -> bool``; sink (N,) or None.
    Query head h reads KV head h // (N // KV_N) (an explicit per-head index list). Rows without allowed keys
    -> 0, lse +inf.
    """
    sq, n_heads, _ = q.shape
    skv, kvn, _ = k.shape
    dv = v.shape[2]
    group = n_heads // kvn
    kv_of_head = torch.tensor([h // group for h in range(n_heads)])
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(sq, n_heads, dv, dtype=torch.float64)
    lse = torch.full((sq, n_heads), math.inf, dtype=torch.float64)
    for i in range(sq):
        keys = [j for j in range(skv) if allowed(i, j)]
        if not keys:
            continue
        idx = torch.tensor(keys)
        ks = k[idx][:, kv_of_head]  # (L, N, D)
        vs = v[idx][:, kv_of_head]  # (L, N, Dv)
        s = (ks * q[i][None]).sum(-1) * scale  # (L, N)
        m = s.max(dim=0).values  # (N,)
        e = torch.exp(s - m)
        z = e.sum(dim=0)
        denom = z + (torch.exp(sink.double() - m) if sink is not None else 0.0)
        out[i] = (e[:, :, None] * vs).sum(0) / denom[:, None]
        lse[i] = m + torch.log(z)
    return out, lse


def rule(mode, sq, skv, pre=INT_MAX, nxt=INT_MAX, mask=None):
    """docs/operators.md §3.3 table, literally (mask: 2-D bool/int, 1 = masked)."""
    off = skv - sq
    if mode == "none":
        return lambda i, j: True
    if mode == 0:
        return lambda i, j: bool(mask[i][j] == 0) and i - pre <= j <= i + nxt
    if mode == 1:
        return lambda i, j: bool(mask[i][j] == 0)
    if mode == 2:
        return lambda i, j: j <= i
    if mode == 3:
        return lambda i, j: j <= i + off
    if mode == 4:
        return lambda i, j: i + off - pre <= j <= i + off + nxt
    if mode == "last":  # IFA window: keep the last `pre` keys
        return lambda i, j: j >= skv - pre
    raise AssertionError(mode)


def hf_attention(q, k, v, scale, sinks, window=None):
    """transformers GPT-OSS eager attention for one sequence whose queries are the last Sq of Skv positions.

    q (Sq, N, D), k/v (Skv, KV_N, D); sinks (N,); window None = causal, else transformers' sliding window
    (key j allowed iff pos - window < j <= pos). Returns (Sq, N, D).
    """
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    sq, skv = q.shape[0], k.shape[0]
    fn = causal_mask_function if window is None else and_masks(causal_mask_function, sliding_window_overlay(window))
    q_idx = (torch.arange(sq) + (skv - sq))[:, None]
    kv_idx = torch.arange(skv)[None, :]
    ok = fn(0, 0, q_idx, kv_idx)
    mask = torch.zeros(1, 1, sq, skv, dtype=q.dtype).masked_fill(~ok, float("-inf"))

    class Mod(torch.nn.Module):
        pass

    mod = Mod().eval()
    mod.sinks = sinks.to(q.dtype)
    mod.num_key_value_groups = q.shape[1] // k.shape[1]
    out, _ = eager_attention_forward(mod, q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                                     v.permute(1, 0, 2)[None], mask, scaling=scale, dropout=0.0)
    return out[0]


def make_paged(dense, block_size, kvn, gen, heads_major=False, extra_blocks=3):
    """Scatter per-sequence dense K (L, KV_N, D) into a shuffled paged cache with explicit loops.

    Unused slots hold NaN, so reading past a sequence's length poisons the result. Returns (cache, table).
    """
    d = dense[0].shape[-1] if dense else 16
    need = [-(-x.shape[0] // block_size) for x in dense]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    maxb = max(need + [1])
    table = torch.tensor([[perm[-1]] * maxb for _ in dense], dtype=torch.int32)  # junk ids in unused columns
    if heads_major:
        cache = torch.full((num_blocks, kvn, block_size, d), float("nan"))
    else:
        cache = torch.full((num_blocks, block_size, kvn * d), float("nan"))
    nxt = 0
    for b, x in enumerate(dense):
        for c in range(need[b]):
            table[b, c] = perm[nxt]
            nxt += 1
        for p in range(x.shape[0]):
            blk, off = int(table[b, p // block_size]), p % block_size
            if heads_major:
                cache[blk, :, off, :] = x[p]
            else:
                cache[blk, off] = x[p].reshape(-1)
    return cache, table


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen)


def tnd_case(seqs, n, kvn, d, gen, block_size=128, heads_major=False):
    """Build a TND paged batch: seqs = [(q_len, kv_len)], queries are the last q_len positions."""
    qs, ks, vs = [], [], []
    for ql, kl in seqs:
        qs.append(rand(gen, ql, n, d))
        ks.append(rand(gen, kl, kvn, d))
        vs.append(rand(gen, kl, kvn, d))
    kc, table = make_paged(ks, block_size, kvn, gen, heads_major)
    vc = torch.full_like(kc, float("nan"))  # the value cache uses the key cache's block table
    for b, x in enumerate(vs):
        for p in range(x.shape[0]):
            blk, off = int(table[b, p // block_size]), p % block_size
            if heads_major:
                vc[blk, :, off, :] = x[p]
            else:
                vc[blk, off] = x[p].reshape(-1)
    cum, c = [], 0
    for ql, _ in seqs:
        c += ql
        cum.append(c)
    return dict(q=torch.cat(qs) if qs else torch.zeros(0, n, d), qs=qs, ks=ks, vs=vs, kc=kc, vc=vc, table=table,
                cum=cum, kvlens=[kl for _, kl in seqs])


def assert_close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected.double(), **(tol or TOL))


def check_tnd_against_ref(out, lse, case, scale, mode, pre=INT_MAX, nxt=INT_MAX, sink=None):
    start = 0
    for b, (qb, kb, vb) in enumerate(zip(case["qs"], case["ks"], case["vs"])):
        sq, skv = qb.shape[0], kb.shape[0]
        ro, rl = ref_attention(qb, kb, vb, scale, rule(mode, sq, skv, pre, nxt), sink)
        assert_close(out[start:start + sq], ro)
        if lse is not None:
            assert_close(lse[start:start + sq, :, 0], rl)
        start += sq


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------

NAMES = ["npu_fused_infer_attention_score", "_npu_fused_infer_attention_score_get_max_workspace",
         "npu_fused_infer_attention_score_v2", "_npu_fused_infer_attention_score_v2_get_max_workspace",
         "_npu_reshape_and_cache", "_npu_flash_attention", "_npu_flash_attention_qlens", "_npu_paged_attention",
         "_npu_paged_attention_get_workspace"]


def test_ops_are_registered_with_out_overloads():
    assert sorted(A.OPS) == sorted(NAMES)
    for name in NAMES:
        merged = sim_ops.OPS[name]  # possibly wrapped by the graph router (functools.wraps)
        assert getattr(merged, "__wrapped__", merged) is A.OPS[name]
        assert A.OPS[name].__doc__ and "Sources" in A.OPS[name].__doc__
    for name in ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"):
        assert callable(A.OPS[name].out) and "out=[attention_out, softmax_lse]" in A.OPS[name].out.__doc__
        assert callable(sim_ops.OPS[name].out)


def test_merged_ops_compute_the_same_eagerly():
    gen = torch.Generator().manual_seed(24)
    case = tnd_case([(3, 20), (1, 9)], 4, 2, 32, gen)
    kw = dict(atten_mask=TEMPLATE, block_table=case["table"], input_layout="TND", block_size=128,
              actual_seq_lengths=case["cum"], actual_seq_lengths_kv=case["kvlens"], num_key_value_heads=2,
              num_heads=4, scale=0.2, sparse_mode=3)
    direct, _ = FIA(case["q"], case["kc"], case["vc"], **kw)
    o = torch.empty(4, 4, 32)
    sim_ops.OPS["npu_fused_infer_attention_score"].out(case["q"], case["kc"], case["vc"], out=[o, torch.empty(1)],
                                                       **kw)
    assert torch.equal(o, direct)
    check_tnd_against_ref(o, None, case, 0.2, 3)


# ------------------------------------------------------------------------------------------------
# FIA v1: TND paged, mixed batch
# ------------------------------------------------------------------------------------------------

MIXED = [(1, 300), (1, 129), (37, 37), (50, 260), (0, 5), (1, 0), (3, 3)]


@pytest.mark.parametrize("heads_major", [False, True], ids=["BnBsH", "BnNBsD"])
def test_v1_tnd_paged_mixed_batch_gqa_8_to_1(heads_major):
    gen = torch.Generator().manual_seed(1)
    n, kvn, d = 8, 1, 64
    case = tnd_case(MIXED, n, kvn, d, gen, heads_major=heads_major)
    scale = d ** -0.5
    out, lse = FIA(case["q"], case["kc"], case["vc"], atten_mask=TEMPLATE, block_table=case["table"],
                   input_layout="TND", block_size=128, actual_seq_lengths=case["cum"],
                   actual_seq_lengths_kv=case["kvlens"], num_key_value_heads=kvn, num_heads=n, scale=scale,
                   sparse_mode=3, softmax_lse_flag=True)
    assert out.shape == (case["q"].shape[0], n, d) and out.dtype == torch.float32
    assert lse.shape == (case["q"].shape[0], n, 1) and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    check_tnd_against_ref(out, lse, case, scale, 3)
    zero_row = sum(q for q, _ in MIXED[:5])  # the (1, 0) padding entry
    assert torch.equal(out[zero_row], torch.zeros(n, d))
    assert torch.isinf(lse[zero_row]).all()


def test_v1_lengths_as_cpu_tensors_and_dummy_lse():
    gen = torch.Generator().manual_seed(2)
    case = tnd_case([(1, 200), (1, 17), (1, 130)], 8, 1, 64, gen)
    qcum = torch.tensor([1, 1, 1], dtype=torch.int32).cumsum(0)  # as vllm-ascend v0.15 builds it
    out_t, lse_t = FIA(case["q"], case["kc"], case["vc"], atten_mask=TEMPLATE, block_table=case["table"],
                       input_layout="TND", block_size=128, actual_seq_lengths=qcum,
                       actual_seq_lengths_kv=torch.tensor(case["kvlens"], dtype=torch.int32),
                       num_key_value_heads=1, num_heads=8, scale=0.125, sparse_mode=3)
    out_l, _ = FIA(case["q"], case["kc"], case["vc"], atten_mask=TEMPLATE, block_table=case["table"],
                   input_layout="TND", block_size=128, actual_seq_lengths=case["cum"],
                   actual_seq_lengths_kv=case["kvlens"], num_key_value_heads=1, num_heads=8, scale=0.125,
                   sparse_mode=3)
    assert torch.equal(out_t, out_l)
    assert lse_t.shape == (1,) and lse_t.dtype == torch.float32 and lse_t.item() == 0.0
    check_tnd_against_ref(out_t, None, case, 0.125, 3)


def test_v1_tnd_without_cache_uses_cumulative_kv_lengths():
    gen = torch.Generator().manual_seed(3)
    n, kvn, d = 8, 2, 64
    lens = [5, 17, 1, 9]
    qs = [rand(gen, x, n, d) for x in lens]
    ks = [rand(gen, x, kvn, d) for x in lens]
    vs = [rand(gen, x, kvn, d) for x in lens]
    cum = torch.tensor(lens).cumsum(0).tolist()
    out, lse = FIA(torch.cat(qs), torch.cat(ks), torch.cat(vs), atten_mask=TEMPLATE, input_layout="TND",
                   actual_seq_lengths=cum, actual_seq_lengths_kv=cum, num_key_value_heads=kvn, num_heads=n,
                   scale=0.1, sparse_mode=3, softmax_lse_flag=True)
    check_tnd_against_ref(out, lse, dict(qs=qs, ks=ks, vs=vs), 0.1, 3)


def test_v1_bf16_output_dtype_and_precision():
    gen = torch.Generator().manual_seed(4)
    case = tnd_case([(1, 150), (20, 40)], 8, 1, 64, gen)
    bf = {k: case[k].to(torch.bfloat16) for k in ("q", "kc", "vc")}
    out, _ = FIA(bf["q"], bf["kc"], bf["vc"], atten_mask=TEMPLATE, block_table=case["table"], input_layout="TND",
                 block_size=128, actual_seq_lengths=case["cum"], actual_seq_lengths_kv=case["kvlens"],
                 num_key_value_heads=1, num_heads=8, scale=0.125, sparse_mode=3)
    assert out.dtype == torch.bfloat16
    start = 0
    for qb, kb, vb in zip(case["qs"], case["ks"], case["vs"]):
        ro, _ = ref_attention(qb.bfloat16(), kb.bfloat16(), vb.bfloat16(), 0.125, rule(3, qb.shape[0], kb.shape[0]))
        assert_close(out[start:start + qb.shape[0]], ro, atol=2e-2, rtol=2e-2)
        start += qb.shape[0]


# ------------------------------------------------------------------------------------------------
# FIA v2: sinks, band mode, and the transformers reference
# ------------------------------------------------------------------------------------------------

SWA = [(40, 300), (1, 200), (150, 150), (1, 129), (1, 0)]


def test_v2_sink_causal_gqa_64_to_8_matches_naive_and_transformers():
    gen = torch.Generator().manual_seed(5)
    n, kvn, d = 64, 8, 64
    case = tnd_case([(1, 260), (30, 30), (20, 140), (1, 0)], n, kvn, d, gen)
    sinks = rand(gen, n) * 2
    scale = d ** -0.5
    out, lse = FIA2(case["q"], case["kc"], case["vc"], num_query_heads=n, num_key_value_heads=kvn,
                    input_layout="TND", pre_tokens=INT_MAX, next_tokens=0, atten_mask=TEMPLATE, sparse_mode=3,
                    softmax_scale=scale, block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
                    actual_seq_kvlen=case["kvlens"], learnable_sink=sinks, return_softmax_lse=True)
    check_tnd_against_ref(out, lse, case, scale, 3, sink=sinks)
    start = 0
    for qb, kb, vb in zip(case["qs"], case["ks"], case["vs"]):
        if kb.shape[0]:
            assert_close(out[start:start + qb.shape[0]], hf_attention(qb, kb, vb, scale, sinks))
        start += qb.shape[0]


def test_v2_sparse_mode_4_pre_127_equals_transformers_window_128_and_pre_128_does_not():
    gen = torch.Generator().manual_seed(6)
    n, kvn, d = 8, 1, 64
    case = tnd_case(SWA, n, kvn, d, gen)
    sinks = rand(gen, n)
    scale = d ** -0.5

    def run(pre):
        return FIA2(case["q"], case["kc"], case["vc"], num_query_heads=n, num_key_value_heads=kvn,
                    input_layout="TND", pre_tokens=pre, next_tokens=0, atten_mask=TEMPLATE, sparse_mode=4,
                    softmax_scale=scale, block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
                    actual_seq_kvlen=case["kvlens"], learnable_sink=sinks)[0]

    out127, out128 = run(127), run(128)
    start, differs = 0, 0.0
    for qb, kb, vb in zip(case["qs"], case["ks"], case["vs"]):
        sq, skv = qb.shape[0], kb.shape[0]
        rows = slice(start, start + sq)
        if skv:
            ref_hf = hf_attention(qb, kb, vb, scale, sinks, window=128)
            assert_close(out127[rows], ref_hf)
            # pre_tokens=128 admits 129 keys: equal to the documented band, not to the reference model
            ro, _ = ref_attention(qb, kb, vb, scale, rule(4, sq, skv, 128, 0), sinks)
            assert_close(out128[rows], ro)
            keys = [sum(rule(4, sq, skv, 128, 0)(i, j) for j in range(skv)) for i in range(sq)]
            assert max(keys) == min(129, skv)
            if skv > 128:
                differs = max(differs, float((out128[rows] - ref_hf).abs().max()))
        start += sq
    assert differs > 1e-3


def test_v2_lse_excludes_sink_and_out_identity():
    gen = torch.Generator().manual_seed(7)
    n, kvn, d = 8, 2, 128
    case = tnd_case([(6, 40), (1, 9)], n, kvn, d, gen)
    sinks = rand(gen, n) * 3
    out, lse = FIA2(case["q"], case["kc"], case["vc"], num_query_heads=n, num_key_value_heads=kvn,
                    input_layout="TND", atten_mask=TEMPLATE, sparse_mode=3, softmax_scale=0.09,
                    block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
                    actual_seq_kvlen=case["kvlens"], learnable_sink=sinks, return_softmax_lse=True)
    check_tnd_against_ref(out, lse, case, 0.09, 3, sink=sinks)  # ref lse has no sink term
    # out * (1 + exp(sink - lse)) == sum_j exp(s_j - lse) v_j  (plain softmax output)
    plain, _ = FIA2(case["q"], case["kc"], case["vc"], num_query_heads=n, num_key_value_heads=kvn,
                    input_layout="TND", atten_mask=TEMPLATE, sparse_mode=3, softmax_scale=0.09,
                    block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
                    actual_seq_kvlen=case["kvlens"])
    factor = 1 + torch.exp(sinks[None, :, None] - lse)
    assert_close(out * factor, plain)


def test_v2_bf16_sinks():
    gen = torch.Generator().manual_seed(8)
    n, kvn, d = 16, 2, 64
    case = tnd_case([(9, 140), (1, 33)], n, kvn, d, gen)
    sinks = rand(gen, n).bfloat16()
    bf = {k: case[k].bfloat16() for k in ("q", "kc", "vc")}
    out, _ = FIA2(bf["q"], bf["kc"], bf["vc"], num_query_heads=n, num_key_value_heads=kvn, input_layout="TND",
                  pre_tokens=127, next_tokens=0, atten_mask=TEMPLATE, sparse_mode=4, softmax_scale=0.125,
                  block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
                  actual_seq_kvlen=case["kvlens"], learnable_sink=sinks)
    assert out.dtype == torch.bfloat16
    start = 0
    for qb, kb, vb in zip(case["qs"], case["ks"], case["vs"]):
        ro, _ = ref_attention(qb.bfloat16(), kb.bfloat16(), vb.bfloat16(), 0.125,
                              rule(4, qb.shape[0], kb.shape[0], 127, 0), sinks)
        assert_close(out[start:start + qb.shape[0]], ro, atol=2e-2, rtol=2e-2)
        start += qb.shape[0]


# ------------------------------------------------------------------------------------------------
# decode kernel (IFA): BSH sliding window
# ------------------------------------------------------------------------------------------------

def test_v1_bsh_paged_decode_keeps_last_pre_tokens_keys_like_transformers():
    gen = torch.Generator().manual_seed(9)
    n, kvn, d = 8, 1, 64
    lens = [300, 100, 129, 128, 0]
    ks = [rand(gen, x, kvn, d) for x in lens]
    vs = [rand(gen, x, kvn, d) for x in lens]
    kc, table = make_paged(ks, 128, kvn, gen)
    vc = torch.full_like(kc, float("nan"))
    for b, x in enumerate(vs):
        for p in range(x.shape[0]):
            vc[int(table[b, p // 128]), p % 128] = x[p].reshape(-1)
    q = rand(gen, len(lens), 1, n * d)
    out, _ = FIA(q, kc, vc, num_heads=n, num_key_value_heads=kvn, input_layout="BSH", block_size=128,
                 pre_tokens=128, scale=0.125, block_table=table, actual_seq_lengths=[1] * len(lens),
                 actual_seq_lengths_kv=torch.tensor(lens, dtype=torch.int32))
    assert out.shape == (len(lens), 1, n * d)
    no_sink = torch.full((n,), float("-inf"))
    for b, skv in enumerate(lens):
        qb = q[b].reshape(1, n, d)
        ro, _ = ref_attention(qb, ks[b], vs[b], 0.125, rule("last", 1, skv, 128))
        assert_close(out[b].reshape(1, n, d), ro)
        if skv:
            assert_close(out[b].reshape(1, n, d), hf_attention(qb, ks[b], vs[b], 0.125, no_sink, window=128))


@pytest.mark.parametrize("layout", ["BSND", "BSH_dense"])
def test_decode_window_only_for_bsh_paged(layout):
    gen = torch.Generator().manual_seed(10)
    n, kvn, d, skv = 4, 2, 32, 20
    k = rand(gen, 1, skv, kvn, d)
    v = rand(gen, 1, skv, kvn, d)
    q = rand(gen, 1, 1, n, d)
    if layout == "BSND":
        kc, table = make_paged([k[0]], 128, kvn, gen)
        vc = torch.full_like(kc, float("nan"))
        for p in range(skv):
            vc[int(table[0, 0]), p] = v[0, p].reshape(-1)
        out, _ = FIA(q, kc, vc, num_heads=n, num_key_value_heads=kvn, input_layout="BSND", block_size=128,
                     pre_tokens=4, scale=0.2, block_table=table, actual_seq_lengths_kv=[skv])
    else:
        out, _ = FIA(q.reshape(1, 1, n * d), k.reshape(1, skv, kvn * d), v.reshape(1, skv, kvn * d), num_heads=n,
                     num_key_value_heads=kvn, input_layout="BSH", pre_tokens=4, scale=0.2)
    ro, _ = ref_attention(q[0], k[0], v[0], 0.2, rule("none", 1, skv))
    assert_close(out.reshape(1, n, d), ro)


# ------------------------------------------------------------------------------------------------
# sparse-mode geometry (property test) and the dense layouts
# ------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sq=st.integers(1, 6), skv=st.integers(0, 9), mode=st.sampled_from(["none", 0, 1, 2, 3, 4]),
       pre=st.integers(-3, 10), nxt=st.integers(-3, 10), layout=st.sampled_from(["TND", "BSND"]),
       seed=st.integers(0, 2**16))
def test_sparse_mode_geometry(sq, skv, mode, pre, nxt, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    n, kvn, d = 4, 2, 16
    q, k, v = rand(gen, sq, n, d), rand(gen, skv, kvn, d), rand(gen, skv, kvn, d)
    full = (torch.rand(sq, skv, generator=gen) < 0.3).to(torch.bool)
    if mode == "none":
        mask, smode = None, 0
    elif mode in (0, 1):
        mask, smode = full.unsqueeze(0), mode
    else:
        mask, smode = TEMPLATE, mode
    kw = dict(atten_mask=mask, num_heads=n, num_key_value_heads=kvn, scale=0.3, pre_tokens=pre, next_tokens=nxt,
              sparse_mode=smode, softmax_lse_flag=True)
    if layout == "TND":
        args = (q, k, v)
        kw.update(input_layout="TND", actual_seq_lengths=[sq], actual_seq_lengths_kv=[skv])
    else:
        if sq == 1:  # Q_S = 1 in BSND would be the decode kernel; geometry is a prefill-kernel property
            sq_pad = 2
            q = torch.cat([q, rand(gen, 1, n, d)])
            kw.update(actual_seq_lengths=[1])
            if mask is not None and mode in (0, 1):
                kw["atten_mask"] = torch.cat([full, torch.zeros(1, skv, dtype=torch.bool)]).unsqueeze(0)
        else:
            sq_pad = sq
        args = (q[None], k[None], v[None])
        kw.update(input_layout="BSND")
    if mode == 4 and (pre + nxt < 0 or (layout == "TND" and skv and (pre + sq < 0 or nxt + skv < 0))):
        with pytest.raises(RuntimeError, match="pre_tokens"):  # OTX-pfat CheckVarLenPreNextToken
            FIA(*args, **kw)
        return
    out, lse = FIA(*args, **kw)
    ro, rl = ref_attention(q[:sq], k, v, 0.3, rule(mode, sq, skv, pre, nxt, full))
    if layout == "TND":
        assert_close(out, ro)
        assert_close(lse[..., 0], rl)
    else:
        assert out.shape == (1, sq_pad, n, d)
        assert_close(out[0, :sq], ro)
        assert_close(lse[0, :, :sq, 0].transpose(0, 1), rl)
        if sq_pad > sq:  # padding row beyond actual_seq_lengths
            assert torch.equal(out[0, sq:], torch.zeros(sq_pad - sq, n, d))


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
def test_dense_layouts_right_down_causal(layout):
    gen = torch.Generator().manual_seed(11)
    b, n, kvn, d, sq, skv = 2, 4, 2, 32, 5, 11
    q = rand(gen, b, sq, n, d)
    k = rand(gen, b, skv, kvn, d)
    v = rand(gen, b, skv, kvn, d)
    if layout == "BSH":
        args = (q.reshape(b, sq, n * d), k.reshape(b, skv, kvn * d), v.reshape(b, skv, kvn * d))
    elif layout == "BSND":
        args = (q, k, v)
    else:
        args = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))
    out, lse = FIA(*args, atten_mask=TEMPLATE, num_heads=n, num_key_value_heads=kvn, input_layout=layout,
                   scale=0.25, sparse_mode=3, actual_seq_lengths_kv=[skv, 7], softmax_lse_flag=True)
    assert lse.shape == (b, n, sq, 1)
    if layout == "BSH":
        out = out.reshape(b, sq, n, d)
    elif layout == "BNSD":
        out = out.transpose(1, 2)
    for i, kl in enumerate([skv, 7]):
        ro, rl = ref_attention(q[i], k[i, :kl], v[i, :kl], 0.25, rule(3, sq, kl))
        assert_close(out[i], ro)
        assert_close(lse[i, :, :, 0].transpose(0, 1), rl)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 70)), min_size=1, max_size=5),
       block_size=st.sampled_from([16, 32, 128]), groups=st.sampled_from([(4, 4), (8, 2), (8, 1)]),
       heads_major=st.booleans(), seed=st.integers(0, 2**16))
def test_tnd_paged_random_batches(seqs, block_size, groups, heads_major, seed):
    gen = torch.Generator().manual_seed(seed)
    n, kvn = groups
    case = tnd_case(seqs, n, kvn, 32, gen, block_size=block_size, heads_major=heads_major)
    out, lse = FIA(case["q"], case["kc"], case["vc"], atten_mask=TEMPLATE, block_table=case["table"],
                   input_layout="TND", block_size=block_size, actual_seq_lengths=case["cum"],
                   actual_seq_lengths_kv=case["kvlens"], num_key_value_heads=kvn, num_heads=n, scale=0.2,
                   sparse_mode=3, softmax_lse_flag=True)
    check_tnd_against_ref(out, lse, case, 0.2, 3)


# ------------------------------------------------------------------------------------------------
# .out overloads and workspaces
# ------------------------------------------------------------------------------------------------

def _v1_kwargs(case, **extra):
    kw = dict(atten_mask=TEMPLATE, block_table=case["table"], input_layout="TND", block_size=128,
              actual_seq_lengths=case["cum"], actual_seq_lengths_kv=case["kvlens"], num_key_value_heads=1,
              num_heads=8, scale=0.125, sparse_mode=3)
    kw.update(extra)
    return kw


def test_v1_out_writes_in_place_and_leaves_unrequested_lse_untouched():
    gen = torch.Generator().manual_seed(12)
    case = tnd_case([(1, 140), (4, 4)], 8, 1, 64, gen)
    kw = _v1_kwargs(case)
    ws = A._npu_fused_infer_attention_score_get_max_workspace(query=case["q"], key=case["kc"], value=case["vc"],
                                                              **kw)
    assert ws.dtype == torch.uint8 and ws.dim() == 1
    o = torch.full((5, 8, 64), 7.0)
    lse_buf = torch.full((1,), 3.0, dtype=torch.bfloat16)
    r = FIA.out(query=case["q"], key=case["kc"], value=case["vc"], workspace=ws, out=[o, lse_buf], **kw)
    assert r[0] is o and r[1] is lse_buf
    assert lse_buf.item() == 3.0
    check_tnd_against_ref(o, None, case, 0.125, 3)
    lse_full = torch.zeros(5, 8, 1)
    FIA.out(case["q"], case["kc"], case["vc"], out=[o, lse_full], **_v1_kwargs(case, softmax_lse_flag=True))
    check_tnd_against_ref(o, lse_full, case, 0.125, 3)


def test_v2_out_with_sink_and_workspace():
    gen = torch.Generator().manual_seed(13)
    case = tnd_case([(2, 130), (1, 1)], 8, 2, 64, gen)
    sinks = rand(gen, 8)
    kw = dict(num_query_heads=8, num_key_value_heads=2, input_layout="TND", pre_tokens=127, next_tokens=0,
              atten_mask=TEMPLATE, sparse_mode=4, softmax_scale=0.125, block_table=case["table"], block_size=128,
              actual_seq_qlen=case["cum"], actual_seq_kvlen=case["kvlens"], learnable_sink=sinks)
    ws = A._npu_fused_infer_attention_score_v2_get_max_workspace(case["q"], case["kc"], case["vc"], **kw)
    assert ws.dtype == torch.uint8
    o = torch.empty(3, 8, 64)
    lse_buf = torch.empty(1)
    FIA2.out(case["q"], case["kc"], case["vc"], workspace=ws, out=[o, lse_buf], **kw)
    check_tnd_against_ref(o, None, case, 0.125, 4, 127, 0, sink=sinks)
    with pytest.raises(RuntimeError, match="attention_out must have shape"):
        FIA2.out(case["q"], case["kc"], case["vc"], out=[torch.empty(4, 8, 64), lse_buf], **kw)


def test_workspace_helpers_validate_like_the_operator():
    gen = torch.Generator().manual_seed(14)
    case = tnd_case([(1, 10)], 8, 1, 64, gen)
    with pytest.raises(RuntimeError, match="multiple of num_key_value_heads"):
        A._npu_fused_infer_attention_score_get_max_workspace(case["q"], case["kc"], case["vc"],
                                                             **_v1_kwargs(case, num_key_value_heads=3))


# ------------------------------------------------------------------------------------------------
# ATB operators
# ------------------------------------------------------------------------------------------------

def test_reshape_and_cache_scatters_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(15)
    nb, bs, kvn, d, dv = 4, 16, 2, 32, 16
    kc = rand(gen, nb, bs, kvn, d)
    vc = rand(gen, nb, bs, kvn, dv)
    key, value = rand(gen, 6, kvn, d), rand(gen, 6, kvn, dv)
    slots = torch.tensor([5, -1, 63, 16, -1, 0], dtype=torch.int32)
    ek, ev = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // bs, s % bs] = key[t]
            ev[s // bs, s % bs] = value[t]
    assert A._npu_reshape_and_cache(key=key, value=value, key_cache=kc, value_cache=vc, slot_indices=slots) is None
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_reshape_and_cache_repeated_slot_is_undefined():
    """A slot named twice (vLLM's dummy runs) does not fail, as on the device; its content is NaN (undefined), the
    other slots are written."""
    kc, vc = torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16)
    key, value = torch.arange(3.0).view(3, 1, 1).expand(3, 1, 16).contiguous(), torch.ones(3, 1, 16)
    assert A._npu_reshape_and_cache(key, value, kc, vc, torch.tensor([1, 1, 2], dtype=torch.int32)) is None
    assert torch.isnan(kc[0, 1]).all() and torch.isnan(vc[0, 1]).all()
    assert torch.equal(kc[0, 2], torch.full((1, 16), 2.0)) and torch.equal(vc[0, 2], torch.ones(1, 16))
    assert not torch.isnan(kc[0, 0]).any() and not torch.isnan(kc[0, 3:]).any()


@pytest.mark.parametrize("slots,match", [([0, 64, 2], "out of range")])
def test_reshape_and_cache_rejects_bad_slots(slots, match):
    kc, vc = torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16)
    with pytest.raises(RuntimeError, match=match):
        A._npu_reshape_and_cache(torch.ones(3, 1, 16), torch.ones(3, 1, 16), kc, vc,
                                 torch.tensor(slots, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        A._npu_reshape_and_cache(torch.ones(3, 1, 16), torch.ones(3, 1, 16), kc, vc, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flash_attention_packed_prefill(dtype):
    gen = torch.Generator().manual_seed(16)
    n, kvn, d, lens, pad = 8, 2, 64, [5, 12, 1], 2
    t = sum(lens) + pad
    q, k, v = rand(gen, t, n, d).to(dtype), rand(gen, t, kvn, d).to(dtype), rand(gen, t, kvn, d).to(dtype)
    tri = torch.ones(16, 16, dtype=torch.bool).triu(1)
    # the masks vllm-ascend builds (VA@v0.11.0 attention_mask.py _generate_attn_mask): -inf for fp16 (ATB adds it),
    # 1 for every other dtype (ATB: nonzero = masked) - float32 too, which the simulator once read as additive
    # (no causal mask and a +1 bonus on future keys: a served float32 Llama answered other tokens, issue 32)
    mask = torch.zeros(16, 16, dtype=dtype).masked_fill(tri, float("-inf") if dtype == torch.float16 else 1)
    out = torch.full((t, n, d), 7.0, dtype=dtype)
    A._npu_flash_attention(query=q, key=k, value=v, mask=mask, seq_len=torch.tensor(lens, dtype=torch.int32),
                           scale_value=0.125, num_heads=n, num_kv_heads=kvn, out=out)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    start = 0
    for s in lens:
        ro, _ = ref_attention(q[start:start + s], k[start:start + s], v[start:start + s], 0.125, rule(2, s, s))
        assert_close(out[start:start + s], ro, **tol)
        start += s
    assert (out[start:] == 7.0).all()


def test_flash_attention_qlens_prefix_hit():
    gen = torch.Generator().manual_seed(17)
    n, kvn, d = 8, 2, 64
    seqs = [(20, 150), (5, 5), (3, 300), (2, 0)]
    qs = [rand(gen, a, n, d) for a, _ in seqs]
    ks = [rand(gen, b, kvn, d) for _, b in seqs]
    vs = [rand(gen, b, kvn, d) for _, b in seqs]
    kc, table = make_paged([x for x in ks], 128, kvn, gen)
    nb = kc.shape[0]
    kc4 = torch.full((nb, 128, kvn, d), float("nan"))
    vc4 = torch.full((nb, 128, kvn, d), float("nan"))
    for b in range(len(seqs)):
        for p in range(ks[b].shape[0]):
            kc4[int(table[b, p // 128]), p % 128] = ks[b][p]
            vc4[int(table[b, p // 128]), p % 128] = vs[b][p]
    mask = torch.zeros(128, 128).masked_fill(torch.ones(128, 128, dtype=torch.bool).triu(1), 1).bfloat16()
    out = torch.zeros(sum(a for a, _ in seqs), n, d)
    A._npu_flash_attention_qlens(query=torch.cat(qs), key_cache=kc4, value_cache=vc4, block_table=table,
                                 mask=mask, seq_len=torch.tensor([a for a, _ in seqs], dtype=torch.int32),
                                 context_lens=torch.tensor([b for _, b in seqs], dtype=torch.int32),
                                 num_kv_heads=kvn, num_heads=n, scale_value=0.125, out=out)
    start = 0
    for (a, b), qb, kb, vb in zip(seqs, qs, ks, vs):
        ro, _ = ref_attention(qb, kb, vb, 0.125, rule(3, a, b))
        assert_close(out[start:start + a], ro)
        start += a
    with pytest.raises(RuntimeError, match="blockSize=128"):
        A._npu_flash_attention_qlens(torch.cat(qs), torch.zeros(40, 64, kvn, d), torch.zeros(40, 64, kvn, d),
                                     table, mask, [a for a, _ in seqs], [b for _, b in seqs], kvn, n, 0.125, out)


def test_paged_attention_decode_and_workspace():
    gen = torch.Generator().manual_seed(18)
    n, kvn, d, lens = 8, 1, 64, [300, 1, 0, 129]
    ks = [rand(gen, x, kvn, d) for x in lens]
    vs = [rand(gen, x, kvn, d) for x in lens]
    _, table = make_paged(ks, 128, kvn, gen)
    nb = int(table.max()) + 4
    kc = torch.full((nb, 128, kvn, d), float("nan"))
    vc = torch.full((nb, 128, kvn, d), float("nan"))
    for b in range(len(lens)):
        for p in range(lens[b]):
            kc[int(table[b, p // 128]), p % 128] = ks[b][p]
            vc[int(table[b, p // 128]), p % 128] = vs[b][p]
    q = rand(gen, len(lens), n, d)
    out = torch.full((len(lens), n, d), 7.0)
    kw = dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=kvn, num_heads=n, scale_value=0.125,
              block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32), out=out)
    ws = A._npu_paged_attention_get_workspace(**kw)
    assert ws.dtype == torch.uint8
    A._npu_paged_attention(**kw, workspace=ws)
    for b, x in enumerate(lens):
        ro, _ = ref_attention(q[b:b + 1], ks[b], vs[b], 0.125, rule("none", 1, x))
        assert_close(out[b:b + 1], ro)
    assert torch.equal(out[2], torch.zeros(n, d))
    # a graph-padded batch (vllm-ascend 0.12.0rc1's PIECEWISE decode: query padded to the graph size, context_lens of
    # the real requests): the batch is len(context_lens), the padding rows are left as they were
    padded_q = torch.cat([q, rand(gen, 2, n, d)])
    padded_out = torch.full((len(lens) + 2, n, d), 7.0)
    A._npu_paged_attention(**{**kw, "query": padded_q, "out": padded_out})
    assert torch.equal(padded_out[:len(lens)], out) and (padded_out[len(lens):] == 7.0).all()
    with pytest.raises(RuntimeError, match="context_lens has 4 entries for 3 query tokens"):
        A._npu_paged_attention(**{**kw, "query": q[:3], "out": out[:3]})


# ------------------------------------------------------------------------------------------------
# documented limits -> RuntimeError naming the argument
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base():
    gen = torch.Generator().manual_seed(19)
    case = tnd_case([(2, 40), (1, 7)], 8, 1, 64, gen)
    return case


def _call(case, fn=FIA, q=None, k=None, v=None, **over):
    kw = _v1_kwargs(case) if fn is FIA else dict(
        num_query_heads=8, num_key_value_heads=1, input_layout="TND", atten_mask=TEMPLATE, sparse_mode=3,
        softmax_scale=0.125, block_table=case["table"], block_size=128, actual_seq_qlen=case["cum"],
        actual_seq_kvlen=case["kvlens"])
    kw.update(over)
    return fn(case["q"] if q is None else q, case["kc"] if k is None else k, case["vc"] if v is None else v, **kw)


SWA_MASK = (torch.ones(2048, 2048, dtype=torch.bool).triu(1) | torch.ones(2048, 2048, dtype=torch.bool).tril(-128))


@pytest.mark.parametrize("over,match", [
    (dict(num_key_value_heads=3), r"num_heads \(8\) must be a multiple of num_key_value_heads \(3\)"),
    (dict(atten_mask=torch.triu(torch.ones(1024, 1024, dtype=torch.int8), 1)), r"atten_mask .*\(2048, 2048\)"),
    (dict(atten_mask=None), "atten_mask is required for sparse_mode=3"),
    (dict(atten_mask=SWA_MASK, sparse_mode=4, pre_tokens=128, next_tokens=0), "atten_mask .*template"),
    (dict(sparse_mode=4, pre_tokens=-5, next_tokens=2), r"pre_tokens \(-5\) \+ next_tokens \(2\)"),
    (dict(sparse_mode=5), "sparse_mode=5 is not supported"),
    (dict(sparse_mode=4, pre_tokens=-3, next_tokens=50), r"batch 0: actual_seq_lengths length \(2\) \+ pre_tokens"),
    (dict(actual_seq_lengths=[2, 4]), r"query T \(3\) must equal the last element of actual_seq_lengths \(4\)"),
    (dict(actual_seq_lengths=[2, 1]), "actual_seq_lengths is cumulative and must be non-decreasing"),
    (dict(actual_seq_lengths_kv=None), "actual_seq_lengths and actual_seq_lengths_kv are both required"),
    (dict(actual_seq_lengths_kv=[40]), r"actual_seq_lengths \(2 entries\) and actual_seq_lengths_kv \(1 entries\)"),
    (dict(block_size=64), r"block_size \(64\) must equal the KV cache block dim \(128\)"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), "block_table must be int32"),
    (dict(actual_seq_lengths_kv=[300, 7]), "block_table second dim"),
    (dict(inner_precise=7), "inner_precise"),
    (dict(input_layout="XYZ"), "input_layout='XYZ' is not a supported layout"),
])
def test_v1_limits(base, over, match):
    with pytest.raises(RuntimeError, match=match):
        _call(base, **over)


def test_tnd_batch_limit_4096():
    q = torch.zeros(4097, 8, 64)
    kv = torch.zeros(4097, 1, 64)
    cum = list(range(1, 4098))
    msg = "actual_seq_lengths has 4097 batches; input_layout TND supports at most 4096"
    with pytest.raises(RuntimeError, match=msg):
        FIA(q, kv, kv, input_layout="TND", actual_seq_lengths=cum, actual_seq_lengths_kv=cum, num_heads=8,
            num_key_value_heads=1, atten_mask=TEMPLATE, sparse_mode=3)


def test_v2_messages_use_v2_names(base):
    with pytest.raises(RuntimeError, match=r"must equal the last element of actual_seq_qlen"):
        _call(base, FIA2, actual_seq_qlen=[2, 5])
    with pytest.raises(RuntimeError, match=r"num_query_heads \(8\) must be a multiple"):
        _call(base, FIA2, num_key_value_heads=3)


@pytest.mark.parametrize("sink,over,match", [
    (torch.zeros(8), dict(input_layout="BSH"), "learnable_sink is supported only for input_layout TND"),
    (torch.zeros(4), {}, r"learnable_sink length \(4\) must equal num_query_heads \(8\)"),
    (torch.zeros(8, 1), {}, "learnable_sink must be 1-D"),
    (torch.zeros(8, dtype=torch.float16), {}, "learnable_sink must be bfloat16"),
])
def test_sink_constraints(base, sink, over, match):
    q = base["q"]
    if over.get("input_layout") == "BSH":
        q = q.reshape(1, 3, 8 * 64)
        over = dict(over, actual_seq_qlen=None, actual_seq_kvlen=[40])
        with pytest.raises(RuntimeError, match=match):
            _call(base, FIA2, q=q, learnable_sink=sink, block_table=base["table"][:1], **over)
        return
    with pytest.raises(RuntimeError, match=match):
        _call(base, FIA2, learnable_sink=sink, **over)


def test_sink_head_dim_must_be_64_or_128():
    gen = torch.Generator().manual_seed(20)
    case = tnd_case([(2, 20)], 4, 1, 96, gen)
    with pytest.raises(RuntimeError, match=r"learnable_sink requires value head dim D in \{64, 128\}, got 96"):
        FIA2(case["q"], case["kc"], case["vc"], num_query_heads=4, num_key_value_heads=1, input_layout="TND",
             atten_mask=TEMPLATE, sparse_mode=3, block_table=case["table"], block_size=128,
             actual_seq_qlen=case["cum"], actual_seq_kvlen=case["kvlens"], learnable_sink=torch.zeros(4))


def test_dtype_shape_and_contiguity_limits(base, monkeypatch):
    with pytest.raises(RuntimeError, match="query must be float16 or bfloat16"):
        _call(base, q=base["q"].double())
    with pytest.raises(RuntimeError, match="key dtype torch.bfloat16 must equal the query dtype"):
        _call(base, k=base["kc"].bfloat16())
    # strided query/key/value: computed on their values (ACCEPT_STRIDED_QKV: upstream passes a strided value view on
    # hardware), the pages' refusal when it is off; a strided atten_mask is refused either way
    q = base["q"]
    wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 64, dtype=q.dtype)
    wide[..., 32:32 + q.shape[2]] = q
    strided = wide[..., 32:32 + q.shape[2]]
    assert not strided.is_contiguous() and torch.equal(strided, q)
    assert torch.equal(_call(base, q=strided)[0], _call(base)[0])
    monkeypatch.setattr(A, "ACCEPT_STRIDED_QKV", False)
    with pytest.raises(RuntimeError, match="query must be contiguous"):
        _call(base, q=strided)
    monkeypatch.setattr(A, "ACCEPT_STRIDED_QKV", True)
    with pytest.raises(RuntimeError, match="atten_mask must be contiguous"):
        _call(base, fn=FIA2, atten_mask=TEMPLATE.t().contiguous().t())
    gen = torch.Generator().manual_seed(21)
    case40 = tnd_case([(1, 5)], 2, 1, 40, gen)
    with pytest.raises(RuntimeError, match="D=40 must be a positive multiple of 16"):
        FIA(case40["q"], case40["kc"], case40["vc"], **_v1_kwargs(case40, num_heads=2))
    case24 = tnd_case([(1, 30)], 8, 1, 64, gen, block_size=24)
    with pytest.raises(RuntimeError, match=r"block_size \(24\) must be a multiple of 16"):
        FIA(case24["q"], case24["kc"], case24["vc"], **_v1_kwargs(case24, block_size=24))
    monkeypatch.setattr(A, "ACCEPT_FLOAT32", False)
    with pytest.raises(RuntimeError, match=r"query must be float16 or bfloat16, got torch.float32"):
        _call(base)


def test_bsh_prefill_block_size_rule():
    gen = torch.Generator().manual_seed(22)
    kc, table = make_paged([rand(gen, 70, 1, 64)], 64, 1, gen)
    with pytest.raises(RuntimeError, match=r"block_size \(64\) must be a multiple of 128 in \[128, 512\]"):
        FIA(rand(gen, 1, 4, 8 * 64), kc, kc, num_heads=8, num_key_value_heads=1, input_layout="BSH",
            block_size=64, block_table=table, actual_seq_lengths_kv=[70], atten_mask=TEMPLATE, sparse_mode=3)


def test_unemulated_features_raise_not_emulated(base):
    with pytest.raises(NotEmulatedError, match="pse_shift"):
        _call(base, pse_shift=torch.zeros(1))
    with pytest.raises(NotEmulatedError, match="NTD_TND"):
        _call(base, input_layout="NTD_TND")


# ------------------------------------------------------------------------------------------------
# performance: 36 layers x a few hundred tokens
# ------------------------------------------------------------------------------------------------

def test_36_layers_of_a_few_hundred_tokens_is_fast():
    """GPT-OSS-120b shapes (64:8 heads, D=64), 278 tokens: 8 decodes of 400 keys + two prefills, 36 layers."""
    gen = torch.Generator().manual_seed(23)
    case = tnd_case([(1, 400)] * 8 + [(120, 250), (150, 150)], 64, 8, 64, gen)
    sinks = rand(gen, 64)
    t0 = time.perf_counter()
    for layer in range(36):
        FIA2(case["q"], case["kc"], case["vc"], num_query_heads=64, num_key_value_heads=8, input_layout="TND",
             pre_tokens=127 if layer % 2 else INT_MAX, next_tokens=0, atten_mask=TEMPLATE,
             sparse_mode=4 if layer % 2 else 3, softmax_scale=0.125, block_table=case["table"], block_size=128,
             actual_seq_qlen=case["cum"], actual_seq_kvlen=case["kvlens"], learnable_sink=sinks)
    elapsed = time.perf_counter() - t0
    assert elapsed < 20, f"36 layers took {elapsed:.1f}s"
