"""Simulated NPU graph API: ``torch.npu.NPUGraph``, ``torch.npu.graph``, task groups, ``ExternalEvent``.

Sources (tags of ``docs/operators.md`` §1, §6):

* PT-graphs - Ascend/pytorch ``torch_npu/npu/graphs.py``: ``NPUGraph`` (``capture_begin(pool=None,
  capture_error_mode="global")``, ``capture_end``, ``replay``, ``reset``, ``pool``), the ``graph`` context manager
  (synchronise, empty caches, switch to a side capture stream - a class-level default ``Stream`` unless ``stream`` is
  given - then ``capture_begin``; ``capture_end`` on exit), ``graph_pool_handle``, ``is_current_stream_capturing``,
  ``graph_task_group_begin/end``, ``graph_task_update_begin/end``.
* PT-graphcpp - ``torch_npu/csrc/core/npu/NPUGraph.cpp`` and ``torch_npu/csrc/npu/Graph.cpp``: the error texts
  ("NPU graphs must be captured on a non-default stream", "Capture must end on the same stream it began on.",
  "Called NPUGraph::replay without a preceding successful capture.", ...), ``replay`` executes the graph on the
  *current* stream (``aclmdlRIExecuteAsync``), ``_NPUTaskGroupHandle`` is a pybind class without constructor
  exposing a read-only ``task_group``; task groups map to ``aclmdlRICaptureTaskGrpBegin/End`` and updates to
  ``aclmdlRICaptureTaskUpdateBegin/End``. Its ``_npu_fused_infer_attention_score_out_graph`` parses
  ``actual_seq_lengths(_kv)`` as ``SymIntArrayRef`` on the host when the kernel is launched.
* OPD73-graph - Ascend/op-plugin 7.3.0 ``docs/context/torch_npu-npu-graph_task_{group_begin,group_end,update_begin,
  update_end}.md`` and ``torch_npu-npu-ExternalEvent*.md``: ``graph_task_group_end`` needs the stream of
  ``graph_task_group_begin``; ``graph_task_update_end`` the stream of ``graph_task_update_begin``; "the stream of the
  update phase must differ from the stream of the capture phase"; ``ExternalEvent`` is captured as an external node
  of the graph; ``wait`` blocks the stream until the event is recorded; allowed call orders wait -> reset -> record
  or record -> wait -> reset; ``reset`` clears the flag a completed ``record`` set, so an event must be reset before
  it is reused.
* ACL-rt - CANN runtime API ``aclmdlRICaptureTaskGrpBegin`` / ``...GrpEnd`` / ``...TaskUpdateBegin`` /
  ``...TaskUpdateEnd`` (hiascend.com ``API/appdevgapi/aclcppdevg_03_1823`` .. ``_1826``, CANN 8.3.RC1 - 9.0):
  group begin needs a stream *in* capture state, update begin a stream *not* in capture state; only single-operator
  tasks may sit in a group; the update must issue the same number and types of tasks as the group holds; the
  update itself is asynchronous work on the update stream.
* OPC-atb - Ascend/op-plugin ``op_plugin/utils/custom_functions/atb/AtbCommon.cpp``: a CPU tensor argument of an
  ATB operator becomes ``hostData``, consumed by ``Setup`` when the kernel is launched (``seq_len`` /
  ``context_lens`` of the ATB attention operators are host tensors in vllm-ascend).

Emulation model
---------------
*Capture* (``capture_begin`` .. ``capture_end``) executes everything eagerly once (a real capture executes nothing:
tests must not rely on that difference) and records, in program order, every operation that reaches a kernel:

* emulated ``torch_npu`` operators (routed through :func:`route` by ``npu_sim.ops``) are recorded as opaque nodes -
  operator name, the callable, and the arguments *as launched*: container arguments are copied, and arguments the
  real operator reads on the host at launch (``SymInt[]`` lengths of FIA, ATB host tensors; :data:`HOST_PARAMS`)
  are snapshotted, so later host-side changes do not leak into replays (exactly as on the device);
* plain PyTorch operations are recorded at the ATen level by a ``TorchDispatchMode`` (each ``aten``/``prims``
  operator with its arguments and the tensors it returned). View/alias operators and uninitialised allocations
  (``empty*``) launch no kernel and are not replayed; operators returning no tensor (``.item()``,
  ``aten.equal``) are host reads whose value is baked into the recorded program (listed in
  :attr:`NPUGraph.sim_host_reads`). Custom operators of compiled kernel libraries (:data:`OPAQUE_NAMESPACES`,
  e.g. ``torch.ops._C_ascend``) are opaque nodes like the emulated ``torch_npu`` operators. Other custom operators
  (vLLM's ``torch.ops.vllm.*``: host-side Python) are transparent: their kernel runs with the recorder active, so
  the kernels *they* launch are recorded; one whose kernel launched nothing through the dispatcher (it wrote
  memory directly) is recorded as one opaque node.
* ``ExternalEvent.wait/reset/record`` on the capture stream become event nodes.

*Replay* re-executes the recorded nodes in order with the recorded tensor objects (static addresses): in-place and
``out=`` operators write where they wrote at capture, and the fresh result of an out-of-place operator is
``copy_``'d into the tensor it returned at capture, so every tensor produced during capture is rewritten in place
and reads of input buffers see their current contents. A replayed event ``wait`` whose event is not recorded
*suspends* the replay: the rest of the graph stays queued on the replay stream (the host thread returns, as
``aclmdlRIExecuteAsync`` does) and resumes when the event is recorded - which is how vllm-ascend's order
``replay(); update_attn_params()`` works on the device. While a stream is blocked, host-issued work on it that
touches memory of the pending work raises (a real NPU would run it after the graph; the simulator cannot defer
arbitrary work), and synchronising a blocked stream raises (a real NPU would hang).

*Task groups* record which emulated-operator nodes were captured on the capture stream between
``graph_task_group_begin`` and ``graph_task_group_end`` (plain ATen work there is recorded in the graph but is not a
group task: the simulator cannot tell host-side from device-side CPU work); between
``graph_task_update_begin(update_stream, handle)`` and ``graph_task_update_end(update_stream)``, emulated operators
issued on the update stream are not executed: each replaces the launch arguments of the next node of the group (a
different operator raises), and ``graph_task_update_end`` applies them - as work on the update stream - after
checking the task count. Like the device, an update may pass other tensors than the capture (it re-launches the
kernel; vllm-ascend 0.11.0 passes a fresh workspace every step); the simulator keeps them alive, where a device
would read whatever the memory holds at replay time.

Limits: the simulator cannot tell host tensors from device tensors (both are CPU tensors), so CPU-side ATen work
during capture is recorded and replayed too, and a host read of a device tensor during capture (``.item()``) is
baked where a device would reject it (``torch.npu.synchronize()`` / ``Stream.synchronize()`` during capture do
raise); kernels that bypass the dispatcher (e.g. TorchInductor-generated code) cannot be recorded - capture eager
code; ``auto_dispatch_capture`` / ``NPUGraph.update`` and ``make_graphed_callables`` are not emulated; one capture
at a time per process (as the PT-graphs docstring requires); capture and updates are per thread, queued work and
its checks are process-wide. ``ExternalEvent`` follows the op-plugin docs that list wait->reset->record and
record->wait->reset (``wait`` does not reset the event); a later revision of those docs makes ``wait`` reset
automatically and deprecates ``reset`` - with it, vllm-ascend's wait+reset stays valid.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gptoss_patch_testkit.npu_sim import device, placement
from gptoss_patch_testkit.npu_sim._base import NotEmulated, NotEmulatedError

__all__ = [
    "NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing", "graph_task_group_begin",
    "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end", "ExternalEvent",
    "TaskGroupHandle", "route", "HOST_PARAMS", "NAMESPACE",
]

#: Arguments an operator reads on the host when it is launched; a graph keeps the values of capture (or update)
#: time. FIA: ``SymInt[]`` lengths parsed on the host (OPY72 schema; PT-graphcpp parser). ATB attention: CPU tensors
#: become ``hostData`` read by ``Setup`` at launch (OPC-atb); vllm-ascend passes ``seq_len``/``context_lens`` as
#: host tensors (docs/operators.md §3.7). Operators may also declare ``fn._npu_sim_host_params = ("name", ...)``.
HOST_PARAMS: dict[str, tuple[str, ...]] = {
    "npu_fused_infer_attention_score": ("actual_seq_lengths", "actual_seq_lengths_kv", "actual_shared_prefix_len"),
    "npu_fused_infer_attention_score_v2": ("actual_seq_qlen", "actual_seq_kvlen"),
    "npu_fusion_attention": ("prefix", "actual_seq_qlen", "actual_seq_kvlen"),
    "_npu_paged_attention": ("context_lens",),
    "_npu_flash_attention": ("seq_len",),
    "_npu_flash_attention_qlens": ("seq_len", "context_lens"),
}

#: Emulated operators that only compute on the host (workspace sizing + allocation; OPC-atb ``_get_workspace``,
#: FIA ``_get_max_workspace``): no device task, so never recorded, never intercepted by an update, never blocked.
_HOST_ONLY_SUFFIXES = ("_get_workspace", "_get_max_workspace")
_HOST_ONLY_NAMES = frozenset({"get_npu_format"})

_ERROR_MODES = ("global", "thread_local", "relaxed")

#: ``torch.ops`` namespaces of compiled kernel libraries (vllm-ascend's ``_C_ascend``, vLLM's ``_C``/``_moe_C``/...,
#: torch_npu's ``npu``/``atb``): on the real system one call launches device kernels whose logic runs on the device
#: at every replay, so the simulator's Python stand-ins for them are recorded as one opaque node (their internal
#: host logic must not be baked). Operators of other namespaces (``vllm::unified_attention_with_output`` and the
#: like) are host-side Python orchestration and are recorded transparently (the kernels they launch).
OPAQUE_NAMESPACES = frozenset({"_C_ascend", "_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_rocm_C", "npu", "atb"})

_aten = torch.ops.aten
#: ATen allocations returning uninitialised memory: no kernel, so nothing to replay (the memory keeps its contents).
_ALLOC_OPS = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.empty_permuted.default,
})


class _SimState(threading.local):
    device_exec = 0  # >0 while the simulated device executes graph work: no recording, no checks


_tls = _SimState()
_ids = itertools.count(1)


# --------------------------------------------------------------------------------------------------------------
# tensor helpers


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int | None:
    """Identity of the memory a tensor lives in (None: no ordinary storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _storage_keys(obj: Any) -> set[int]:
    keys = set()
    for t in _tensors(obj):
        if t.numel():
            k = _storage_key(t)
            if k:
                keys.add(k)
    return keys


def _copy_containers(obj: Any) -> Any:
    """Copy lists/tuples/dicts (the values an operator was launched with); tensors stay the same objects."""
    if isinstance(obj, list):
        return [_copy_containers(x) for x in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_copy_containers(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    return obj


def _snapshot(obj: Any) -> Any:
    """Value of a host-read argument at launch: tensors are cloned, containers copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, list):
        return [_snapshot(x) for x in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_snapshot(x) for x in obj)
    return obj


def _is_host_only(name: str, fn: Callable[..., Any]) -> bool:
    base = name.removesuffix(".out")
    return (base in _HOST_ONLY_NAMES or base.endswith(_HOST_ONLY_SUFFIXES)
            or bool(getattr(fn, "_npu_sim_host_only", False)))


@functools.lru_cache(maxsize=None)
def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _launch_args(fn: Callable[..., Any], host: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments as the device task keeps them: copied containers, host-read values snapshotted."""
    args = list(_copy_containers(list(args)))
    kwargs = _copy_containers(dict(kwargs))
    if host:
        try:
            positional = _positional_names(fn)
        except TypeError:  # an unhashable callable: host parameters can then only be found by keyword
            positional = ()
        for pname in host:
            if pname in kwargs:
                kwargs[pname] = _snapshot(kwargs[pname])
            elif pname in positional and positional.index(pname) < len(args):
                i = positional.index(pname)
                args[i] = _snapshot(args[i])
    return tuple(args), kwargs


@contextlib.contextmanager
def _device_execution() -> Iterator[None]:
    """Run graph work as the device would: no host-level overrides, no recording, no autograd."""
    _tls.device_exec += 1
    try:
        with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction(), \
                torch.inference_mode():
            yield
    finally:
        _tls.device_exec -= 1


# --------------------------------------------------------------------------------------------------------------
# recorded program


class _OpNode:
    """One recorded kernel launch: an emulated operator or an ATen/custom operator."""

    kind = "op"
    __slots__ = ("name", "fn", "args", "kwargs", "result", "outs", "copy_out", "npu")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict, result: Any, npu: bool):
        self.name, self.fn, self.args, self.kwargs, self.result, self.npu = name, fn, args, kwargs, result, npu
        self.outs = _tensors(result)
        inputs = _storage_keys((args, kwargs))
        # a returned tensor that lives in an argument's memory was written in place (or is a view): nothing to copy
        self.copy_out = [bool(t.numel()) and _storage_key(t) not in inputs for t in self.outs]

    def is_alias_only(self) -> bool:
        return not any(self.copy_out)

    def touched(self) -> set[int]:
        return _storage_keys((self.args, self.kwargs, self.outs))

    def execute(self) -> None:
        result = self.fn(*self.args, **self.kwargs)
        if not any(self.copy_out):
            return
        new = _tensors(result)
        if len(new) != len(self.outs):
            raise RuntimeError(f"graph replay: {self.name} returned {len(new)} tensors, {len(self.outs)} at capture")
        for captured, fresh, copy in zip(self.outs, new, self.copy_out):
            if not copy:
                continue
            if fresh.shape != captured.shape or fresh.dtype != captured.dtype:
                raise RuntimeError(
                    f"graph replay: {self.name} produced {tuple(fresh.shape)}/{fresh.dtype} but the graph captured "
                    f"{tuple(captured.shape)}/{captured.dtype}; operators with data-dependent output shapes cannot be "
                    "replayed from a graph")
            captured.copy_(fresh)


class _EventNode:
    """A captured ``ExternalEvent`` operation (an external node of the graph, OPD73-graph)."""

    kind = "event"
    __slots__ = ("op", "event")
    name = property(lambda self: f"ExternalEvent.{self.op}")

    def __init__(self, op: str, event: "ExternalEvent"):
        self.op, self.event = op, event

    def touched(self) -> set[int]:
        return set()


def _on_hccl_group(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when a ``_c10d_functional`` operator's ``group_name`` argument names a process group of the ``hccl``
    backend (a gloo CPU group's collective is host work, not a graph task)."""
    names = [a.name for a in func._schema.arguments]
    if "group_name" not in names:
        return False
    i = names.index("group_name")
    group_name = kwargs.get("group_name", args[i] if i < len(args) else None)
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        return dist.get_backend(c10d._resolve_process_group(group_name)) == "hccl"
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return False


def _synchronous(func: Any) -> Callable[..., Any]:
    """``func`` (a ``_c10d_functional`` collective) followed by ``wait_tensor`` on each tensor it returns."""

    def run(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        for t in _tensors(result):
            torch.ops._c10d_functional.wait_tensor(t)
        return result

    run.__name__ = getattr(func, "__name__", "collective")
    return run


class _Capture:
    """State of the one capture underway."""

    def __init__(self, npu_graph: "NPUGraph", stream: device.Stream):
        self.graph = npu_graph
        self.stream = stream
        self.thread = threading.get_ident()
        self.nodes: list[_OpNode | _EventNode] = []
        self.host_reads: list[str] = []
        self.group: list[int] | None = None
        self.leaf_depth = 0
        self.mode = _CaptureMode(self)

    def mine(self) -> bool:
        return self.thread == threading.get_ident()

    @contextlib.contextmanager
    def leaf(self) -> Iterator[None]:
        """Inside an emulated operator: its internal ATen calls are part of the one recorded node."""
        self.leaf_depth += 1
        try:
            yield
        finally:
            self.leaf_depth -= 1

    def add(self, node: _OpNode | _EventNode) -> None:
        if node.kind == "event" and self.group is not None:
            raise RuntimeError(
                "ExternalEvent operations cannot be captured inside a task group: only single-operator tasks may be "
                "issued between graph_task_group_begin and graph_task_group_end (ACL aclmdlRICaptureTaskGrpBegin)")
        self.nodes.append(node)
        if node.kind == "op" and node.npu and self.group is not None and device.current_stream() == self.stream:
            self.group.append(len(self.nodes) - 1)

    def record_npu(self, name: str, fn: Callable[..., Any], host_params: tuple[str, ...], args: tuple,
                   kwargs: dict) -> Any:
        with self.leaf():  # the snapshot copies are host bookkeeping, not graph work
            args, kwargs = _launch_args(fn, host_params, args, kwargs)
            result = fn(*args, **kwargs)
        self.add(_OpNode(name, fn, args, kwargs, result, npu=True))
        return result

    def record_functional_collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A functional collective of a compiled graph (``torch.ops._c10d_functional.*``, what TorchDynamo makes of
        ``torch.distributed`` calls): run now; record one task that re-issues it and waits for it at replay (an HCCL
        task completes in stream order); ``wait_tensor`` itself launches nothing."""
        with self.leaf():
            result = func(*args, **kwargs)
        if func.__name__.startswith("wait_tensor") or not _on_hccl_group(func, args, kwargs):
            return result
        self.add(_OpNode(f"hccl.{func.__name__}", _synchronous(func), args, kwargs, result, npu=False))
        return result

    def record_aten(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        if func in _ALLOC_OPS:
            return
        mutable = func._schema.is_mutable
        if not _tensors(result) and not mutable:
            self.host_reads.append(str(func))  # a host read: its value is baked into the captured program
            return
        node = _OpNode(str(func), func, args, kwargs, result, npu=False)
        if not mutable and node.is_alias_only():
            return  # a view / alias: no kernel
        self.add(node)


def _backend_keyset(args: tuple, kwargs: dict) -> torch._C.DispatchKeySet:
    """Dispatch keys of the arguments below the Python key: where a custom operator's real kernel lives."""
    keys = None
    for t in _tensors((args, kwargs)):
        keys = torch._C._dispatch_keys(t) if keys is None else keys | torch._C._dispatch_keys(t)
    if keys is None:
        return torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    return keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


class _CaptureMode(TorchDispatchMode):
    """Records the ATen operators executed during capture (see the module docstring)."""

    def __init__(self, cap: _Capture):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = self.cap
        if cap is not _capture or cap.leaf_depth or _tls.device_exec:
            return func(*args, **kwargs)
        namespace = getattr(func, "namespace", "aten")
        if namespace in OPAQUE_NAMESPACES:
            with cap.leaf():
                result = func(*args, **kwargs)
            cap.record_aten(func, args, kwargs, result)
            return result
        if namespace == "_c10d_functional":
            return cap.record_functional_collective(func, args, kwargs)
        if namespace not in ("aten", "prims"):
            # host-side custom operator: run its kernel with the recorder active, so the kernels it launches are
            # recorded
            before = len(cap.nodes)
            with _CaptureMode(cap):
                result = func.redispatch(_backend_keyset(args, kwargs), *args, **kwargs)
            if len(cap.nodes) == before:
                cap.record_aten(func, args, kwargs, result)  # its kernel bypassed the dispatcher: one opaque node
            return result
        result = func(*args, **kwargs)
        cap.record_aten(func, args, kwargs, result)
        return result


def _register_functionalization_rules() -> None:
    """Capture rules for the higher-order operators ``auto_functionalized`` / ``auto_functionalized_v2``.

    vLLM's compiled regions are functionalized (vLLM 0.13+): a mutating custom operator such as vLLM's own
    ``vllm::moe_forward`` (``mutates_args=["hidden_states"]``) appears as ``auto_functionalized_v2(op, ...)``, which
    dispatch modes must interpret. The dense implementation (PyTorch ``torch/_higher_order_ops/auto_functionalize.py``:
    clone the mutated bases, call the operator on the clones, return them) is what runs eagerly and on the device;
    during a capture it runs with the recorder active, so the clones and the operator's kernels become graph nodes.
    """
    try:
        from torch._higher_order_ops import auto_functionalize as af
    except ImportError:  # an older torch without these operators: nothing to interpret
        return
    for hop, dense in (("auto_functionalized", "auto_functionalized_dense"),
                       ("auto_functionalized_v2", "auto_functionalized_v2_dense")):
        op, impl = getattr(af, hop, None), getattr(af, dense, None)
        if op is None or impl is None or _CaptureMode in getattr(op, "python_key_table", {}):
            continue

        def rule(mode, *args, _impl=impl, **kwargs):
            with _CaptureMode(mode.cap):
                return _impl(*args, **kwargs)

        op.py_impl(_CaptureMode)(rule)


_register_functionalization_rules()


# --------------------------------------------------------------------------------------------------------------
# streams: queued (blocked) work


class _Task:
    done = False

    def run(self) -> bool:  # True when finished, False when blocked
        raise NotImplementedError

    def touched(self) -> set[int]:
        return set()

    def abort(self) -> None:
        self.done = True

    def waiting_on(self) -> str:
        return ""


class _ReplayTask(_Task):
    def __init__(self, npu_graph: "NPUGraph"):
        self.graph = npu_graph
        self.nodes = npu_graph._nodes
        self.pc = 0
        self._touched: tuple[int, set[int]] | None = None
        npu_graph._active.append(self)

    def run(self) -> bool:
        with _device_execution():
            while self.pc < len(self.nodes):
                node = self.nodes[self.pc]
                if node.kind == "event":
                    if not node.event._execute(node.op):
                        return False
                else:
                    node.execute()
                self.pc += 1
                _runtime.progress += 1
        self._finish()
        return True

    def _finish(self) -> None:
        self.done = True
        if self in self.graph._active:
            self.graph._active.remove(self)

    def abort(self) -> None:
        self._finish()

    def touched(self) -> set[int]:
        if self._touched is None or self._touched[0] != self.pc:
            keys: set[int] = set()
            for node in self.nodes[self.pc:]:
                keys |= node.touched()
            self._touched = (self.pc, keys)
        return self._touched[1]

    def waiting_on(self) -> str:
        node = self.nodes[self.pc] if self.pc < len(self.nodes) else None
        return f"NPUGraph replay at {node.name} of {node.event!r}" if node is not None and node.kind == "event" else ""


class _EventTask(_Task):
    def __init__(self, op: str, event: "ExternalEvent"):
        self.op, self.event = op, event

    def run(self) -> bool:
        ok = self.event._execute(self.op)
        if ok:
            _runtime.progress += 1
        return ok

    def waiting_on(self) -> str:
        return f"ExternalEvent.wait of {self.event!r}" if self.op == "wait" else ""


class _BarrierTask(_Task):
    """``Stream.wait_stream`` / ``Event.wait`` on work that is still queued: done when that work is done."""

    def __init__(self, tasks: Iterable[_Task]):
        self.tasks = list(tasks)

    def run(self) -> bool:
        return all(t.done for t in self.tasks)

    def touched(self) -> set[int]:
        keys: set[int] = set()
        for t in self.tasks:
            if not t.done:
                keys |= t.touched()
        return keys

    def waiting_on(self) -> str:
        pending = [t.waiting_on() for t in self.tasks if not t.done]
        return "work of another stream (" + "; ".join(p for p in pending if p) + ")"


class _UpdateTask(_Task):
    """Application of a task-group update (asynchronous work on the update stream, ACL-rt)."""

    def __init__(self, nodes: list[_OpNode], calls: list[tuple[tuple, dict]]):
        self.nodes, self.calls = nodes, calls

    def run(self) -> bool:
        for node, (args, kwargs) in zip(self.nodes, self.calls):
            node.args, node.kwargs = args, kwargs
        _runtime.progress += 1
        return True

    def touched(self) -> set[int]:
        return _storage_keys(self.calls)


class _Runtime:
    """Queues of work the simulated device could not run yet, per stream, and the hooks ``device`` calls."""

    def __init__(self) -> None:
        self.queues: dict[device.Stream, collections.deque[_Task]] = {}
        self.progress = 0
        self.draining = False
        self.guard: _GuardMode | None = None
        self.guard_thread: int | None = None

    # -- work submission -------------------------------------------------------------------------------------
    def submit(self, stream: device.Stream, task: _Task) -> None:
        queue = self.queues.get(stream)
        if queue:
            queue.append(task)
        else:
            try:
                finished = task.run()
            except BaseException:
                task.abort()
                raise
            if finished:
                task.done = True
            else:
                self.queues[stream] = collections.deque([task])
        self.drain()

    def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        try:
            while True:
                before = self.progress
                for stream, queue in list(self.queues.items()):
                    while queue:
                        try:
                            finished = queue[0].run()
                        except BaseException:
                            for task in queue:
                                task.abort()
                            del self.queues[stream]
                            raise
                        if not finished:
                            break
                        queue.popleft().done = True
                        self.progress += 1
                    if not queue:
                        self.queues.pop(stream, None)
                if self.progress == before:
                    break
        finally:
            self.draining = False
            self._sync_guard()

    def _sync_guard(self) -> None:
        if self.queues and self.guard is None:
            self.guard = _GuardMode()
            self.guard_thread = threading.get_ident()
            self.guard.__enter__()
        elif not self.queues and self.guard is not None and self.guard_thread == threading.get_ident():
            _remove_mode(self.guard)
            self.guard = None

    # -- checks ------------------------------------------------------------------------------------------------
    def blocked_by(self, stream: device.Stream) -> str:
        queue = self.queues.get(stream)
        if not queue:
            return ""
        return queue[0].waiting_on() or "queued work"

    def check_issue(self, stream: device.Stream, what: str, tensors: Iterable[torch.Tensor]) -> None:
        """Host-issued work on a blocked stream must not touch memory of the work queued before it."""
        queue = self.queues.get(stream)
        if not queue:
            return
        pending: set[int] = set()
        for task in queue:
            pending |= task.touched()
        for t in tensors:
            if t.numel() and _storage_key(t) in pending:
                raise RuntimeError(
                    f"{what} was issued on {stream!r}, which is blocked ({self.blocked_by(stream)}), and it uses "
                    "memory that the queued work still reads or writes; a real NPU would run it after that work, once "
                    "the ExternalEvent is recorded. The simulator runs host-issued work immediately and cannot "
                    "defer it: record the event (e.g. run the graph-parameter update) before this call")

    def _deadlock(self, what: str) -> RuntimeError:
        streams = "; ".join(f"{s!r} waits for {self.blocked_by(s)}" for s in self.queues)
        return RuntimeError(f"{what} would never return on a real NPU: {streams}; nothing can record the event while "
                            "the host waits (record the ExternalEvent first)")

    # -- hooks called by device.py -------------------------------------------------------------------------------
    def device_synchronize(self) -> None:
        if _capture is not None and _capture.mine():
            raise RuntimeError("torch.npu.synchronize() while an NPU graph capture is underway: synchronising is not "
                               "permitted during capture (capture_error_mode='global')")
        if self.queues:
            raise self._deadlock("torch.npu.synchronize()")

    def stream_synchronize(self, stream: device.Stream) -> None:
        if _capture is not None and _capture.mine() and stream == _capture.stream:
            raise RuntimeError("Stream.synchronize() on a stream that is capturing an NPU graph is not permitted")
        if stream in self.queues:
            raise self._deadlock(f"{stream!r}.synchronize()")

    def stream_idle(self, stream: device.Stream) -> bool:
        return stream not in self.queues

    def snapshot(self, stream: device.Stream) -> tuple[_Task, ...]:
        return tuple(self.queues.get(stream, ()))

    def wait_tasks(self, stream: device.Stream, tasks: tuple[_Task, ...]) -> None:
        if any(not t.done for t in tasks) and not (_capture is not None and _capture.mine()
                                                   and stream == _capture.stream):
            self.submit(stream, _BarrierTask(tasks))

    def tasks_done(self, tasks: tuple[_Task, ...]) -> bool:
        return all(t.done for t in tasks)

    def synchronize_tasks(self, tasks: tuple[_Task, ...], what: str) -> None:
        if not self.tasks_done(tasks):
            raise self._deadlock(what)

    def reset(self) -> None:
        for queue in self.queues.values():
            for task in queue:
                task.abort()
        self.queues.clear()
        if self.guard is not None:
            _remove_mode(self.guard)
            self.guard = None


class _GuardMode(TorchDispatchMode):
    """Active while some stream is blocked: checks ATen work issued on a blocked stream (see ``check_issue``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _runtime.queues and not _tls.device_exec and func not in _ALLOC_OPS and not _is_view(func):
            stream = device.current_stream()
            if stream in _runtime.queues:
                _runtime.check_issue(stream, str(func), _tensors((args, kwargs)))
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _is_view(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return False
    return all(r.alias_info is not None for r in schema.returns)


def _remove_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off this thread's dispatch-mode stack, wherever it is (work can unblock in any order)."""
    stack = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return
    above = []
    while True:
        top = torch.utils._python_dispatch._pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch.utils._python_dispatch._push_mode(m)
    mode.old_dispatch_mode_flags.clear()
    mode.old_non_infra_dispatch_mode_flags.clear()
    mode.old_without_ignore_compile_internals_dispatch_mode_flags.clear()


_runtime = _Runtime()
_capture: _Capture | None = None


class _Update:
    def __init__(self, stream: device.Stream, handle: "TaskGroupHandle"):
        self.stream, self.handle = stream, handle
        self.thread = threading.get_ident()
        self.calls: list[tuple[tuple, dict]] = []


_update: _Update | None = None


# --------------------------------------------------------------------------------------------------------------
# emulated-operator dispatch


def route(name: str, fn: Callable[..., Any], host_params: tuple[str, ...] | None = None) -> Callable[..., Any]:
    """Wrap an emulated operator (and its ``.out`` overload) so calls go through the graph machinery.

    Eagerly the wrapper just calls ``fn`` (after checking that it is not issued on a blocked stream against queued
    memory); during a capture it records the call as one graph node; inside a task-group update on the update
    stream it becomes the update of the group's next node.

    Args:
        name: the ``torch_npu`` attribute name (``.out`` is appended for the overload).
        fn: the emulated operator.
        host_params: names of arguments read on the host at launch; default ``fn._npu_sim_host_params``, else
            :data:`HOST_PARAMS` by name. The ``.out`` overload inherits them.
    """
    if host_params is None:
        host_params = tuple(getattr(fn, "_npu_sim_host_params", ()) or HOST_PARAMS.get(name.removesuffix(".out"), ()))
    host_only = _is_host_only(name, fn)

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        return _dispatch(name, fn, host_params, host_only, args, kwargs)

    out = fn.__dict__.get("out") if hasattr(fn, "__dict__") else None
    if out is not None and callable(out) and not isinstance(out, NotEmulated):
        out_params = tuple(getattr(out, "_npu_sim_host_params", ()) or host_params)
        op.out = route(f"{name}.out", out, out_params)  # type: ignore[attr-defined]
    op._npu_sim_routed = True  # type: ignore[attr-defined]
    return op


#: Operators whose first launch in a process is logged ("NPU simulator: pid <p>: first torch_npu.<op> launch"), so that
#: a run through vLLM's engine shows which MoE communication path each rank took: MC2 (the distribute pair), All2All
#: (``npu_moe_token_permute``), AllGather (``npu_moe_init_routing_v2``). Read by ``gptoss_patch_testkit.jobs.serve_job``.
ANNOUNCED = frozenset({"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "npu_moe_token_permute",
                       "npu_moe_init_routing_v2"})
_announced: set[str] = set()


def _announce(name: str) -> None:
    _announced.add(name)
    import logging
    import os

    logging.getLogger("vllm.gptoss_patch").info("gptoss-patch NPU simulator: pid %d: first torch_npu.%s launch",
                                                os.getpid(), name)


def _dispatch(name: str, fn: Callable[..., Any], host_params: tuple[str, ...], host_only: bool, args: tuple,
              kwargs: dict) -> Any:
    if name in ANNOUNCED and name not in _announced:
        _announce(name)
    if placement.active():  # the placement audit: NPU arguments checked, the kernel's own work not audited
        if not host_only:
            placement.check_operator(name, _positional_names(fn), host_params, args, kwargs)
        with placement.suspended():
            result = _dispatch_unaudited(name, fn, host_params, host_only, args, kwargs)
        placement.mark_resident(result)  # what an operator returns (a workspace too) is NPU memory
        return result
    return _dispatch_unaudited(name, fn, host_params, host_only, args, kwargs)


def _dispatch_unaudited(name: str, fn: Callable[..., Any], host_params: tuple[str, ...], host_only: bool,
                        args: tuple, kwargs: dict) -> Any:
    cap = _capture
    if _tls.device_exec or (cap is not None and cap.leaf_depth and cap.mine()):
        return fn(*args, **kwargs)
    upd = _update
    if (upd is not None and not host_only and upd.thread == threading.get_ident()
            and device.current_stream() == upd.stream):
        return _intercept_update(upd, name, fn, host_params, args, kwargs)
    if cap is not None and cap.mine():
        if host_only:
            with cap.leaf():
                return fn(*args, **kwargs)
        return cap.record_npu(name, fn, host_params, args, kwargs)
    if not host_only and _runtime.queues:
        _runtime.check_issue(device.current_stream(), f"torch_npu.{name}", _tensors((args, kwargs)))
    return fn(*args, **kwargs)


def capture_idle() -> bool:
    """True when no NPU graph capture is underway in this process (a collective then needs no recording)."""
    return _capture is None


def record_collective(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run a collective of the simulated ``hccl`` backend; during a capture on this thread, also record it as a task.

    An HCCL collective issued on a stream in capture state is captured into the ACL graph like a kernel and runs
    again at every replay (CANN "aclmdlRICaptureBegin": tasks issued to the capturing stream, HCCL's included, are
    recorded into the model runtime instance; vllm-ascend's PIECEWISE and FULL graphs at TP > 1 rely on it). The
    simulator runs the collective eagerly at capture (as it runs everything) and records one node that re-issues it,
    synchronously, on the same tensors at replay; every rank replays its graphs in the same order, so the ranks'
    collectives pair up as they did at capture.

    Args:
        name: the ``torch.distributed`` function name (the node is ``hccl.<name>``).
        fn: the unwrapped ``torch.distributed`` function; ``args`` / ``kwargs``: its call (``async_op`` is replayed
            as False: the replayed task completes before the next one starts, as tasks on one stream do).

    Returns:
        ``fn``'s result (a ``Work`` for ``async_op=True``, else None).
    """
    cap = _capture
    if _tls.device_exec or cap is None or not cap.mine() or cap.leaf_depth:
        return fn(*args, **kwargs)
    with cap.leaf():
        result = fn(*args, **kwargs)
    args, kwargs = _launch_args(fn, (), args, kwargs)
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    if bound is not None and "async_op" in inspect.signature(fn).parameters:
        bound.arguments["async_op"] = False  # positional or keyword alike
        args, kwargs = bound.args, bound.kwargs
    cap.add(_OpNode(f"hccl.{name}", fn, args, kwargs, None, npu=False))
    return result


def _intercept_update(upd: _Update, name: str, fn: Callable[..., Any], host_params: tuple[str, ...], args: tuple,
                      kwargs: dict) -> Any:
    global _update
    group = upd.handle._node_indices
    nodes = upd.handle._graph._nodes
    k = len(upd.calls)
    if k >= len(group):
        _update = None
        raise RuntimeError(
            f"graph task update: torch_npu.{name} is task {k + 1} but the task group captured {len(group)} task(s); "
            "the update must issue the same number and types of tasks as the group "
            "(ACL aclmdlRICaptureTaskUpdateBegin)")
    node = nodes[group[k]]
    if node.name != name:
        _update = None
        raise RuntimeError(
            f"graph task update: torch_npu.{name} issued where the task group captured torch_npu.{node.name}; the "
            "update must re-issue the same kernel with new arguments (ACL: task types must match the group)")
    upd.calls.append(_launch_args(fn, host_params, args, kwargs))
    return node.result


# --------------------------------------------------------------------------------------------------------------
# public API


class TaskGroupHandle:
    """``torch_npu._C._NPUTaskGroupHandle``: a captured task group (pybind class without constructor, PT-graphcpp).

    ``task_group`` is a read-only opaque id, like the ``aclrtTaskGrp`` pointer of the real handle.
    """

    __slots__ = ("_graph", "_generation", "_node_indices", "_capture_stream", "_id")

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("torch_npu._C._NPUTaskGroupHandle: No constructor defined!")

    @classmethod
    def _make(cls, npu_graph: "NPUGraph", node_indices: list[int], stream: device.Stream) -> "TaskGroupHandle":
        self = object.__new__(cls)
        self._graph, self._generation = npu_graph, npu_graph._generation
        self._node_indices, self._capture_stream, self._id = tuple(node_indices), stream, next(_ids)
        return self

    @property
    def task_group(self) -> int:
        return self._id

    def __repr__(self) -> str:
        ops = ", ".join(self._graph._nodes[i].name for i in self._node_indices) if self._valid() else "stale"
        return f"<simulated _NPUTaskGroupHandle {self._id}: {ops}>"

    def _valid(self) -> bool:
        return self._graph._generation == self._generation and self._graph._has_graph


class ExternalEvent:
    """``torch.npu.ExternalEvent``: an event that graph capture records as an external node (OPD73-graph).

    ``record(stream)`` sets the event when the stream reaches it; ``wait(stream)`` blocks the stream until the event
    is set (it may be issued before the ``record``); ``reset(stream)`` clears it. Documented call orders:
    wait -> reset -> record, or record -> wait -> reset; so an event must be reset before it is recorded again, and a
    reset must not discard a record that no wait consumed. On the CPU the ordering is kept exactly (queued stream
    work, see the module docstring) and a violation raises ``RuntimeError`` naming the rule.
    """

    def __init__(self) -> None:
        self._set = False
        self._waited = False
        self._id = next(_ids)

    def record(self, stream: device.Stream | None = None) -> None:
        """Record the event on ``stream`` (current stream if None)."""
        self._issue("record", stream)

    def wait(self, stream: device.Stream | None = None) -> None:
        """Make ``stream`` wait until the event is recorded."""
        self._issue("wait", stream)

    def reset(self, stream: device.Stream | None = None) -> None:
        """Clear the event on ``stream`` so it can be recorded again."""
        self._issue("reset", stream)

    def _issue(self, op: str, stream: device.Stream | None) -> None:
        stream = stream if stream is not None else device.current_stream()
        cap = _capture
        if cap is not None and cap.mine() and stream == cap.stream:
            cap.add(_EventNode(op, self))
            return
        _runtime.submit(stream, _EventTask(op, self))

    def _execute(self, op: str) -> bool:
        """Execute ``op`` in device order; False when a wait must block."""
        rule = ("documented call orders are wait->reset->record or record->wait->reset "
                "(torch_npu.npu.ExternalEvent, op-plugin 7.3.0 docs)")
        if op == "wait":
            if not self._set:
                return False
            self._waited = True
        elif op == "record":
            if self._set:
                raise RuntimeError(f"{self!r} recorded again before it was reset: an ExternalEvent must be reset "
                                   f"before reuse; {rule}")
            self._set, self._waited = True, False
        else:
            if self._set and not self._waited:
                raise RuntimeError(f"{self!r} reset after a record that no wait consumed; {rule}")
            self._set = self._waited = False
        return True

    def __repr__(self) -> str:
        return f"<simulated ExternalEvent {self._id} {'set' if self._set else 'clear'}>"


#: NPU graphs captured and replayed in this process (read by the main job through the log lines of :func:`_count`).
COUNTS = {"captures": 0, "replays": 0, "hccl_tasks": 0}


def _count(what: str) -> None:
    """Count a capture or a replay; log the running total at every capture and at the 1st, 2nd, 4th, 8th, ... replay (a
    process's log then shows the captures and at least how many replays happened, e.g. vLLM's engine-core process,
    which exits without running ``atexit`` handlers)."""
    COUNTS[what] += 1
    n = COUNTS[what]
    if what == "captures" or n & (n - 1) == 0:
        import logging
        import os

        logging.getLogger("vllm.gptoss_patch").info("gptoss-patch NPU simulator: pid %d: %d NPU graph %s", os.getpid(),
                                                    n, what)


class NPUGraph:
    """``torch.npu.NPUGraph``: a captured program of the simulated device (PT-graphs, PT-graphcpp)."""

    update = NotEmulated("torch.npu.NPUGraph.update")  # auto_dispatch_capture graphs only
    debug_dump = NotEmulated("torch.npu.NPUGraph.debug_dump")
    enable_debug_mode = NotEmulated("torch.npu.NPUGraph.enable_debug_mode")
    super_kernel_optimize = NotEmulated("torch.npu.NPUGraph.super_kernel_optimize")
    register_generator_state = NotEmulated("torch.npu.NPUGraph.register_generator_state")

    def __init__(self) -> None:
        self._has_graph = False
        self._nodes: list[_OpNode | _EventNode] = []
        self._host_reads: list[str] = []
        self._pool: tuple[int, int] | None = None
        self._generation = 0
        self._active: list[_ReplayTask] = []
        self.auto_dispatch_capture = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        """Begin capturing work issued on the current stream (use :class:`graph` rather than calling this)."""
        global _capture
        if capture_error_mode not in _ERROR_MODES:
            raise RuntimeError("Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                               f"{capture_error_mode}")
        if self._has_graph:
            raise RuntimeError("This NPUGraph instance already owns a captured graph. To capture a new graph, create "
                               "a new instance.")
        stream = device.current_stream()
        if stream == device.default_stream():
            raise RuntimeError("NPU graphs must be captured on a non-default stream. (However, after capture, it's ok "
                               "to replay them on the default stream.)")
        if _capture is not None:
            raise RuntimeError("another NPU graph capture is underway; only one capture may be underway at a time in "
                               "the process (torch.npu.graph)")
        if stream in _runtime.queues:
            raise RuntimeError(f"cannot begin a capture on {stream!r}: it is blocked ({_runtime.blocked_by(stream)})")
        if pool is not None:
            self._pool = tuple(pool)  # type: ignore[assignment]
        else:
            self._pool = (next(_ids), 0)
        _capture = _Capture(self, stream)
        _capture.mode.__enter__()

    def capture_end(self) -> None:
        """End the capture; afterwards :meth:`replay` may be called."""
        global _capture
        cap = _capture
        if cap is None or cap.graph is not self or not cap.mine():
            raise RuntimeError("NPUGraph.capture_end() without a capture_begin() on this graph")
        if device.current_stream() != cap.stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        _remove_mode(cap.mode)
        _capture = None
        self._nodes, self._host_reads = cap.nodes, cap.host_reads
        self._has_graph = True
        _count("captures")
        hccl = sum(1 for n in cap.nodes if n.name.startswith("hccl."))
        if hccl:
            COUNTS["hccl_tasks"] += hccl
            import logging
            import os

            logging.getLogger("vllm.gptoss_patch").info(
                "gptoss-patch NPU simulator: pid %d: NPU graph %d holds %d HCCL collective task(s)", os.getpid(),
                COUNTS["captures"], hccl)
        if cap.group is not None:
            raise RuntimeError("graph_task_group_begin() without graph_task_group_end() before the capture ended")

    def replay(self) -> None:
        """Execute the captured program on the current stream (it stays queued while an ExternalEvent wait blocks)."""
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        if _capture is not None:
            raise RuntimeError("NPUGraph.replay() during a capture is not simulated")
        stream = device.current_stream()
        if self._active and stream not in _runtime.queues:
            raise RuntimeError("NPUGraph.replay(): a previous replay of this graph is still queued on another stream "
                               "(waiting for an ExternalEvent); concurrent executions of one graph are not simulated")
        _runtime.submit(stream, _ReplayTask(self))
        _count("replays")

    def reset(self) -> None:
        """Delete the captured graph (its task-group handles become invalid)."""
        if self._active:
            raise RuntimeError("NPUGraph.reset() while a replay of the graph is still queued")
        self._has_graph = False
        self._nodes, self._host_reads = [], []
        self._generation += 1

    def pool(self) -> tuple[int, int]:
        """Id of the graph's memory pool (shareable with another capture)."""
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph::pool() without a preceding successful capture.")
        assert self._pool is not None
        return self._pool

    # -- simulator extensions (not in torch_npu) ---------------------------------------------------------------------
    @property
    def sim_recorded_ops(self) -> list[str]:
        """Names of the recorded nodes, in replay order (simulator extension, for tests)."""
        return [n.name for n in self._nodes]

    @property
    def sim_host_reads(self) -> list[str]:
        """Host reads during capture whose value was baked into the program (``.item()`` etc.; extension)."""
        return list(self._host_reads)

    @property
    def sim_pending(self) -> bool:
        """True while a replay of this graph is queued behind an unrecorded ExternalEvent (extension)."""
        return bool(self._active)


class graph:
    """``torch.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global")``.

    Synchronises, empties caches, makes ``stream`` (default: a class-level side stream) current and begins the
    capture; on exit ends it and restores the stream (PT-graphs).
    """

    default_capture_stream: device.Stream | None = None

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: device.Stream | None = None,
                 auto_dispatch_capture: bool = False, capture_error_mode: str = "global"):
        if auto_dispatch_capture:
            raise NotEmulatedError("torch.npu.graph(auto_dispatch_capture=True) is not emulated by "
                                   "gptoss_patch_testkit.npu_sim")
        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = device.Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        self._stream_ctx: Any = None

    def __enter__(self) -> None:
        device.synchronize()
        device.empty_cache()
        self._stream_ctx = device.stream(self.capture_stream)
        self._stream_ctx.__enter__()
        try:
            self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            self.npu_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(exc_type, exc_value, traceback)


def graph_pool_handle() -> tuple[int, int]:
    """An opaque token naming a graph memory pool (PT-graphcpp: ``MempoolId_t`` with only the second value set)."""
    return (0, next(_ids))


def is_current_stream_capturing() -> bool:
    """True when an NPU graph capture is underway on the current stream of this thread."""
    cap = _capture
    return cap is not None and cap.mine() and device.current_stream() == cap.stream


def graph_task_group_begin(stream: device.Stream) -> None:
    """Open a task group on ``stream``, which must be capturing (ACL-rt, OPD73-graph)."""
    cap = _capture
    if cap is None or not cap.mine() or stream != cap.stream:
        raise RuntimeError(f"graph_task_group_begin: {stream!r} is not capturing an NPU graph; a task group can only "
                           "be opened on a stream in capture state (ACL aclmdlRICaptureTaskGrpBegin)")
    if cap.group is not None:
        raise RuntimeError("graph_task_group_begin: a task group is already open on this stream; begin/end are used "
                           "in pairs (nested task groups are not supported)")
    cap.group = []


def graph_task_group_end(stream: device.Stream) -> TaskGroupHandle:
    """Close the task group opened on ``stream`` and return its handle."""
    cap = _capture
    if cap is None or not cap.mine() or cap.group is None:
        raise RuntimeError("graph_task_group_end without a matching graph_task_group_begin")
    if stream != cap.stream:
        raise RuntimeError("graph_task_group_end: the stream must be the one passed to graph_task_group_begin "
                           "(OPD73-graph)")
    handle = TaskGroupHandle._make(cap.graph, cap.group, stream)
    cap.group = None
    return handle


def graph_task_update_begin(stream: device.Stream, handle: TaskGroupHandle) -> None:
    """Start re-issuing the operators of ``handle``'s task group on ``stream`` with new arguments."""
    global _update
    if not isinstance(handle, TaskGroupHandle):
        raise TypeError(f"graph_task_update_begin: handle must be a torch_npu._C._NPUTaskGroupHandle, got "
                        f"{type(handle).__name__}")
    if _update is not None:
        raise RuntimeError("graph_task_update_begin: an update is already open; begin/end are used in pairs")
    if not handle._valid():
        raise RuntimeError("graph_task_update_begin: the task group's graph has not finished its capture or was reset")
    if stream == handle._capture_stream:
        raise RuntimeError("graph_task_update_begin: the update stream must differ from the stream the graph was "
                           "captured on (OPD73-graph)")
    if _capture is not None and stream == _capture.stream:
        raise RuntimeError("graph_task_update_begin: the update stream must not be capturing (ACL "
                           "aclmdlRICaptureTaskUpdateBegin)")
    _update = _Update(stream, handle)


def graph_task_update_end(stream: device.Stream) -> None:
    """Finish the update begun on ``stream``; the new arguments take effect as work on ``stream``."""
    global _update
    upd = _update
    if upd is None or upd.thread != threading.get_ident():
        raise RuntimeError("graph_task_update_end without a matching graph_task_update_begin")
    if stream != upd.stream:
        raise RuntimeError("graph_task_update_end: the stream must be the one passed to graph_task_update_begin "
                           "(OPD73-graph)")
    _update = None
    group = upd.handle._node_indices
    if len(upd.calls) != len(group):
        raise RuntimeError(
            f"graph task update issued {len(upd.calls)} task(s) but the task group captured {len(group)}; the number "
            "and types of tasks must match the group (ACL aclmdlRICaptureTaskUpdateBegin)")
    nodes = [upd.handle._graph._nodes[i] for i in group]
    _runtime.submit(stream, _UpdateTask(nodes, upd.calls))  # type: ignore[arg-type]


def reset_state() -> None:
    """Drop all queued work, any capture and any open update (test isolation; the self-test's graph harness reaches
    it through ``torch_npu.__gptoss_simulator_services__``, :class:`gptoss_patch_testkit.npu_sim.Services`)."""
    global _capture, _update
    _runtime.reset()
    if _capture is not None:
        _remove_mode(_capture.mode)
        _capture.graph._active.clear()
        _capture = None
    _update = None


device._runtime = _runtime


def weak_ref_tensor(tensor: Any) -> Any:
    """``torch_npu._C._weak_ref_tensor``: a tensor over the same memory as ``tensor`` (same shape, strides, offset).

    vllm-ascend 0.16.0rc1+ calls it where 0.15.0rc1 called its own ``torch.ops._C_ascend.weak_ref_tensor``
    (``vllm_ascend/utils.py`` ``weak_ref_tensor``: "The new tensor will share the same data as the original tensor,
    but will not keep the original tensor alive"), e.g. for the outputs ``ACLGraphWrapper`` keeps of a captured piece
    (``compilation/acl_graph.py``). On the device it is a non-owning view; on the CPU a non-owning tensor could
    outlive its memory, so the simulator returns an owning alias (``tensor.detach()``): the same values and
    addresses, only a longer lifetime - as :func:`gptoss_patch_testkit.npu_sim.ops.moe.c_ascend_weak_ref_tensor`.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` (vllm-ascend passes non-tensors through before calling).
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_npu._C._weak_ref_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    return tensor.detach()


#: What ``torchair.register_replacement`` was given in this process, in order (:func:`register_replacement`).
TORCHAIR_REPLACEMENTS: list[dict[str, Any]] = []


def register_replacement(search_fn: Any, replace_fn: Any, example_inputs: Any, trace_fn: Any = None,
                         extra_check: Any = None, search_fn_pattern: Any = None) -> None:
    """``torchair.register_replacement``: register a pattern replacement for torchair's ``npugraph_ex`` compiler.

    torchair's API mirrors ``torch._inductor.pattern_matcher.register_replacement``: it stores ``search_fn`` ->
    ``replace_fn`` (traced with ``example_inputs``; applied where ``extra_check`` accepts the match) for the FX passes
    of the ``npugraph_ex`` compile backend, and returns nothing; nothing is rewritten at registration. vllm-ascend
    0.16.0rc1+ registers each graph-fusion pattern twice, with vLLM's inductor pattern matcher and with this
    (``vllm_ascend/compilation/passes/base_pattern.py`` ``BasePattern.register``). The simulator never runs the
    ``npugraph_ex`` compiler (the serve job turns it off: ``serve_job.npugraph_ex_off``), so here the registration
    is recorded in :data:`TORCHAIR_REPLACEMENTS` and has no consumer - as on a device whose deployment turned
    ``npugraph_ex`` off. The arguments are kept as given (no tracing).
    """
    TORCHAIR_REPLACEMENTS.append({"search_fn": search_fn, "replace_fn": replace_fn, "example_inputs": example_inputs,
                                  "trace_fn": trace_fn, "extra_check": extra_check,
                                  "search_fn_pattern": search_fn_pattern})

NAMESPACE: dict[str, Any] = {
    "ExternalEvent": ExternalEvent,
    "NPUGraph": NPUGraph,
    "graph": graph,
    "graph_pool_handle": graph_pool_handle,
    "is_current_stream_capturing": is_current_stream_capturing,
    "graph_task_group_begin": graph_task_group_begin,
    "graph_task_group_end": graph_task_group_end,
    "graph_task_update_begin": graph_task_update_begin,
    "graph_task_update_end": graph_task_update_end,
}
