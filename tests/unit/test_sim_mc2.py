"""MC2's ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` on the simulated Atlas A3 (docs/operators.md §4.5): two
EP ranks in two processes, each with its own tokens and top-k experts, 8 experts (4 per rank), H = 1024.

Between dispatch and combine each rank applies a different function per expert to the rows it received, using only
what dispatch returned (``expert_token_nums`` says which rows belong to which local expert), with device ops only.
The result must equal the
token-by-token computation ``Σ_k w[t, k] · f_{id[t, k]}(x[t])`` done on the sending rank - so every row went to the
rank and expert it was routed to and came back to its own token. Also: a padded batch (``x_active_mask``), the same
three operators captured in an NPU graph and replayed on new tokens (the exchange runs again), and the documented
limits (H below 1024, an A2 device, a repeated expert id, float32 without the simulator's extension) refused; and
HCCL's all-gather of pieces of different sizes (AllGatherV), which the simulated ``hccl`` group runs over gloo.
"""

import textwrap

import pytest
from sim_ranks import run_two_ranks

_WORKER = textwrap.dedent(r"""
    import json, sys
    import torch
    from gptoss_patch_testkit import npu_sim
    npu_sim.install()
    import torch.distributed as dist
    import torch_npu
    from gptoss_patch_testkit.npu_sim import device
    from gptoss_patch_testkit.npu_sim._base import NotEmulatedError

    rank = int(sys.argv[1])
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
    ep = dist.new_group([0, 1], backend="hccl")
    name = ep._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank(ep))
    out = {"soc": torch_npu.npu.get_soc_version(), "name": name,
           "same_name": ep._get_backend(torch.device("npu")).get_hccl_comm_name(rank + 5) == name}
    E, K, H, L = 8, 4, 1024, 4

    def tokens(seed, bs):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(bs, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)]).to(torch.int32)
        w = torch.rand(bs, K, generator=g)
        return x, ids, w

    def f(e, rows):  # a different function per global expert id
        return (rows.float() * (e + 1) + 0.25 * e).to(torch.bfloat16)

    def reference(x, ids, w):
        ref = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for k in range(K):
                ref[t] += w[t, k] * f(int(ids[t, k]), x[t]).float()
        return ref.to(torch.bfloat16)

    def moe(x, ids, w, mask=None):
        expand_x, dyn, assist, nums, ep_recv, tp_recv, exp_scales = torch_npu.npu_moe_distribute_dispatch_v2(
            x=x, expert_ids=ids, group_ep=name, ep_world_size=2, ep_rank_id=rank, moe_expert_num=E,
            expert_shard_type=0, shared_expert_rank_num=0, global_bs=0, expert_token_nums_type=0, scales=None,
            quant_mode=0, group_tp=name, tp_world_size=1, tp_rank_id=0, x_active_mask=mask)
        # which local expert each row belongs to, from the prefix sums (type 0) alone, on the device (no host read,
        # so a captured graph recomputes it at replay, as a grouped matmul reads its group list)
        local = torch.searchsorted(nums, torch.arange(expand_x.shape[0]), right=True).clamp(max=L - 1)
        e = (rank * L + local).unsqueeze(1).float()
        y = (expand_x.float() * (e + 1) + 0.25 * e).to(torch.bfloat16)
        ends = nums.tolist()
        combined = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=y, expert_ids=ids, assist_info_for_combine=assist, ep_send_counts=ep_recv,
            expert_scales=w, group_ep=name, ep_world_size=2, ep_rank_id=rank, moe_expert_num=E,
            tp_send_counts=tp_recv, expand_scales=exp_scales, group_tp=name, tp_world_size=1, tp_rank_id=0,
            expert_shard_type=0, shared_expert_rank_num=0, global_bs=0, x_active_mask=mask)
        shapes = {"expand_x": list(expand_x.shape), "assist": list(assist.shape), "nums": [nums.dtype == torch.int64,
                  len(ends)], "ep_recv": list(ep_recv.shape), "tp_recv": [list(tp_recv.shape), str(tp_recv.dtype)],
                  "unwritten_nan": bool(torch.isnan(expand_x[ends[-1]:].float()).all()),
                  "none": [dyn is None, exp_scales is None]}
        return combined, shapes, ends[-1]

    def err(x, ids, w):
        return float((moe(x, ids, w)[0].float() - reference(x, ids, w).float()).abs().max())

    # 1. unequal routing, full batch: every row back to its token
    x, ids, w = tokens(10 + rank, 6)
    combined, shapes, received = moe(x, ids, w)
    out["plain"] = {"err": float((combined.float() - reference(x, ids, w).float()).abs().max()),
                    "scale": float(reference(x, ids, w).float().abs().max()), "shapes": shapes,
                    "received": received}
    # 2. a padded batch: the last two tokens inactive - their expert rows are not sent and their output is unwritten
    x, ids, w = tokens(20 + rank, 5)
    mask = torch.tensor([True, True, True, False, False])
    combined, shapes, received = moe(x, ids, w, mask)
    out["masked"] = {"err": float((combined[:3].float() - reference(x[:3], ids[:3], w[:3]).float()).abs().max()),
                     "scale": float(reference(x[:3], ids[:3], w[:3]).float().abs().max()),
                     "unwritten_nan": bool(torch.isnan(combined[3:].float()).all()), "received": received}
    # 3. captured in an NPU graph, replayed on other tokens: the exchange is part of the replay
    x, ids, w = tokens(30 + rank, 4)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=torch.npu.Stream()):
        captured, _, _ = moe(x, ids, w)
    x2, ids2, w2 = tokens(40 + rank, 4)
    x.copy_(x2); ids.copy_(ids2); w.copy_(w2)
    g.replay()
    torch.npu.synchronize()
    out["graph"] = {"err": float((captured.float() - reference(x2, ids2, w2).float()).abs().max()),
                    "scale": float(reference(x2, ids2, w2).float().abs().max()),
                    "nodes": [n for n in g.sim_recorded_ops if "distribute" in n]}
    # 4. HCCL's AllGatherV: all_gather into outputs of different sizes (vllm-ascend's All2All finalize at an odd
    #    token count), which gloo alone refuses
    mine = torch.full((3 - rank, 4), float(rank + 1))
    outs = [torch.empty(3, 4), torch.empty(2, 4)]
    dist.all_gather(outs, mine, group=ep)
    out["gather_v"] = [o[:, 0].tolist() for o in outs]
    # 5. ranks with different BS (rank 0: 5 tokens, rank 1: 3): global_bs = max BS * ep_world_size is required
    x, ids, w = tokens(50 + rank, 5 - 2 * rank)
    def uneven(gbs):
        ex, _, assist, nums, ep_recv, tp_recv, _ = torch_npu.npu_moe_distribute_dispatch_v2(
            x, ids, name, 2, rank, E, global_bs=gbs, expert_token_nums_type=0, tp_world_size=1)
        local = torch.searchsorted(nums, torch.arange(ex.shape[0]), right=True).clamp(max=L - 1)
        e = (rank * L + local).unsqueeze(1).float()
        y = (ex.float() * (e + 1) + 0.25 * e).to(torch.bfloat16)
        return torch_npu.npu_moe_distribute_combine_v2(y, ids, assist, ep_recv, w, name, 2, rank, E,
                                                       tp_send_counts=tp_recv, global_bs=gbs, tp_world_size=1)
    got = uneven(10)
    out["uneven_bs"] = {"err": float((got.float() - reference(x, ids, w).float()).abs().max()),
                        "scale": float(reference(x, ids, w).float().abs().max()), "rows": list(got.shape)}
    # 6. documented limits and what is not emulated
    def refused(fn):
        try:
            fn()
        except (RuntimeError, NotEmulatedError) as e:
            return f"{type(e).__name__}: {e}"
        return "ran"
    small = torch.zeros(2, 64, dtype=torch.bfloat16)
    two = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out["h64"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(small, two, name, 2, rank, E))
    out["repeat"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H, dtype=torch.bfloat16), torch.tensor([[1, 1], [2, 3]], dtype=torch.int32), name, 2, rank, E))
    out["unknown_group"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H, dtype=torch.bfloat16), two, "no-such-comm", 2, rank, E))
    out["quant"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H, dtype=torch.bfloat16), two, name, 2, rank, E, quant_mode=2))
    from gptoss_patch_testkit.npu_sim.ops import moe_distribute
    out["float32"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H), two, name, 2, rank, E))  # the simulator's extension: runs (and exchanges with the peer)
    moe_distribute.ACCEPT_FLOAT32 = False
    out["float32_real"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H), two, name, 2, rank, E))
    moe_distribute.ACCEPT_FLOAT32 = True
    out["uneven_no_global_bs"] = refused(lambda: uneven(0))
    # a refusal on one rank only (a repeated id on rank 1) raises on both, instead of leaving rank 0 waiting
    bad = torch.tensor([[0, 1], [2, 3]] if rank == 0 else [[1, 1], [2, 3]], dtype=torch.int32)
    out["one_rank_refused"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H, dtype=torch.bfloat16), bad, name, 2, rank, E))
    # combine: what it must refuse
    x, ids, w = tokens(60 + rank, 4)
    ex, _, assist, nums, ep_recv, tp_recv, _ = torch_npu.npu_moe_distribute_dispatch_v2(x, ids, name, 2, rank, E)
    out["combine_2d_mask"] = refused(lambda: torch_npu.npu_moe_distribute_combine_v2(
        ex, ids, assist, ep_recv, w, name, 2, rank, E, x_active_mask=torch.ones(4, K, dtype=torch.bool)))
    out["combine_counts_shape"] = refused(lambda: torch_npu.npu_moe_distribute_combine_v2(
        ex, ids, assist, ep_recv[:-1], w, name, 2, rank, E))
    wide = torch.zeros(ex.shape[0], 8192, dtype=torch.bfloat16)
    out["combine_h8192"] = refused(lambda: torch_npu.npu_moe_distribute_combine_v2(
        wide, ids, assist, ep_recv, w, name, 2, rank, E))
    # the rows went out for all four tokens; a combine told that the last two were inactive gets rows it did not expect
    out["combine_other_mask"] = refused(lambda: torch_npu.npu_moe_distribute_combine_v2(
        ex, ids, assist, ep_recv, w, name, 2, rank, E, x_active_mask=torch.tensor([True, True, False, False])))
    device.SOC_VERSION, soc = 220, device.SOC_VERSION
    out["a2"] = refused(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
        torch.zeros(2, H, dtype=torch.bfloat16), two, name, 2, rank, E))
    device.SOC_VERSION = soc
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def ranks():
    return run_two_ranks(_WORKER, GPTOSS_PATCH_SIM_SOC_VERSION="250")  # Ascend910_9391: an Atlas A3


def test_every_row_goes_to_its_expert_and_comes_back_to_its_token(ranks):
    for r in ranks:
        assert r["soc"] == 250 and r["name"].startswith("gptoss-sim-hccl-") and r["same_name"]
        plain = r["plain"]
        # bfloat16 outputs of a sum of 4 terms of magnitude ~scale: a few units in the last place
        assert plain["err"] <= 2 ** -6 * plain["scale"], plain
        assert plain["shapes"]["expand_x"] == [6 * 2 * 4, 1024]  # A = BS * ep_world_size * min(L, K)
        assert plain["shapes"]["assist"] == [6 * 2 * 4 * 128]
        assert plain["shapes"]["nums"] == [True, 4] and plain["shapes"]["ep_recv"] == [2 * 4]
        assert plain["shapes"]["tp_recv"] == [[1], "torch.int32"] and plain["shapes"]["none"] == [True, True]
        assert plain["shapes"]["unwritten_nan"]
    # 6 tokens x 4 experts on each rank = 48 (token, expert) rows in all, each delivered exactly once
    assert sum(r["plain"]["received"] for r in ranks) == 2 * 6 * 4


def test_inactive_tokens_are_not_sent(ranks):
    for r in ranks:
        assert r["masked"]["err"] <= 2 ** -6 * r["masked"]["scale"] and r["masked"]["unwritten_nan"], r["masked"]
    assert sum(r["masked"]["received"] for r in ranks) == 2 * 3 * 4


def test_a_captured_exchange_runs_again_at_replay(ranks):
    for r in ranks:
        assert r["graph"]["nodes"] == ["npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"], r["graph"]
        assert r["graph"]["err"] <= 2 ** -6 * r["graph"]["scale"], r["graph"]


def test_all_gather_of_uneven_pieces_on_an_hccl_group(ranks):
    for r in ranks:
        assert r["gather_v"] == [[1.0, 1.0, 1.0], [2.0, 2.0]]


def test_ranks_with_different_batch_sizes(ranks):
    for r in ranks:
        assert r["uneven_bs"]["err"] <= 2 ** -6 * r["uneven_bs"]["scale"], r["uneven_bs"]
        assert "global_bs must be max BS * ep_world_size = 10, got 0" in r["uneven_no_global_bs"]
    assert [r["uneven_bs"]["rows"] for r in ranks] == [[5, 1024], [3, 1024]]


def test_combine_refuses_what_does_not_match_dispatch(ranks):
    for r in ranks:
        assert "x_active_mask must be 1-D" in r["combine_2d_mask"]
        assert "ep_send_counts has shape (7,), expected (8,)" in r["combine_counts_shape"]
        assert "H 8192 is out of range [1024, 7168]" in r["combine_h8192"]
        assert "do not match this rank's active (token, k) slots" in r["combine_other_mask"]


def test_a_call_refused_on_one_rank_raises_on_every_rank(ranks):
    assert "the K expert ids of token 0 repeat" in ranks[1]["one_rank_refused"]
    assert "another rank's call was refused" in ranks[0]["one_rank_refused"]


def test_documented_limits_are_refused(ranks):
    for r in ranks:
        assert r["h64"].startswith("RuntimeError") and "H 64 is out of range [1024, 8192]" in r["h64"]
        assert r["repeat"].startswith("RuntimeError") and "repeat" in r["repeat"]
        assert "no HCCL communicator named 'no-such-comm'" in r["unknown_group"]
        assert r["quant"].startswith("NotEmulatedError") and "quant_mode=2" in r["quant"]
        assert r["a2"].startswith("NotEmulatedError") and "Atlas A3" in r["a2"]
        assert r["float32"] == "ran"  # the simulator extension (docs/operators.md section 2)
        assert r["float32_real"].startswith("RuntimeError") and "bfloat16 or float16" in r["float32_real"]
