"""The ``hccl`` process-group backend of the simulated NPU: HCCL's collectives, run by gloo on host memory.

The real torch_npu registers ``ProcessGroupHCCL`` as the ``"hccl"`` backend of the ``npu`` device when it is
imported (torch_npu ``torch_npu/distributed/__init__.py``; ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``), and
vLLM on vllm-ascend creates every device group with ``backend="hccl"`` (``NPUPlatform.dist_backend``,
``vllm_ascend/platform.py``) and ``pg_options=ProcessGroupHCCL.Options()`` carrying ``hccl_config``
(``vllm_ascend/utils.py`` ``create_hccl_pg_options``; ``vllm_ascend/patch/worker/patch_distributed.py``).

The simulator registers the same name for the ``npu`` and ``cpu`` device types (simulated NPU tensors live in host
memory) with a creator that returns ``torch.distributed.ProcessGroupGloo`` on the same store, rank and size. gloo
implements the collectives vLLM uses (``all_reduce`` sum, ``all_gather``, ``reduce_scatter``, ``broadcast``,
``all_to_all_single``, ``barrier``) with the results HCCL documents for them (CANN "HCCL API" collective
definitions: AllReduce, AllGather, ReduceScatter, Broadcast, AlltoAll). ``Options.hccl_config`` (``hccl_buffer_size``,
in MB) sizes HCCL's communication buffers, a resource setting with no effect on results; it is kept on the options
object and not used.

Collectives on an ``hccl`` group issued while an NPU graph is being captured are captured with it and run again at
every replay (:func:`record_collectives_in_graphs`, :func:`gptoss_patch_testkit.npu_sim.graph.record_collective`);
collectives on vLLM's CPU (gloo) groups are host work and are not.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

__all__ = ["ProcessGroupHCCL", "register_hccl_backend", "record_collectives_in_graphs", "COLLECTIVES"]

#: ``torch.distributed`` collectives that a graph capture records when their group is an ``hccl`` group.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all_single", "all_to_all", "broadcast", "reduce", "_all_gather_base", "_reduce_scatter_base")


class ProcessGroupHCCL:
    """``torch_npu._C._distributed_c10d.ProcessGroupHCCL``: only its ``Options`` type is reachable from Python code."""

    class Options:
        """``ProcessGroupHCCL.Options``: ``hccl_config`` (dict, e.g. ``{"hccl_buffer_size": 200}``),
        ``is_high_priority_stream`` (bool) and ``_timeout`` (``datetime.timedelta``), as torch_npu exposes them."""

        def __init__(self) -> None:
            self.hccl_config: dict[str, Any] = {}
            self.is_high_priority_stream = False
            self._timeout = datetime.timedelta(minutes=30)
            self.global_ranks_in_group: list[int] = []
            self.group_id = ""


def _create_hccl(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def register_hccl_backend() -> None:
    """Register ``"hccl"`` with :func:`torch.distributed.Backend.register_backend` (idempotent).

    Raises:
        RuntimeError: another ``hccl`` backend (a real torch_npu's) is already registered.
    """
    import torch.distributed as dist

    if "hccl" in dist.Backend.backend_list:
        creator = dist.Backend._plugins.get("HCCL")
        if creator is not None and getattr(creator.creator_fn, "__module__", "") == __name__:
            return
        raise RuntimeError("torch.distributed already has an 'hccl' backend; the NPU simulator will not replace it")
    dist.Backend.register_backend("hccl", _create_hccl, devices=["npu", "cpu"])


def _is_hccl_group(group: Any) -> bool:
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "hccl"
    except (ValueError, RuntimeError):  # not a member / no default group: not a device collective of ours
        return False


def _uneven(sig: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """``all_gather(tensor_list, tensor, group)`` on an ``hccl`` group with outputs of different shapes."""
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return False
    outs = bound.get("tensor_list")
    if not outs or len({tuple(t.shape) for t in outs}) == 1:
        return False
    return _is_hccl_group(bound.get("group"))


def _all_gather_v(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False) -> None:
    """``torch.distributed.all_gather`` with outputs of different sizes on an ``hccl`` group: entry ``i`` of
    ``tensor_list`` receives rank ``i``'s ``tensor``, whatever the sizes (HCCL's AllGatherV: ``recvCounts[i]``
    elements from rank i at ``recvDispls[i]``; CANN "HcclAllGatherV"). UNVERIFIED: torch_npu loads ``HcclAllGatherV``
    (``HcclCompile.h``), but that its ``ProcessGroupHCCL::allgather`` takes it for outputs of different sizes - as
    PyTorch's ``ProcessGroupNCCL::allgather`` handles them - was not read in its source. vllm-ascend 0.11.0's All2All finalize all-gathers
    ``torch.tensor_split`` pieces, which differ by a row for an odd token count at TP 2. gloo gathers equal sizes
    only, so every rank pads its tensor to the largest piece and each output takes its own rows back.

    Raises:
        RuntimeError: ``tensor``'s shape is not this rank's entry of ``tensor_list``, the dtypes differ, or
            ``async_op`` (not used by the callers this serves).
    """
    import torch
    import torch.distributed as dist

    if async_op:
        raise RuntimeError("the simulated hccl all_gather of uneven sizes runs synchronously (async_op=False)")
    rank = dist.get_rank(group)
    if any(t.dtype != tensor.dtype for t in tensor_list):
        raise RuntimeError(f"all_gather: tensor_list dtypes {sorted({str(t.dtype) for t in tensor_list})} differ "
                           f"from the input's {tensor.dtype}")
    if tuple(tensor_list[rank].shape) != tuple(tensor.shape):
        raise RuntimeError(f"all_gather: this rank's tensor has shape {tuple(tensor.shape)} but its entry of "
                           f"tensor_list has {tuple(tensor_list[rank].shape)}")
    width = max(t.numel() for t in tensor_list)
    padded = torch.zeros(width, dtype=tensor.dtype)
    padded[:tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    dist.distributed_c10d.all_gather.__wrapped__(gathered, padded, group=group)  # the unwrapped gloo collective
    for out, got in zip(tensor_list, gathered):
        out.copy_(got[:out.numel()].reshape(out.shape))


def record_collectives_in_graphs() -> None:
    """Wrap the :data:`COLLECTIVES` of ``torch.distributed`` (and ``torch.distributed.distributed_c10d``) so that one
    on an ``hccl`` group issued during a simulated NPU graph capture is recorded as a graph task (idempotent).

    Outside a capture, and on other groups, the wrapper calls the original with the same arguments. Code that bound
    a collective by name before the simulator was installed keeps the original (the simulator is installed by the
    ``.pth`` bootstrap, before vLLM is imported).
    """
    import functools
    import inspect

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from gptoss_patch_testkit.npu_sim import graph

    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_npu_sim_collective", False):
            continue
        sig = inspect.signature(fn)

        def wrapper(*args: Any, _fn=fn, _name=name, _sig=sig, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # TorchDynamo traces the original, which it turns into a functional collective (``_c10d_functional``)
                # of the FX graph; graph capture records those in its dispatch mode (npu_sim.graph)
                return _fn(*args, **kwargs)
            if _name == "all_gather" and _uneven(_sig, args, kwargs):
                _fn = _all_gather_v  # HCCL's AllGatherV; gloo takes equal sizes only
            if graph.capture_idle():  # the common case, every step of an eager run: no capture, nothing to record
                return _fn(*args, **kwargs)
            try:
                group = _sig.bind(*args, **kwargs).arguments.get("group")
            except TypeError:
                return _fn(*args, **kwargs)  # let torch report the bad call
            if not _is_hccl_group(group):
                return _fn(*args, **kwargs)
            return graph.record_collective(_name, _fn, args, kwargs)

        wrapped = functools.wraps(fn)(wrapper)
        wrapped._npu_sim_collective = True  # type: ignore[attr-defined]
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
