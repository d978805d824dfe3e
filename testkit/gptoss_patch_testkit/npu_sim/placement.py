"""Placement audit: which tensors live in the simulated NPU's memory, and where host memory reaches the device.

The simulated NPU's memory is host memory (``device.py``): ``torch.empty(..., device="npu")`` is a CPU tensor, and a
tensor someone forgot to move to the NPU computes the same numbers here. On an Ascend host it does not: torch_npu's
operators take NPU tensors (an ``aclnn`` kernel launched with a host tensor fails), and PyTorch refuses an
operation mixing NPU and host tensors (``Expected all tensors to be on the same device``: PyTorch's device check of
an operator's tensor arguments, e.g. ``TensorIteratorBase::compute_types`` in ``aten/src/ATen/TensorIterator.cpp``,
where a 0-dim host tensor is accepted as a scalar). Code exercised only on the
simulator - the self-test's harnesses most of all - could therefore be wrong about placement and pass here.

Under :func:`audit` (one thread at a time; the self-test runs its cases under it on the simulator), the simulator
keeps the distinction PyTorch keeps on a device (docs/simulator.md §4.1):

* **NPU memory.** A storage is NPU memory when it was allocated by a call that asked for the NPU (``device="npu"``,
  ``"npu:0"``, an integer device, ``torch.device("npu")`` - which the simulator hands out as ``torch.device("cpu",
  0)``, :data:`NPU_MARK`, while auditing, so that it stays recognisable after code stores it -, the ``with
  torch.device("npu"):`` context, ``Tensor.to("npu")``, ``Module.to("npu")``, ``Tensor.npu()``), produced by an
  operation with an NPU input and no other device asked, or returned by an emulated operator. Views share their
  base's storage and placement. ``Tensor.device`` of NPU memory answers :data:`NPU_MARK` during the audit, so
  ``torch.empty(n, device=t.device)`` and ``x.to(t.device)`` follow ``t`` as on the device.
* **Host memory.** Allocated with no device or ``"cpu"`` (the string), or produced from host inputs only. Moving
  between the two is a copy, as on the device (on the CPU the same call would return the tensor itself):
  ``.cpu()`` / ``.to("cpu")`` of NPU memory and ``.to("npu")`` / ``.npu()`` / ``torch.as_tensor(h, device="npu")`` of
  host memory return new memory.
* **Not judged.** Tensors made before the audit began, and allocations given a ``torch.device("cpu")`` object (it may
  have been made for the NPU before the audit, when the simulator hands out plain host devices).
* **Checks.** (1) An operation taking host and NPU tensors together raises :class:`PlacementError` naming the
  operation; a 0-dim *host* tensor takes part as a scalar (TensorIterator's rule; a 0-dim NPU tensor does not
  legalise host memory); ``copy_``, ``to``, indexing, ``__setitem__`` and ``p.data = x`` are allowed (transfers,
  host index tensors, rebinding a parameter). (2) An emulated ``torch_npu`` operator (:func:`check_operator`,
  called by ``graph.route``'s dispatch) and vllm-ascend's kernels (``torch.ops._C_ascend``) refuse a tensor argument
  in host memory (also inside list arguments), except the arguments an operator reads on the host at launch
  (``graph.HOST_PARAMS``: FIA's length lists, the ATB operators' ``seq_len`` / ``context_lens``, which vllm-ascend
  passes as host tensors; docs/operators.md §3.7). The operator's own computation (the device kernel) is not audited.

What it cannot see: "not judged" memory is never flagged, and an operation run in another thread is not checked. The
registry holds weak references only (a storage leaves it when freed, so a reused address is never mistaken for an
earlier tensor's); an audit forgets everything when it ends.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves


class PlacementError(RuntimeError):
    """A tensor in host memory where the NPU needs device memory (or the two mixed in one operation)."""


#: What an NPU device becomes while auditing: the host device with index 0 - a value no host code asks for (host code
#: writes ``"cpu"``), so an NPU request stays recognisable after it was stored (``self.device``) or read back
#: (``Tensor.device`` of NPU memory). Code that writes ``"cpu:0"`` itself would be read as asking for the NPU.
NPU_MARK = torch.device("cpu", 0)

NPU, HOST = "npu", "host"

_lock = threading.Lock()
_owner: int | None = None   # thread id of the audit in progress
#: storage data_ptr -> (NPU or HOST, weak reference to the storage). An entry leaves when its storage is freed
#: (storages keep their Python object for life, so the weak reference dies with the memory): no address is
#: mistaken for an earlier tensor's, and nothing is kept alive.
_place: dict[int, tuple[str, Any]] = {}
_tls = threading.local()
_base_device = torch._C.TensorBase.device  # the C getter of Tensor.device (shadowed on torch.Tensor while auditing)


def _names(*funcs: Any) -> frozenset:
    return frozenset(funcs)


#: Operations allowed to take host and NPU tensors together: transfers, indexing by host index tensors, rebinding a
#: parameter's memory (``p.data = x``, PyTorch's shallow-copy check of ``Module._apply``).
_MIXING_ALLOWED = _names(torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.to,
                         torch.Tensor.cpu, torch.Tensor.index_put_, torch.Tensor.set_, torch.Tensor.new_tensor,
                         torch._has_compatible_shallow_copy_type)
_DATA_SET = torch._C.TensorBase.data.__set__


def active() -> bool:
    """True in the thread whose audit is in progress (and not :func:`suspended` there)."""
    return _owner is not None and _owner == threading.get_ident() and not getattr(_tls, "suspended", False)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Context manager: not audited inside (an emulated operator's own computation - the device kernel - may use
    host tensors of its own)."""
    prev = getattr(_tls, "suspended", False)
    _tls.suspended = True
    try:
        yield
    finally:
        _tls.suspended = prev


def _device_getter(self: torch.Tensor) -> torch.device:
    d = _base_device.__get__(self)
    if active() and d.type == "cpu" and placement_of(self) == NPU:
        return NPU_MARK
    return d


@contextlib.contextmanager
def audit() -> Iterator[None]:
    """Context manager: audit placement in the calling thread (see the module docstring). While it runs,
    ``Tensor.device`` of NPU memory answers :data:`NPU_MARK` in that thread (other tensors and threads: unchanged).

    Raises:
        RuntimeError: an audit is already in progress (in any thread; audits do not nest).
        PlacementError: from inside the block, where host memory reaches the device.
    """
    global _owner
    with _lock:
        if _owner is not None:
            raise RuntimeError("a placement audit is already in progress; audits do not nest")
        _owner = threading.get_ident()
        _place.clear()
        own = torch.Tensor.__dict__.get("device")  # None: torch.Tensor inherits TensorBase's getter
        torch.Tensor.device = property(_device_getter, doc=_base_device.__doc__)  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        with _lock:
            if own is None:
                del torch.Tensor.device
            else:
                torch.Tensor.device = own  # type: ignore[misc]
            _owner = None
            _place.clear()


def placement_of(t: torch.Tensor) -> str | None:
    """``NPU``, ``HOST``, or None (not judged: made before the audit, on a device the audit cannot read, or
    empty) for ``t`` under the current audit."""
    if not t.numel():
        return None
    try:
        k = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    entry = _place.get(k)
    return entry[0] if entry is not None else None


def is_resident(t: torch.Tensor) -> bool:
    """True when ``t`` is known to live in (simulated) NPU memory under the current audit."""
    return placement_of(t) == NPU


def is_host(t: torch.Tensor) -> bool:
    """True when ``t`` is known to live in host memory under the current audit (see :func:`placement_of`)."""
    return placement_of(t) == HOST


def _forget(key: int, ref: Any) -> None:
    entry = _place.get(key)
    if entry is not None and entry[1] is ref:
        _place.pop(key, None)


def _mark(obj: Any, kind: str | None) -> None:
    if kind is None:
        return
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.numel():
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            k = s.data_ptr()
            if not k:
                continue
            ref = weakref.ref(s, lambda r, k=k: _forget(k, r))
            _place[k] = (kind, ref)


def mark_resident(obj: Any) -> None:
    """Register every tensor in ``obj`` (nested containers too) as NPU memory under the current audit."""
    if _owner is not None:
        _mark(obj, NPU)


def is_npu_request(d: Any) -> bool:
    """True when ``d`` (a device argument) names the NPU: ``"npu"``/``"npu:N"``, a ``torch.device`` of type npu,
    :data:`NPU_MARK` (``"cpu:0"``), or an integer (an index of the accelerator)."""
    if isinstance(d, torch.device):
        return d.type == "npu" or (d.type == "cpu" and d.index == 0)
    if isinstance(d, str):
        return d.partition(":")[0] == "npu" or d == "cpu:0"
    return isinstance(d, int) and not isinstance(d, bool)


def _request(d: Any) -> str | None:
    """What a device argument asks for: NPU, HOST (the string ``"cpu"``), or None - not judged: a
    ``torch.device("cpu")`` object, which may have been made before the audit for the NPU (the simulator hands out
    ``torch.device("npu")`` as the host device outside an audit)."""
    if is_npu_request(d):
        return NPU
    if isinstance(d, str) and d == "cpu":
        return HOST
    return None


def _to_target(args: tuple, kwargs: dict) -> Any:
    """The device of a ``Tensor.to`` call (None: a dtype-only conversion), or a tensor whose placement to copy."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, torch.Tensor)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
    return None


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _op_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.replace("_VariableFunctionsClass.", "torch.").replace("TensorBase.", "Tensor.")


def _check_mixing(func: Callable, args: tuple, kwargs: dict) -> None:
    if func in _MIXING_ALLOWED or func == _DATA_SET:
        return
    placed = [(t, placement_of(t)) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # a 0-dim host tensor takes part as a scalar (TensorIterator); a 0-dim NPU tensor does not make host memory legal
    host = [t for t, p in placed if p == HOST and t.dim()]
    if host and any(p == NPU for _, p in placed):
        raise PlacementError(f"{_op_name(func)}: tensors in NPU memory and in host memory in one operation (host: "
                             f"{', '.join(_describe(t) for t in host)}); a real NPU raises 'Expected all tensors to be "
                             "on the same device' - move the host tensor to the NPU first")


def _shares(out: Any, t: torch.Tensor) -> bool:
    return (isinstance(out, torch.Tensor) and out.numel() > 0 and t.numel() > 0
            and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())


def _transfer(func: Callable, args: tuple, kwargs: dict, call: Callable[[tuple, dict], Any]) -> Any:
    """``Tensor.to`` / ``Tensor.cpu``: a move between host and NPU memory is a copy (new memory, as on the device)."""
    src = args[0]
    target = "cpu" if func is torch.Tensor.cpu else _to_target(args, kwargs)
    if isinstance(target, torch.Tensor):
        want = placement_of(target)
    elif isinstance(target, int) and not isinstance(target, bool):
        want = NPU
    else:
        want = _request(target) if target is not None else None
    out = call(args, kwargs)
    if not isinstance(out, torch.Tensor):
        return out
    have = placement_of(src)
    if want is None or want == have:  # no device change (a dtype conversion, or already there)
        if not _shares(out, src):
            _mark(out, have)
        return out
    if _shares(out, src):
        out = out.clone()
    _mark(out, want)
    return out


def _is_c_ascend(func: Any) -> bool:
    """True for ``torch.ops._C_ascend.<op>`` (an ``OpOverloadPacket`` or ``OpOverload``)."""
    qualified = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", "")
    return (getattr(func, "namespace", None) or str(qualified).partition("::")[0]) == "_C_ascend"


def handle(func: Callable, args: tuple, kwargs: dict, call: Callable[[tuple, dict], Any]) -> Any:
    """Run one torch function under the audit (called by ``device.NPUOnCPU`` before it maps devices to the host).

    ``call(args, kwargs)`` runs ``func`` with the simulator's device mapping; this decides placement around it.

    Raises:
        PlacementError: the call mixes host and NPU tensors, or hands a vllm-ascend kernel (``torch.ops._C_ascend``)
            host memory (see the module docstring).
    """
    if func is torch.Tensor.to or func is torch.Tensor.cpu:
        return _transfer(func, args, kwargs, call)
    if _is_c_ascend(func):  # vllm-ascend's compiled kernels take NPU tensors, like torch_npu's operators
        for i, t in enumerate(tree_leaves((args, kwargs))):
            if isinstance(t, torch.Tensor) and is_host(t):
                raise PlacementError(f"{func}: argument {i} {_describe(t)} is in host memory; vllm-ascend's "
                                     "kernel takes NPU tensors - place it with .to('npu')")
    else:
        _check_mixing(func, args, kwargs)
    device = kwargs.get("device")
    out = call(args, kwargs)
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs or func == _DATA_SET:
        return out  # in place / out= / p.data = x: the destination's memory keeps (or takes) its placement
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel()]
    if device is None:  # the inputs decide: NPU if any is there, host if all are known to be on the host
        kinds = {placement_of(t) for t in inputs}
        want = NPU if NPU in kinds else (None if None in kinds else HOST)
    else:
        want = _request(device)
    if want is not None:
        # torch.as_tensor(x, device=...) and friends return x itself when it is already there: a move is a copy
        for t in inputs:
            if _shares(out, t) and placement_of(t) not in (None, want):
                out = out.clone()
                break
    _mark(out, want)
    return out


def npu_copy(t: torch.Tensor) -> torch.Tensor:
    """``Tensor.npu()`` under the audit: ``t`` itself when in NPU memory, else an NPU copy."""
    if is_resident(t):
        return t
    out = t.clone()
    _mark(out, NPU)
    return out


def check_operator(name: str, positional: tuple[str, ...], host_params: tuple[str, ...], args: tuple,
                   kwargs: dict) -> None:
    """Check the tensor arguments of an emulated ``torch_npu`` operator call under the audit: no tensor (also inside
    list arguments) may be in host memory, except the arguments in ``host_params`` (read on the host at launch).

    Args:
        name: operator name (``torch_npu.<name>`` in the message); positional: its positional parameter names.

    Raises:
        PlacementError: naming the operator, the argument and its shape - the argument a real NPU would reject.
    """
    named = list(zip(positional, args)) + [(f"argument {i}", a) for i, a in enumerate(args[len(positional):],
                                                                                           len(positional))]
    named += list(kwargs.items())
    for arg, value in named:
        if arg in host_params:
            continue
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and is_host(t):
                raise PlacementError(f"torch_npu.{name}: {arg} {_describe(t)} is in host memory; the operator takes "
                                     "NPU tensors (a real NPU rejects the launch) - place it with .to('npu')")
