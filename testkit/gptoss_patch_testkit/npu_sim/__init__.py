"""CPU simulator of ``torch_npu`` and ``torchair``, so the real vllm-ascend runs on a host without an NPU.

:func:`install` puts simulated ``torch_npu`` (with ``torch_npu.npu``, ``torch_npu._C``, ...) and
``torchair`` module objects into :data:`sys.modules`, renames PyTorch's PrivateUse1 backend to
``"npu"`` and registers ``torch.npu`` as the same namespace as ``torch_npu.npu`` (as the real
torch_npu does at import), so that the real ``vllm`` and ``vllm_ascend`` import and vLLM's platform
resolves to vllm-ascend's ``NPUPlatform``.

Rules (``docs/simulator.md`` §3-§4, ``docs/operators.md`` §2):

* Every emulated operator lives in :mod:`gptoss_patch_testkit.npu_sim.ops` and implements the
  operator's documented semantics, with the source cited in its docstring.
* Any other attribute is a :class:`~gptoss_patch_testkit.npu_sim._base.NotEmulated` sentinel:
  importing it works, *calling* it raises :class:`NotEmulatedError` naming ``torch_npu.X``.
  Nothing returns made-up values; there is no ``MagicMock``.
* It installs only when asked - by tests, by ``python -m gptoss_patch_testkit.verify``, or process-wide through
  ``GPTOSS_PATCH_SIMULATE_NPU=1`` (honoured by the ``.pth`` start-up hook in every interpreter,
  because vLLM inspects models in child interpreters and starts worker processes) - and it
  refuses when a real ``torch_npu`` is importable, unless forced.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from typing import Any

from gptoss_patch_testkit.npu_sim._base import NotEmulated, NotEmulatedError, not_emulated_class, sim_module

__all__ = ["install", "is_installed", "NotEmulatedError", "SimulatorRefused", "find_spec"]

_lock = threading.RLock()
_installed = False


class SimulatorRefused(RuntimeError):
    """A real ``torch_npu`` is installed; the simulator would shadow it. Pass ``force=True`` to override."""


def is_installed() -> bool:
    """True when the simulated modules are in :data:`sys.modules`."""
    mod = sys.modules.get("torch_npu")
    return bool(mod is not None and getattr(mod, "__gptoss_simulator__", False))


def _real_torch_npu_origin() -> str | None:
    spec = importlib.machinery.PathFinder.find_spec("torch_npu")
    return spec.origin if spec is not None else None


class Services:
    """What the simulated ``torch_npu`` offers the product's self-test through its device seam
    (:mod:`gptoss_patch.selftest.device`), as ``torch_npu.__gptoss_simulator_services__``: the product asks the
    ``torch_npu`` present and never imports the testkit. A real ``torch_npu`` has no such attribute."""

    @staticmethod
    def placement_audit():
        """:func:`gptoss_patch_testkit.npu_sim.placement.audit` (a context manager)."""
        from gptoss_patch_testkit.npu_sim import placement

        return placement.audit()

    @staticmethod
    def reset_graph_state() -> None:
        """:func:`gptoss_patch_testkit.npu_sim.graph.reset_state`: no queued work, capture or open update."""
        from gptoss_patch_testkit.npu_sim import graph

        graph.reset_state()

    @staticmethod
    def has_weak_ref_kernel() -> bool:
        """False: vllm-ascend's compiled ``_C_ascend.weak_ref_tensor`` is not simulated."""
        return False


def _build_modules() -> dict[str, types.ModuleType]:
    from gptoss_patch_testkit.npu_sim import device, distributed, graph, ops, runtime

    mods: dict[str, types.ModuleType] = {}

    def add(name: str, attrs: dict[str, Any] | None = None) -> types.ModuleType:
        mods[name] = sim_module(name, attrs)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mods[name])
        return mods[name]

    npu_attrs = {k: getattr(device, k) for k in (
        "Stream", "Event", "current_stream", "default_stream", "set_stream", "stream", "current_device",
        "device_count", "is_available", "set_device", "device", "synchronize", "get_device_name",
        "get_soc_version", "empty_cache", "set_compile_mode", "config", "_lazy_init",
        "_is_in_bad_fork", "manual_seed", "manual_seed_all")}
    npu_attrs.update(graph.NAMESPACE)
    memory = {k: getattr(runtime, k) for k in ("mem_get_info", "memory_stats", "memory_allocated",
                                                 "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                                                 "reset_peak_memory_stats")}
    npu_attrs.update(memory)

    add("torch_npu", {"__version__": "2.7.1+gptoss.sim", "__gptoss_simulator_services__": Services(), **ops.OPS})
    add("torch_npu.npu", npu_attrs)
    add("torch_npu.npu.streams", {"Stream": device.Stream, "Event": device.Event,
                                  "ExternalEvent": graph.ExternalEvent})
    add("torch_npu.npu.graphs", dict(graph.NAMESPACE))
    add("torch_npu.npu.memory", memory)
    add("torch_npu.npu.utils", {"get_soc_version": device.get_soc_version})
    add("torch_npu._C", {"_npu_get_soc_version": device.get_soc_version,
                         "_NPUTaskGroupHandle": graph.TaskGroupHandle, "_weak_ref_tensor": graph.weak_ref_tensor})
    add("torch_npu._C._distributed_c10d", {"ProcessGroupHCCL": distributed.ProcessGroupHCCL})
    add("torch_npu.profiler")
    add("torch_npu.profiler.dynamic_profile")
    add("torch_npu._inductor")
    add("torch_npu.op_plugin")
    add("torch_npu.op_plugin.atb")
    add("torch_npu.op_plugin.atb._atb_ops", {"_register_atb_extensions": runtime.register_atb_extensions})
    add("torch_npu.contrib")
    add("torch_npu.dynamo")
    add("torch_npu.utils")
    add("acl", {"rt": None})
    add("acl.rt")
    add("torchair", {"register_replacement": graph.register_replacement})
    for sub in ("scope", "ops", "ge", "inference", "core", "configs", "_ge_concrete_graph", "fx_summary"):
        add(f"torchair.{sub}")
    # vllm-ascend >= 0.15's worker patch patch_npugraph_ex_triton reloads these two modules and replaces members of
    # the torchair graph compiler, which the simulator never runs
    add("torchair.core._concrete_graph")
    add("torchair.npu_fx_compiler",
        {"_NpuGraphConverter": not_emulated_class("torchair.npu_fx_compiler._NpuGraphConverter")})
    return mods


def install(force: bool = False, children: bool = True) -> types.ModuleType:
    """Install the simulated ``torch_npu`` and ``torchair`` into this interpreter; idempotent.

    Args:
        force: install even when a real ``torch_npu`` is importable (it is then shadowed).
        children: also set ``GPTOSS_PATCH_SIMULATE_NPU=1`` so child interpreters started from here
            (vLLM's model-registry inspection, spawned workers) get the simulator through the ``.pth``.

    Returns:
        The simulated ``torch_npu`` module.

    Raises:
        SimulatorRefused: a real ``torch_npu`` is importable (or already imported) and ``force`` is False.
        RuntimeError: PyTorch's PrivateUse1 backend was already renamed to something other than ``npu``.
    """
    global _installed
    with _lock:
        if children:
            os.environ["GPTOSS_PATCH_SIMULATE_NPU"] = "1"
        if _installed:
            return sys.modules["torch_npu"]
        existing = sys.modules.get("torch_npu")
        if existing is not None and not getattr(existing, "__gptoss_simulator__", False) and not force:
            raise SimulatorRefused("a real torch_npu is already imported; the NPU simulator will not replace it")
        origin = _real_torch_npu_origin()
        if origin is not None and not force:
            raise SimulatorRefused(f"a real torch_npu is installed ({origin}); the NPU simulator only installs on "
                                   "hosts without one (use force=True to shadow it)")
        import torch

        mods = _build_modules()
        for name, mod in mods.items():
            mod.__spec__ = importlib.machinery.ModuleSpec(name, _SimLoader(), is_package=True)
            mod.__loader__ = mod.__spec__.loader
            sys.modules[name] = mod
        _ensure_finder()
        backend = torch._C._get_privateuse1_backend_name()
        if backend != "npu":
            if backend != "privateuseone":
                raise RuntimeError(f"PyTorch's PrivateUse1 backend is already named {backend!r}; cannot simulate 'npu'")
            torch.utils.rename_privateuse1_backend("npu")
        if not hasattr(torch, "npu") or getattr(torch.npu, "__gptoss_simulator__", False) is False:
            try:
                torch._register_device_module("npu", mods["torch_npu.npu"])
            except RuntimeError:
                torch.npu = mods["torch_npu.npu"]  # type: ignore[attr-defined]
        from gptoss_patch_testkit.npu_sim import device

        device.mirror_privateuse1_kernels_to_cpu()
        device.register_accelerator_hooks()
        device.enter_device_mapping()
        device.map_devices_in_fusion_pass_setup()
        device.map_devices_in_custom_op_kernels()
        device.give_gloo_an_hccl_name()
        device.add_is_hccl_available()
        from gptoss_patch_testkit.npu_sim import distributed

        distributed.register_hccl_backend()
        distributed.record_collectives_in_graphs()
        from gptoss_patch_testkit.npu_sim import torch_compat

        torch_compat.install()
        torch_compat.install_worker_patch_tolerance()
        torch_compat.settle_custom_op_probe()
        torch_compat.no_autograd_cache_for_graph_modules()
        torch_compat.custom_op_aliasing_warns()
        from gptoss_patch_testkit.npu_sim import triton_kernels

        triton_kernels.install()
        from gptoss_patch_testkit.npu_sim.ops import moe as _moe_ops

        _moe_ops.register_c_ascend_ops()
        from gptoss_patch_testkit import faults

        faults.install_from_env()  # a served negative control's fault, named in the environment (else nothing)
        _installed = True
        return mods["torch_npu"]


class _SimLoader(importlib.abc.Loader):
    """Loader that hands out the prebuilt simulated module objects."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = sys.modules.get(spec.name)
        if mod is None or not getattr(mod, "__gptoss_simulator__", False):
            # a submodule we did not prebuild (e.g. torch_npu.some.thing): an empty simulated module
            mod = sim_module(spec.name)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


class _SimModuleFinder:
    """A :data:`sys.meta_path` finder for the simulated top-level packages (``torch_npu``, ``torchair``, ``acl``), added
    by :func:`install` when the start-up finder (``GPTOSS_PATCH_SIMULATE_NPU=1`` at interpreter start) is not there.

    ``importlib.reload`` and ``importlib.util.find_spec`` look a module up through the meta path even when it is in
    :data:`sys.modules`; vllm-ascend >= 0.15's worker patch ``patch_npugraph_ex_triton`` reloads
    ``torchair.fx_summary``, which failed with "spec not found" in a process that installed the simulator by calling
    :func:`install` (a benchmark, an in-process test) instead of through the environment variable.
    """

    names = ("torch_npu", "torchair", "acl")

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, _SimLoader(), is_package=True)

    def invalidate_caches(self):  # noqa: D102 - importlib protocol
        pass


def _ensure_finder() -> None:
    """Add :class:`_SimModuleFinder` to :data:`sys.meta_path` (once): the start-up finder serves the simulated names only
    while ``GPTOSS_PATCH_SIMULATE_NPU=1``, this one whenever the simulator is installed in this process."""
    if not any(isinstance(f, _SimModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_SimModuleFinder())


def find_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    """Meta-path hook used by the start-up finder (``GPTOSS_PATCH_SIMULATE_NPU=1``).

    Installs the simulator on first use (raising :class:`SimulatorRefused` as :func:`install`
    does) and returns a spec that serves the simulated module ``fullname``.
    """
    install()
    return importlib.machinery.ModuleSpec(fullname, _SimLoader(), is_package=True)


# Re-exported for callers that check for the sentinel type.
NotEmulated = NotEmulated
