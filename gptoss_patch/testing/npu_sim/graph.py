"""Simulated NPU graph API (``torch.npu.NPUGraph``, task groups, ``ExternalEvent``).

Placeholder surface for import time; capture/replay semantics (Ascend/pytorch
``torch_npu/npu/graphs.py``; ``npu_ops.md`` §7) are added with the ACL-graph work. Until then the
graph entry points are :class:`NotEmulated` sentinels that raise when called.
"""

from __future__ import annotations

from typing import Any

from gptoss_patch.testing.npu_sim._base import NotEmulated


class TaskGroupHandle:
    """``torch_npu._C._NPUTaskGroupHandle``: identifies one captured task group."""


class ExternalEvent:
    """``torch.npu.ExternalEvent`` (graph-external event). Import-time surface only until the graph work lands."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotEmulated("torch.npu.ExternalEvent")()


NAMESPACE: dict[str, Any] = {
    "ExternalEvent": ExternalEvent,
    "NPUGraph": NotEmulated("torch.npu.NPUGraph"),
    "graph": NotEmulated("torch.npu.graph"),
    "graph_pool_handle": NotEmulated("torch.npu.graph_pool_handle"),
    "graph_task_group_begin": NotEmulated("torch.npu.graph_task_group_begin"),
    "graph_task_group_end": NotEmulated("torch.npu.graph_task_group_end"),
    "graph_task_update_begin": NotEmulated("torch.npu.graph_task_update_begin"),
    "graph_task_update_end": NotEmulated("torch.npu.graph_task_update_end"),
}
