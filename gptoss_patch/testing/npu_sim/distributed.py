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
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = ["ProcessGroupHCCL", "register_hccl_backend"]


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
