"""Collectives of the simulated ``hccl`` backend inside NPU graphs (docs/simulator.md §7): two ranks in two processes,
each captures a graph that holds an all-reduce, changes its input, replays, and must see the new sum - as HCCL tasks
captured into an ACL graph do. A collective on a gloo (host) group is host work: it ran at capture and is not replayed.

Before graph capture recorded collectives, vLLM's PIECEWISE graphs at tensor parallel 2 replayed without their
all-reduces and served wrong tokens; this is the operator-level proof of the fix.
"""

import textwrap

import pytest
from sim_ranks import run_two_ranks

_WORKER = textwrap.dedent(r"""
    import json, os, sys
    import torch
    from gptoss_patch_testkit import npu_sim
    npu_sim.install()
    import torch.distributed as dist

    rank = int(sys.argv[1])
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
    host = dist.new_group([0, 1], backend="gloo")
    out = {"available": dist.is_backend_available("hccl"), "backend": dist.get_backend()}

    def run(kind):
        x = torch.full((4,), float(rank + 1), device="npu")
        y = torch.empty(4, device="npu")
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, stream=torch.npu.Stream()):
            y.copy_(x * 2)
            if kind == "hccl":
                dist.all_reduce(y)
            elif kind == "functional":
                r = torch.ops._c10d_functional.all_reduce(y, "sum", dist.group.WORLD.group_name)
                y.copy_(torch.ops._c10d_functional.wait_tensor(r))
            elif kind == "functional_gloo":
                r = torch.ops._c10d_functional.all_reduce(y, "sum", host.group_name)
                y.copy_(torch.ops._c10d_functional.wait_tensor(r))
            else:
                dist.all_reduce(y, group=host)
        captured = y.tolist()
        x.fill_(10.0 * (rank + 1))
        g.replay()
        torch.npu.synchronize()
        return {"captured": captured, "replayed": y.tolist(),
                "hccl_nodes": sum(n.startswith("hccl.") for n in g.sim_recorded_ops)}

    for kind in ("hccl", "functional", "gloo", "functional_gloo"):
        out[kind] = run(kind)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def ranks():
    return run_two_ranks(_WORKER)


def test_hccl_is_the_backend_vllm_gets(ranks):
    for r in ranks:
        assert r["available"] is True and r["backend"] == "hccl"


@pytest.mark.parametrize("kind", ["hccl", "functional"])
def test_a_captured_all_reduce_runs_again_at_replay(ranks, kind):
    # capture: 2*1 + 2*2 = 6; replay after x <- 10*(rank+1): 2*10 + 2*20 = 60 on both ranks
    for r in ranks:
        assert r[kind]["captured"] == [6.0] * 4
        assert r[kind]["replayed"] == [60.0] * 4
        assert r[kind]["hccl_nodes"] == 1


def test_a_host_group_collective_is_not_graph_work(ranks):
    # the gloo group's all-reduce ran once at capture; replay recomputes y = 2x on each rank without it
    for rank, r in enumerate(ranks):
        assert r["gloo"]["captured"] == [6.0] * 4
        assert r["gloo"]["replayed"] == [20.0 * (rank + 1)] * 4
        assert r["gloo"]["hccl_nodes"] == 0


def test_a_host_group_functional_collective_is_not_graph_work(ranks):
    # the functional all-reduce on the gloo group wrote its own output once, at capture; the graph's copy of that
    # output into y is replayed and reads the capture-time sum (6), not a new one (60)
    for r in ranks:
        assert r["functional_gloo"]["captured"] == [6.0] * 4
        assert r["functional_gloo"]["replayed"] == [6.0] * 4
        assert r["functional_gloo"]["hccl_nodes"] == 0
