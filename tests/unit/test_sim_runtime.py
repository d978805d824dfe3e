"""The simulator pieces vLLM's real engine needs: device memory accounting, the ``hccl`` backend, ATB's warm-up
operator, and operators that stay single nodes under TorchDynamo (docs/simulator.md)."""

import datetime

import pytest
import torch

from gptoss_patch_testkit import npu_sim

torch_npu = npu_sim.install()
from gptoss_patch_testkit.npu_sim import runtime  # noqa: E402


def test_capacity_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPTOSS_PATCH_SIM_NPU_MEMORY", "3GiB")
    assert runtime.capacity_bytes() == 3 << 30
    monkeypatch.setenv("GPTOSS_PATCH_SIM_NPU_MEMORY", "1048576")
    assert runtime.capacity_bytes() == 1 << 20
    for bad in ("0", "-1", "8GB", "lots"):
        monkeypatch.setenv("GPTOSS_PATCH_SIM_NPU_MEMORY", bad)
        with pytest.raises(ValueError, match="GPTOSS_PATCH_SIM_NPU_MEMORY"):
            runtime.capacity_bytes()


def test_memory_accounting_follows_what_the_process_holds(monkeypatch):
    monkeypatch.setenv("GPTOSS_PATCH_SIM_NPU_MEMORY", "16GiB")
    free0, total = torch.npu.mem_get_info()
    assert total == 16 << 30 and free0 + runtime.memory_allocated() == total
    before = torch.npu.memory_stats()["allocated_bytes.all.current"]
    block = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, touched
    grown = torch.npu.memory_stats()["allocated_bytes.all.current"] - before
    assert grown >= 200 << 20, grown
    free1, _ = torch.npu.mem_get_info()
    assert free0 - free1 >= 200 << 20
    assert torch.npu.memory_reserved() == runtime.memory_allocated()
    assert torch.npu.max_memory_allocated() >= runtime.memory_allocated()
    del block


def test_out_of_simulated_memory_is_an_error(monkeypatch):
    keep = torch.ones(64 << 20, dtype=torch.float32)
    monkeypatch.setenv("GPTOSS_PATCH_SIM_NPU_MEMORY", "1MiB")
    with pytest.raises(RuntimeError, match="simulated NPU out of memory"):
        torch.npu.mem_get_info()
    del keep


def test_atb_extensions_register_nothing():
    n = runtime.atb_registered()
    torch_npu.op_plugin.atb._atb_ops._register_atb_extensions()
    assert runtime.atb_registered() == n + 1
    assert not hasattr(torch.ops.atb, "_npu_paged_attention")  # no ATB operator appears


def test_matmul_add_fp32_against_its_definition():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 3, generator=g).half(), torch.randn(5, 4, generator=g).half()
    c = torch.randn(3, 4, generator=g)
    expected = c + x.float().T @ w.float()
    assert torch_npu._npu_matmul_add_fp32(x, w, c) is c
    torch.testing.assert_close(c, expected)
    with pytest.raises(RuntimeError, match="float32"):
        torch_npu._npu_matmul_add_fp32(x, w, c.half())
    with pytest.raises(RuntimeError, match="need x"):
        torch_npu._npu_matmul_add_fp32(x, w[:4], c)


def test_hccl_process_group_all_reduces_like_hccl(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("hccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
        opts.hccl_config = {"hccl_buffer_size": 200}
        group = dist.new_group([0], backend="hccl", pg_options=opts)
        t = torch.arange(4.0)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.arange(4.0))  # the sum over one rank
        out = [torch.empty(4)]
        dist.all_gather(out, torch.arange(4.0), group=group)
        assert torch.equal(out[0], torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_accelerator_layer_knows_the_simulated_npu():
    assert torch.accelerator.current_accelerator().type == "npu"
    s = torch.accelerator.current_stream(torch.device("npu", 0))
    assert s.device_index == 0
    assert torch.zeros(3, pin_memory=True).tolist() == [0.0, 0.0, 0.0]
    # vLLM 0.18's capture_model synchronizes the accelerator; PyTorch's C++ path needs a device-guard method the
    # Python registration cannot provide, the simulator answers it (every operator has run on the host already)
    with pytest.raises(RuntimeError, match="synchroniz"):
        torch._C._accelerator_synchronizeDevice(0)
    assert torch.accelerator.synchronize() is None and torch.accelerator.synchronize(0) is None


def test_operators_in_compiled_regions_are_single_graph_nodes():
    """Under torch.compile the emulated rms_norm / rotary are one custom-operator node each and give the eager
    numbers; the in-place rotary writes back into query/key."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(x, gamma, positions, q, k, cache):
        y, _ = torch_npu.npu_rms_norm(x, gamma, 1e-5)
        torch_npu._npu_rotary_embedding(positions, q, k, 8, cache, True)
        return y * 2, q + 0, k + 0

    g = torch.Generator().manual_seed(0)
    x, gamma = torch.randn(6, 16, generator=g), torch.rand(16, generator=g) + 0.5
    positions = torch.tensor([0, 1, 2, 5, 9, 3])
    cache = torch.randn(16, 8, generator=g)
    q, k = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
    eager = f(x, gamma, positions, q.clone(), k.clone(), cache)
    q2, k2 = q.clone(), k.clone()
    compiled = torch.compile(f, backend=backend, fullgraph=True)(x, gamma, positions, q2, k2, cache)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(q2, eager[1])
    assert any("gptoss_sim.npu_rms_norm" in t for t in seen), seen
    assert any("gptoss_sim._npu_rotary_embedding" in t for t in seen), seen


def test_custom_op_aliasing_check_warns_under_ci_as_on_a_shell():
    """torch 2.13 raises on a custom op returning its input only when ``CI`` is set; with the simulator it warns in
    both (vllm-ascend 0.12-0.14's ``maybe_pad_and_reduce`` at TP 1 did that, and CI's run failed on it). Checked in a
    fresh interpreter with ``CI=1``, once without the simulator (the raise) and once with it."""
    import os
    import subprocess
    import sys

    probe = (  # defined as vLLM's direct_register_custom_op does (a Library fragment, a CPU kernel, a fake kernel)
        "import torch, warnings\n"
        "lib = torch.library.Library('gptoss_probe', 'FRAGMENT')\n"
        "lib.define('same(Tensor x) -> Tensor')\n"
        "lib.impl('same', lambda x: x, 'CPU')\n"
        "torch.library.register_fake('gptoss_probe::same', lambda x: torch.empty_like(x), lib=lib)\n"
        "f = torch.compile(lambda x: torch.ops.gptoss_probe.same(x) + 1, backend='aot_eager')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    try:\n"
        "        f(torch.ones(3))\n"
        "        print('warned' if any('alias' in str(x.message) for x in w) else 'silent')\n"
        "    except RuntimeError as e:\n"
        "        print('raised' if 'alias' in str(e) else 'other')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING"}
    env["CI"] = "1"
    plain = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    sim = subprocess.run([sys.executable, "-c", "from gptoss_patch_testkit import npu_sim; npu_sim.install()\n" + probe],
                         env=env, capture_output=True, text=True, timeout=300)
    assert plain.stdout.strip() == "raised", plain.stdout + plain.stderr[-2000:]
    assert sim.stdout.strip() == "warned", sim.stdout + sim.stderr[-2000:]


def test_weak_ref_tensor_aliases_the_memory_and_rejects_non_tensors():
    """``torch_npu._C._weak_ref_tensor`` (vllm-ascend 0.16.0rc1+ ``utils.weak_ref_tensor``): same memory, shape and
    strides - a write through either shows in the other - and a clear error for a non-tensor."""
    import torch_npu

    t = torch.arange(12.0).view(3, 4)[:, 1:]
    w = torch_npu._C._weak_ref_tensor(t)
    assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and w.stride() == t.stride()
    t[0, 0] = -1.0
    assert w[0, 0].item() == -1.0
    with pytest.raises(TypeError, match="expects a torch.Tensor, got list"):
        torch_npu._C._weak_ref_tensor([t])


def test_torchair_register_replacement_records_without_rewriting():
    """``torchair.register_replacement`` stores the pattern for the npugraph_ex compiler and returns None; the
    simulator never runs that compiler, so the record is all there is (and nothing is traced or rewritten)."""
    import torchair

    from gptoss_patch_testkit.npu_sim import graph

    before = len(graph.TORCHAIR_REPLACEMENTS)
    calls = []

    def search(x):
        calls.append("search")
        return x * 2

    def replace(x):
        calls.append("replace")
        return x + x

    assert torchair.register_replacement(search_fn=search, replace_fn=replace, example_inputs=[torch.ones(2)]) is None
    entry = graph.TORCHAIR_REPLACEMENTS[before]
    assert entry["search_fn"] is search and entry["replace_fn"] is replace and calls == []


def _with_and_without_hook(tmp_path, files: dict[str, str], setup: str, expr: str, hooks: str) -> str:
    """Write stand-in upstream modules (``files``: path under ``tmp_path`` -> source; empty ``__init__.py`` files are
    added for their packages), then, after ``npu_sim.install()`` and ``setup``, print ``expr`` in two fresh
    interpreters with them on PYTHONPATH: as installed, and with the post-import hooks of the modules named by the
    expression ``hooks`` (read from ``npu_sim.device``) removed first. Asserts that the run without the hooks failed
    on PyTorch's 'npu' (PrivateUse1) backend; returns what the hooked run printed."""
    import os
    import subprocess
    import sys

    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in path.relative_to(tmp_path).parents:
            if str(parent) != ".":
                (tmp_path / parent / "__init__.py").touch()
    head = ("from gptoss_patch_testkit import npu_sim\n"
            "npu_sim.install()\n"
            "from gptoss_patch_testkit.npu_sim import device\n")
    undo = ("import wrapt.importer as wi\n"
            f"for name in {hooks}: wi._post_import_hooks.pop(name, None)\n")
    body = setup + f"try:\n    print({expr})\nexcept Exception as e:\n    print('failed: ' + str(e)[:80])\n"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    hooked, bare = (subprocess.run([sys.executable, "-c", head + extra + body], env=env, capture_output=True,
                                   text=True, timeout=300) for extra in ("", undo))
    assert bare.stdout.strip().startswith("failed:") and "npu" in bare.stdout, bare.stdout + bare.stderr[-2000:]
    return hooked.stdout.strip() + ("" if hooked.returncode == 0 else hooked.stderr[-2000:])


def test_fusion_pass_setup_allocates_on_the_simulated_npu_where_dynamo_set_the_mapping_aside(tmp_path):
    """vllm-ascend's ``GraphFusionPassManager.configure`` allocates pattern inputs with ``device="npu"`` from vLLM's
    compile backend, where TorchDynamo has set the torch function modes aside. A stand-in module at the real module
    path does the same (its ``configure`` pops the mapping mode first): it fails on PyTorch's PrivateUse1 backend
    without the simulator's hook, and allocates host tensors with it."""
    printed = _with_and_without_hook(
        tmp_path,
        {"vllm_ascend/compilation/graph_fusion_pass_manager.py":
            "import torch\n"
            "class GraphFusionPassManager:\n"
            "    def configure(self, config):\n"
            "        with torch.overrides._pop_mode_temporarily():  # what the compile backend sees: no mapping mode\n"
            "            return torch.randn(2, 8, device='npu').device.type\n"},
        "from vllm_ascend.compilation.graph_fusion_pass_manager import GraphFusionPassManager\n",
        "GraphFusionPassManager().configure(None)", "[device.FUSION_PASS_SETUP[0]]")
    assert printed == "cpu", printed


def test_integer_histc_counts_like_aclnnhistc_where_cpu_torch_has_no_kernel():
    """``torch.histc`` on int32 expert ids (vllm-ascend's All2All dispatcher): CANN's aclnnHistc takes integers,
    PyTorch's CPU kernel does not. With the simulator's mapping the counts equal ``bincount`` (bins = experts, bounds
    inclusive), in the input's dtype; values outside the bounds are not counted; ``min == max`` takes the tensor's own
    extremes; bad bounds are refused naming them."""
    from gptoss_patch_testkit.npu_sim.aten import integer_histc

    ids = torch.tensor([[0, 3], [1, 1], [3, 2], [1, 0]], dtype=torch.int32)
    with torch._C.DisableTorchFunction(), pytest.raises(RuntimeError, match="histogram_cpu|not implemented"):
        torch.histc(ids, bins=4, min=0, max=3)  # PyTorch's own CPU kernel
    got = torch.histc(ids, bins=4, min=0, max=3)
    assert got.dtype == torch.int32 and got.tolist() == torch.bincount(ids.flatten(), minlength=4).tolist() == [2, 3, 1, 2]
    assert ids.histc(bins=2, min=1, max=2).tolist() == [3, 1]  # 0 and 3 are outside [1, 2]
    assert integer_histc(torch.tensor([5, 7, 9], dtype=torch.int64), bins=2, min=0, max=0).tolist() == [1, 2]
    with pytest.raises(RuntimeError, match=r"min \(3\) must not be greater than max \(1\)"):
        integer_histc(ids, bins=4, min=3, max=1)
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        integer_histc(ids, bins=0)


def test_custom_op_kernels_allocate_on_the_simulated_npu(tmp_path):
    """A Python custom-op kernel registered through vLLM's ``direct_register_custom_op`` and called through
    ``torch.ops`` (where the mapping mode is off while the op runs) allocates with ``device=torch.npu.current_device()``,
    as vllm-ascend's ``async_all_to_all`` does: host memory with the simulator's hook, PyTorch's PrivateUse1 backend
    error without it. A stand-in ``vllm.utils.torch_utils`` registers the op as vLLM does (a Library fragment, the
    schema inferred from the function)."""
    printed = _with_and_without_hook(
        tmp_path,
        {"vllm/utils/torch_utils.py":
            "import torch\n"
            "lib = torch.library.Library('gptoss_probe_vllm', 'FRAGMENT')\n"
            "def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, dispatch_key='CPU'):\n"
            "    lib.define(op_name + torch.library.infer_schema(op_func, mutates_args=mutates_args or []))\n"
            "    lib.impl(op_name, op_func, dispatch_key)\n"},
        "import torch\n"
        "from vllm.utils.torch_utils import direct_register_custom_op\n"
        "def alloc(x: torch.Tensor) -> torch.Tensor:\n"
        "    return torch.zeros(3, device=torch.npu.current_device()) + x.sum()\n"
        "direct_register_custom_op('alloc', alloc)\n",
        "torch.ops.gptoss_probe_vllm.alloc(torch.ones(2)).tolist()", "device.CUSTOM_OP_REGISTRARS")
    assert printed == "[2.0, 2.0, 2.0]", printed


def test_simulated_modules_can_be_reloaded_after_a_programmatic_install():
    """vllm-ascend >= 0.15's worker patch reloads ``torchair.fx_summary``; ``importlib.reload`` needs a meta-path
    finder for it, also when the simulator came from ``npu_sim.install()`` rather than the start-up variable."""
    import os
    import subprocess
    import sys

    probe = ("import importlib, sys\n"
             "from gptoss_patch_testkit import npu_sim\n"
             "npu_sim.install()\n"
             "import torchair.fx_summary\n"
             "m = importlib.reload(sys.modules['torchair.fx_summary'])\n"
             "print(m is sys.modules['torchair.fx_summary'], importlib.util.find_spec('torchair.fx_summary') is not None)\n")
    env = {k: v for k, v in os.environ.items() if k != "GPTOSS_PATCH_SIMULATE_NPU"}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "True True", proc.stdout + proc.stderr[-2000:]
