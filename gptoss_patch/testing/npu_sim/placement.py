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

* **Resident memory.** A storage is *resident* (NPU memory) when it was allocated by a call that asked for the NPU
  (``device="npu"``, ``"npu:0"``, an integer device, ``torch.device("npu")`` - which the simulator hands out as
  ``torch.device("cpu", 0)``, :data:`NPU_MARK`, while auditing, so that it stays recognisable after code stores it -,
  the ``with torch.device("npu"):`` context, ``Tensor.to("npu")``, ``Tensor.npu()``), produced by an operation with
  a resident input, or returned by an emulated operator. Views share their base's storage and placement.
* **Host memory.** Allocated with no device or with ``"cpu"``; ``.cpu()`` / ``.to("cpu")`` of a resident tensor
  returns a new host copy (host and device memory are different memory on the device; on the CPU the same call
  would return the tensor itself), and ``.to("npu")`` / ``.npu()`` of a host tensor a new resident one.
* **Not judged.** Allocated with a ``torch.device("cpu")`` *object*: ``Tensor.device`` is not a torch function, so on
  the simulator it answers ``cpu`` for every tensor, and ``torch.empty(n, device=t.device)`` may stand for the NPU.
* **Checks.** (1) An operation taking host and resident tensors together (0-dim host tensors count as scalars)
  raises :class:`PlacementError` naming the operation; ``copy_``, ``to``, indexing and ``__setitem__`` are allowed
  (transfers, host index tensors). (2) An emulated ``torch_npu`` operator (:func:`check_operator`, called by
  ``graph.route``'s dispatch) requires every tensor argument to be resident, except those it reads on the host at
  launch (``graph.HOST_PARAMS``: FIA's length lists, the ATB operators' ``seq_len`` / ``context_lens``, which
  vllm-ascend passes as host tensors; docs/operators.md §3.7). The operator's own computation (the device kernel) is
  not audited.

What it cannot see: tensors made before the audit began count as host memory (build what you audit inside it), an
operation run in another thread is not checked, and "not judged" memory is never flagged. Memory registered under the
audit is kept alive until the audit ends, so that a freed address is never mistaken for another tensor's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves


class PlacementError(RuntimeError):
    """A tensor in host memory where the NPU needs device memory (or the two mixed in one operation)."""


#: What ``torch.device("npu")`` becomes while auditing: the host device with index 0 - a value no host code asks for
#: (host code writes ``"cpu"``), so an NPU request stays recognisable after it was stored in ``self.device``.
NPU_MARK = torch.device("cpu", 0)

_lock = threading.Lock()
_owner: int | None = None                 # thread id of the audit in progress
_resident: dict[int, Any] = {}            # storage data_ptr -> the storage (kept alive)
_unknown: dict[int, Any] = {}             # allocated on a device read from a tensor (``t.device``): not judged

#: Operations allowed to take host and resident tensors together: transfers, and indexing by host index tensors.
_MIXING_ALLOWED = frozenset({
    torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.to, torch.Tensor.cpu,
    torch.Tensor.index_put_, torch.Tensor.set_, torch.Tensor.new_tensor,
})


_tls = threading.local()


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


def mark_resident(obj: Any) -> None:
    """Register every tensor in ``obj`` (nested containers too) as NPU memory under the current audit."""
    if _owner is not None:
        _mark(obj, _resident)


@contextlib.contextmanager
def audit() -> Iterator[None]:
    """Context manager: audit placement in the calling thread (see the module docstring).

    Raises:
        RuntimeError: an audit is already in progress (in any thread; audits do not nest).
        PlacementError: from inside the block, where host memory reaches the device.
    """
    global _owner
    with _lock:
        if _owner is not None:
            raise RuntimeError("a placement audit is already in progress; audits do not nest")
        _owner = threading.get_ident()
    try:
        yield
    finally:
        with _lock:
            _owner = None
            _resident.clear()
            _unknown.clear()


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def is_resident(t: torch.Tensor) -> bool:
    """True when ``t`` lives in (simulated) NPU memory under the current audit; empty tensors count as resident
    (they have no memory to be anywhere)."""
    if t.numel() == 0:
        return True
    k = _key(t)
    return k is not None and k in _resident


def is_host(t: torch.Tensor) -> bool:
    """True when ``t`` is known to live in host memory under the current audit: neither resident nor allocated on
    a device read from another tensor (which the audit cannot place, see the module docstring)."""
    if t.numel() == 0:
        return False
    k = _key(t)
    return k is not None and k not in _resident and k not in _unknown


def _mark(obj: Any, where: dict[int, Any] | None) -> None:
    if where is None:
        return
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.numel():
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            k = s.data_ptr()
            if where is _resident:
                _unknown.pop(k, None)
            elif k in _resident:
                continue
            where[k] = s


def is_npu_request(d: Any) -> bool:
    """True when ``d`` (a device argument) names the NPU: ``"npu"``/``"npu:N"``, a ``torch.device`` of type npu,
    :data:`NPU_MARK`, or an integer (an index of the accelerator)."""
    if isinstance(d, torch.device):
        return d.type == "npu" or (d.type == "cpu" and d.index == 0)
    if isinstance(d, str):
        return d.partition(":")[0] == "npu" or d == "cpu:0"
    return isinstance(d, int) and not isinstance(d, bool)


def _is_unknown_request(d: Any) -> bool:
    """A ``torch.device("cpu")`` object: on the simulator what every ``Tensor.device`` answers (``Tensor.device`` is
    not a torch function), so it may stand for the NPU; host code names the host ``"cpu"``."""
    return isinstance(d, torch.device) and d.type == "cpu" and d.index is None


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


def _check_mixing(func: Callable, args: tuple, kwargs: dict) -> None:
    if func in _MIXING_ALLOWED:
        return
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() and t.numel()]
    if len(tensors) < 2:
        return
    host = [t for t in tensors if is_host(t)]
    if host and any(is_resident(t) for t in tensors):
        name = (getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        name = name.replace("_VariableFunctionsClass.", "torch.").replace("TensorBase.", "Tensor.")
        raise PlacementError(f"{name}: tensors in NPU memory and in host memory in one operation (host: "
                             f"{', '.join(_describe(t) for t in host)}); a real NPU raises 'Expected all tensors to be "
                             "on the same device' - move the host tensor to the NPU first")


def handle(func: Callable, args: tuple, kwargs: dict, call: Callable[[tuple, dict], Any]) -> Any:
    """Run one torch function under the audit (called by ``device.NPUOnCPU`` before it maps devices to the host).

    ``call(args, kwargs)`` runs ``func`` with the simulator's device mapping; this decides residency around it.

    Raises:
        PlacementError: the call mixes resident and host tensors (see the module docstring).
    """
    if func is torch.Tensor.to or func is torch.Tensor.cpu:
        src = args[0]
        target = "cpu" if func is torch.Tensor.cpu else _to_target(args, kwargs)
        if isinstance(target, torch.Tensor):
            target = NPU_MARK if is_resident(target) else ("cpu" if is_host(target) else torch.device("cpu"))
        out = call(args, kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        same = bool(out.numel()) and _key(out) == _key(src)
        if target is None or _is_unknown_request(target):  # dtype only, or a device read from a tensor: as is
            if not same:
                _mark(out, _resident if is_resident(src) else _unknown if not is_host(src) else None)
            return out
        if is_npu_request(target):
            if not is_resident(src):
                out = out.clone() if same else out
                _mark(out, _resident)
            return out
        if is_resident(src) and same:  # "cpu" / .cpu(): a host copy, new unregistered memory
            return out.clone()
        return out
    _check_mixing(func, args, kwargs)
    device_arg = kwargs.get("device")
    out = call(args, kwargs)
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs:
        return out  # in place / out=: the destination keeps its placement
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel()]
    if (device_arg is not None and is_npu_request(device_arg)) or any(is_resident(t) for t in leaves):
        _mark(out, _resident)
    elif (device_arg is not None and _is_unknown_request(device_arg)) or any(not is_host(t) for t in leaves):
        _mark(out, _unknown)
    return out


def npu_copy(t: torch.Tensor) -> torch.Tensor:
    """``Tensor.npu()`` under the audit: ``t`` itself when resident, else a resident copy."""
    if is_resident(t):
        return t
    out = t.clone()
    _mark(out, _resident)
    return out


def check_operator(name: str, positional: tuple[str, ...], host_params: tuple[str, ...], args: tuple,
                   kwargs: dict) -> None:
    """Check the tensor arguments of an emulated ``torch_npu`` operator call under the audit: every tensor (also
    inside list arguments) must be resident, except the arguments in ``host_params`` (read on the host at launch).

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
