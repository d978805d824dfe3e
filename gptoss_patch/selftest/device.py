"""The self-test's device seam: what the ``torch_npu`` present is, asked of that ``torch_npu``.

The harnesses never decide whether the NPU is simulated and never import a simulator. On an Ascend host the real
``torch_npu`` answers (no simulator services: vLLM comes up with HCCL, the graph harness keeps vllm-ascend's own weak
references, nothing is audited); on a CPU host with gptoss-patch-testkit installed and ``GPTOSS_PATCH_SIMULATE_NPU=1``,
``import torch_npu`` resolves to the testkit's simulator, whose module carries ``__gptoss_simulator__`` and a services
object (``__gptoss_simulator_services__``: placement audit, graph-state reset), and the same harnesses use those. With
no ``torch_npu`` at all, :func:`torch_npu` raises the ``ImportError`` with a hint.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

#: The hint of :func:`torch_npu`'s ``ImportError`` (and of ``verify``'s problem line).
NO_NPU_HINT = ("no torch_npu in this environment: install torch-npu on an Ascend host, or on a host without an NPU "
               "install gptoss-patch-testkit and set GPTOSS_PATCH_SIMULATE_NPU=1 (its CPU NPU simulator)")


def torch_npu() -> Any:
    """The ``torch_npu`` module this process runs on (imported if needed).

    Raises:
        ImportError: none is importable (message :data:`NO_NPU_HINT`).
    """
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    try:
        import torch_npu as mod
    except ImportError as exc:
        raise ImportError(f"{NO_NPU_HINT} ({exc})") from exc
    return mod


def services() -> Any | None:
    """The simulator's services object when the ``torch_npu`` present is a simulator, else None (never imports one
    that is not present: a process without ``torch_npu`` answers None)."""
    try:
        mod = torch_npu()
    except ImportError:
        return None
    if not getattr(mod, "__gptoss_simulator__", False):
        return None
    return getattr(mod, "__gptoss_simulator_services__", None)


def simulated() -> bool:
    """True when the ``torch_npu`` present declares itself a simulator."""
    return services() is not None


def distributed_backend() -> str:
    """The ``torch.distributed`` backend of the device group: ``"hccl"`` on a real ``torch_npu`` (what ``NPUWorker``'s
    ``_init_worker_distributed_environment`` passes), ``"gloo"`` on the simulator (its collectives run on gloo;
    docs/simulator.md §2)."""
    return "gloo" if simulated() else "hccl"


def placement_audit() -> contextlib.AbstractContextManager:
    """The simulator's placement audit (a tensor left in host memory where the NPU needs it fails the case, naming
    the operator and argument; docs/simulator.md §4.1) on a simulated NPU; on a real NPU nothing to audit (the
    device itself refuses host memory)."""
    sim = services()
    return sim.placement_audit() if sim is not None else contextlib.nullcontext()


def reset_graph_state() -> None:
    """Drop queued work and any capture of the simulated NPU's graphs (nothing on a real NPU)."""
    sim = services()
    if sim is not None:
        sim.reset_graph_state()


def has_weak_ref_kernel() -> bool:
    """Whether vllm-ascend's compiled ``_C_ascend.weak_ref_tensor`` serves here (True on a real NPU; the simulator
    has none, so the graph harness aliases weak references to the tensors themselves - the same memory)."""
    sim = services()
    return True if sim is None else bool(sim.has_weak_ref_kernel())
