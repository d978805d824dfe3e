"""The simulator's placement audit (npu_sim/placement.py, docs/simulator.md §4.1): under it, host memory reaching the
NPU - an emulated operator given a host tensor, an operation mixing host and NPU tensors - raises, naming the operator
and argument, as a real NPU would refuse it; correctly placed code runs unchanged. Outside the audit nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gptoss_patch_testkit import npu_sim

torch_npu = npu_sim.install()
from gptoss_patch_testkit.npu_sim import device, placement  # noqa: E402
from gptoss_patch_testkit.npu_sim.placement import PlacementError  # noqa: E402


def _cache_args(device_of):
    """``_npu_reshape_and_cache`` arguments (4 blocks of 16 slots, one KV head of 8): each tensor from
    ``device_of(name)`` (``"npu"`` or ``"cpu"``)."""
    shapes = {"key": (3, 1, 8), "value": (3, 1, 8), "key_cache": (4, 16, 1, 8), "value_cache": (4, 16, 1, 8)}
    args = {k: torch.zeros(s, device=device_of(k)) for k, s in shapes.items()}
    args["slot_indices"] = torch.tensor([0, 5, 17], dtype=torch.int32, device=device_of("slot_indices"))
    return args


def test_an_operator_given_host_memory_names_the_argument_and_placed_memory_passes():
    with placement.audit():
        ok = _cache_args(lambda name: "npu")
        ok["key"].fill_(2.0)
        torch_npu._npu_reshape_and_cache(**ok)
        assert torch.equal(ok["key_cache"][0, 5].cpu(), torch.full((1, 8), 2.0))  # it ran, and wrote the slot
        for wrong in ("key", "value_cache", "slot_indices"):
            bad = _cache_args(lambda name, wrong=wrong: "cpu" if name == wrong else "npu")
            with pytest.raises(PlacementError, match=rf"torch_npu\._npu_reshape_and_cache: {wrong} .* host memory"):
                torch_npu._npu_reshape_and_cache(**bad)
        # positional arguments are named too
        bad = _cache_args(lambda name: "cpu" if name == "key" else "npu")
        with pytest.raises(PlacementError, match=r"_npu_reshape_and_cache: key \(3, 1, 8\) float32"):
            torch_npu._npu_reshape_and_cache(*bad.values())


def test_arguments_the_operator_reads_on_the_host_stay_on_the_host():
    """``_npu_paged_attention``'s ``context_lens`` is host memory on the device (ATB hostData; vllm-ascend passes
    ``seq_lens`` from the host): accepted under the audit; a host ``block_table`` is not."""
    with placement.audit():
        n, kvn, d = 8, 1, 64
        kw = dict(query=torch.zeros(2, n, d, device="npu"), key_cache=torch.zeros(4, 128, kvn, d, device="npu"),
                  value_cache=torch.zeros(4, 128, kvn, d, device="npu"), num_kv_heads=kvn, num_heads=n,
                  scale_value=0.125, block_table=torch.tensor([[1], [2]], dtype=torch.int32, device="npu"),
                  context_lens=torch.tensor([3, 5], dtype=torch.int32), out=torch.zeros(2, n, d, device="npu"))
        torch_npu._npu_paged_attention(**kw)
        kw["block_table"] = kw["block_table"].cpu()
        with pytest.raises(PlacementError, match="_npu_paged_attention: block_table"):
            torch_npu._npu_paged_attention(**kw)


def test_mixing_host_and_npu_tensors_raises_and_transfers_do_not():
    with placement.audit():
        a = torch.ones(4, device="npu")
        host = torch.ones(4)
        with pytest.raises(PlacementError, match=r"torch\.add: .*host: \(4,\) float32.*Expected all tensors to be on the same"):
            torch.add(a, host)
        with pytest.raises(PlacementError, match="same device"):
            a * host
        assert (a + torch.tensor(2.0)).tolist() == [3.0] * 4  # a 0-dim host tensor is a scalar
        a.copy_(host * 5)  # copy_ is a transfer
        a[torch.tensor([0, 1])] = torch.zeros(2)  # host index tensors and __setitem__
        assert a.tolist() == [0.0, 0.0, 5.0, 5.0]
        b = host.to("npu")
        assert placement.is_resident(b) and not placement.is_resident(host)
        assert b.data_ptr() != host.data_ptr()  # host and NPU memory are different memory
        torch.add(a, b)
        back = b.cpu()
        assert back.data_ptr() != b.data_ptr() and placement.is_host(back)
        with pytest.raises(PlacementError):
            torch.add(a, back)
        assert placement.is_resident(host.npu())
        assert placement.is_resident(a[1:3]) and placement.is_resident(a.view(2, 2))  # views share the placement
        assert placement.is_resident(torch.cat([a, b]))  # results of NPU inputs
        assert placement.is_resident(a.to(torch.bfloat16))


def test_an_npu_device_object_stays_recognisable_and_a_context_allocates_on_it():
    with placement.audit():
        dev = torch.device("npu")
        assert dev == placement.NPU_MARK
        assert placement.is_resident(torch.zeros(3, device=dev))
        with torch.device("npu"):
            assert placement.is_resident(torch.empty(3))
        assert placement.is_resident(torch.zeros(3, device=0))
        assert placement.is_host(torch.zeros(3)) and placement.is_host(torch.zeros(3, device="cpu"))
        # a device read from a tensor: not judged (Tensor.device answers cpu for every tensor on the simulator)
        t = torch.zeros(3, device=torch.device("cpu"))
        assert not placement.is_host(t) and not placement.is_resident(t)
        torch.add(torch.ones(3, device="npu"), t)
    assert torch.device("npu") == torch.device("cpu")  # outside the audit: the plain mapping


def test_outside_the_audit_nothing_is_checked_and_audits_do_not_nest():
    torch_npu._npu_reshape_and_cache(**_cache_args(lambda name: "cpu"))
    torch.add(torch.ones(2, device="npu"), torch.ones(2))
    host = torch.ones(2)
    assert host.to("npu") is host  # the simulator's plain mapping: the same memory
    with placement.audit():
        with pytest.raises(RuntimeError, match="do not nest"):
            with placement.audit():
                pass
        errors = []

        def other_thread():
            try:  # another thread is not audited
                device.enter_device_mapping()  # (every allocating thread maps the NPU; docs/simulator.md §2)
                torch.add(torch.ones(2, device="npu"), torch.ones(2))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        th = threading.Thread(target=other_thread)
        th.start()
        th.join()
        assert errors == []
    assert not placement.active()


def test_an_operator_result_is_npu_memory():
    with placement.audit():
        x = torch.randn(4, 16, device="npu")
        y = torch_npu.npu_swiglu(x)
        assert placement.is_resident(y)
        torch.add(y, torch.ones(4, 8, device="npu"))


def test_tensors_inside_list_arguments_are_checked():
    """``npu_grouped_matmul`` takes its tensors in lists (``x=[...]``, ``weight=[...]``)."""
    with placement.audit():
        x, w = torch.randn(4, 8, device="npu"), torch.randn(3, 8, 5, device="npu")
        group_list = torch.tensor([1, 2, 1], device="npu")
        y = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                         group_list_type=1)[0]
        assert placement.is_resident(y) and y.shape == (4, 5)
        with pytest.raises(PlacementError, match=r"npu_grouped_matmul: weight \(3, 8, 5\) float32 is in host memory"):
            torch_npu.npu_grouped_matmul([x], [w.cpu()], group_list=group_list, split_item=3, group_type=0,
                                         group_list_type=1)


def test_conversions_keep_or_move_the_placement_as_asked():
    with placement.audit():
        r = torch.ones(4, device="npu")
        assert placement.is_resident(r.to("npu", torch.float16))  # on the NPU already: a dtype conversion there
        assert placement.is_resident(r.to(device="npu", dtype=torch.float64, copy=True))
        assert placement.is_host(r.to("cpu", torch.float64)) and placement.is_host(r.to(torch.ones(1)))
        assert placement.is_resident(torch.ones(2).to(r))  # .to(other): other's placement
        h = torch.ones(4)
        moved = torch.as_tensor(h, device="npu")  # a move is a copy; the host tensor stays host
        assert placement.is_resident(moved) and placement.is_host(h) and moved.data_ptr() != h.data_ptr()
        assert placement.is_host(torch.zeros_like(r, device="cpu"))  # an explicit host device wins over the input
        assert r.device == placement.NPU_MARK and h.device == torch.device("cpu")  # Tensor.device tells them apart
        assert placement.is_resident(torch.empty(2, device=r.device))
        h.copy_(r)  # in place: the destination keeps its placement
        assert placement.is_host(h)
        with pytest.raises(PlacementError):  # a 0-dim NPU tensor is no scalar for host memory
            torch.ones(3) * torch.tensor(2.0, device="npu")


def test_moving_a_module_and_rebinding_parameter_memory():
    with placement.audit():
        lin = torch.nn.Linear(4, 4)
        assert placement.is_host(lin.weight)
        lin.to("npu")
        assert placement.is_resident(lin.weight) and placement.is_resident(lin.bias)
        lin(torch.ones(2, 4, device="npu"))
        with pytest.raises(PlacementError, match=r"linear: .*host: \(2, 4\) float32"):
            lin(torch.ones(2, 4))
        p = torch.nn.Parameter(torch.zeros(4))
        p.data = torch.ones(4, device="npu")  # allowed, as in PyTorch; the parameter is now NPU memory
        assert placement.is_resident(p)


def test_vllm_ascend_kernels_take_npu_tensors():
    """``torch.ops._C_ascend`` (vllm-ascend's compiled kernels; the simulator's registrations, ops/moe.py)."""
    from gptoss_patch_testkit.npu_sim.ops import moe

    moe.register_c_ascend_ops()
    with placement.audit():
        y, idx, _ = torch.ops._C_ascend.moe_gating_top_k(torch.randn(4, 8, device="npu"), 2, 1, 1, 0, 0, 0, False,
                                                         1.0, 1e-20)
        assert placement.is_resident(y) and placement.is_resident(idx)
        with pytest.raises(PlacementError, match=r"_C_ascend\.moe_gating_top_k: argument 0 \(4, 8\) float32 is in host"):
            torch.ops._C_ascend.moe_gating_top_k(torch.randn(4, 8), 2, 1, 1, 0, 0, 0, False, 1.0, 1e-20)


def test_audits_in_a_row_forget_what_they_saw_and_freed_memory_is_forgotten():
    """What an earlier audit registered is not judged by the next (a tensor cached across runs, like the causal mask
    template of kernels/attention.py, is neither host nor NPU memory then); nothing is kept alive."""
    import gc

    with placement.audit():
        cached = torch.ones(4, device="npu")
        host = torch.ones(4)
        gone = torch.ones(8, device="npu")
        ptr = gone.untyped_storage().data_ptr()
        del gone
        gc.collect()
        assert ptr not in placement._place  # freed memory leaves the registry
    assert placement._place == {}
    with placement.audit():
        assert placement.placement_of(cached) is None and placement.placement_of(host) is None
        torch.add(cached, torch.ones(4, device="npu"))  # not judged: no error
        torch_npu.npu_swiglu(torch.cat([cached, cached]).view(2, 4))


def test_the_harness_bring_up_asks_the_torch_npu_present(tmp_path):
    """The harnesses never decide to simulate (``gptoss_patch.selftest.device``): with a real ``torch_npu``
    importable they bring vLLM up on it with HCCL and the simulator stays out; with none, they stop with the hint
    naming the testkit; with the testkit's switch on (``GPTOSS_PATCH_SIMULATE_NPU=1``, its start-up finder) the
    simulator serves and the device group runs on gloo. Here a directory holding a ``torch_npu`` package stands for
    the real one."""
    fake = tmp_path / "site" / "torch_npu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = textwrap.dedent("""
        from gptoss_patch.selftest import device
        from gptoss_patch.selftest import worker as vllm_setup
        from gptoss_patch_testkit import npu_sim
        try:
            vllm_setup._prepare_process()
            state = "ready"
        except ImportError as exc:
            state = "no-npu" if "gptoss-patch-testkit" in str(exc) else repr(exc)
        print(state, npu_sim.is_installed(), device.distributed_backend() if state == "ready" else "-")
    """)
    env = {k: v for k, v in os.environ.items() if k != "GPTOSS_PATCH_SIMULATE_NPU"}

    def run(pythonpath, **extra):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(env, PYTHONPATH=os.pathsep.join(pythonpath), **extra))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    assert run([str(tmp_path / "site"), *sys.path]) == ["ready", "False", "hccl"]
    assert run(sys.path) == ["no-npu", "False", "-"]
    assert run(sys.path, GPTOSS_PATCH_SIMULATE_NPU="1") == ["ready", "True", "gloo"]
