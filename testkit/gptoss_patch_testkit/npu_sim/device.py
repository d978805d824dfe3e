"""The simulated ``torch.npu`` / ``torch_npu.npu`` device namespace: one NPU backed by host memory.

Semantics follow torch_npu's Python API (Ascend/pytorch ``torch_npu/npu/__init__.py``,
``streams.py``, ``utils.py``; ``docs/simulator.md`` §2). Streams and events keep no
real concurrency (CPU execution is synchronous) but keep their documented ordering rules, so
misuse is still an error. The one exception is work an NPU graph replay leaves queued behind an
``ExternalEvent`` wait (``graph.py``): while a stream is blocked that way, ``synchronize``, ``query``,
``wait_stream`` and events recorded on it follow the queued work through the hooks ``graph.py`` installs
in :data:`_runtime` (without queued graph work the behaviour is the plain synchronous one). Device memory
*is* host memory (its accounting is in ``runtime.py``),
``synchronize`` is a no-op because every CPU op has completed when it returns.

The simulated device is an Atlas A2 (Ascend910B1, SoC version 220), matching the
``vllm_ascend/_build_info.py`` of the x86_64 wheels (``__soc_version__ = 'ASCEND910B1'``) and
vllm-ascend's mapping 220-225 → A2 (``vllm_ascend/utils.py`` ``init_ascend_soc_version``).
"""

from __future__ import annotations


import contextlib
import threading
from typing import Any, Iterator

from torch.overrides import TorchFunctionMode

from gptoss_patch_testkit import config
from gptoss_patch_testkit.npu_sim import aten, placement

#: ACL SoC version of Ascend910B1 (torch_npu ``NpuVariables.h`` ``SocVersion::Ascend910B1``).
SOC_VERSION = 220
SOC_NAME = "Ascend910B1"

#: ``GPTOSS_PATCH_SIM_SOC_VERSION`` makes the simulated device *identify* as another SoC (e.g. ``200``, an Atlas
#: 300I Duo / 310P3 in vllm-ascend's mapping 200-205 -> 310P, ``vllm_ascend/utils.py`` ``get_ascend_device_type``;
#: 250-255, the Atlas A3 SoCs Ascend910_93xx that vllm-ascend reads as A3, ``init_ascend_soc_version``), so that code
#: choosing a backend by device type can be tested. Only the identification changes: every operator keeps the
#: documented Atlas A2 semantics, except the MC2 operators, which exist here only as on A3 (``ops/moe_distribute.py``).
#: Names and numbers: torch_npu ``torch_npu/csrc/core/npu/NpuVariables.h`` ``SocVersion``.
_SOC_OVERRIDE = {200: "Ascend310P3", 201: "Ascend310P1", 202: "Ascend310P2", 203: "Ascend310P3", 204: "Ascend310P4",
                 205: "Ascend310P5", 220: "Ascend910B1", 221: "Ascend910B2", 222: "Ascend910B2C", 223: "Ascend910B3",
                 224: "Ascend910B4", 225: "Ascend910B4-1", 250: "Ascend910_9391", 251: "Ascend910_9392",
                 252: "Ascend910_9381", 253: "Ascend910_9382", 254: "Ascend910_9372", 255: "Ascend910_9362"}
if config.soc_version() is not None:  # ValueError for a number the table does not have
    SOC_VERSION = config.soc_version()
    SOC_NAME = _SOC_OVERRIDE[SOC_VERSION]

#: Ordering hooks installed by ``graph.py`` (queued graph work behind an ExternalEvent); None until it is imported.
_runtime: Any = None


class Stream:
    """``torch.npu.Stream``: an ordering handle. CPU execution is synchronous, so work is complete on return."""

    _next_id = 0
    _id_lock = threading.Lock()

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        with Stream._id_lock:
            Stream._next_id += 1
            self.stream_id = Stream._next_id
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        """Wait for the stream's work: nothing is outstanding on the CPU unless a graph replay is queued on it
        behind an unrecorded ExternalEvent, which would never complete (``RuntimeError``)."""
        if _runtime is not None:
            _runtime.stream_synchronize(self)

    def query(self) -> bool:
        """True when all work submitted to this stream has completed."""
        return True if _runtime is None else _runtime.stream_idle(self)

    def wait_stream(self, stream: "Stream") -> None:
        """Make this stream wait for the work submitted to ``stream`` so far (only queued graph work is pending)."""
        if _runtime is not None:
            _runtime.wait_tasks(self, _runtime.snapshot(stream))

    def wait_event(self, event: "Event") -> None:
        """Make this stream wait for ``event``."""
        event.wait(self)

    def record_event(self, event: "Event | None" = None) -> "Event":
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def __repr__(self) -> str:
        return f"<simulated npu Stream {self.stream_id}>"


_DEFAULT_STREAM = Stream()
_state = threading.local()


def current_stream(device: Any = None) -> Stream:
    """The stream of the current ``torch.npu.stream(...)`` context, else the default stream."""
    return getattr(_state, "stream", None) or _DEFAULT_STREAM


def default_stream(device: Any = None) -> Stream:
    """The device's default stream."""
    return _DEFAULT_STREAM


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current for this thread."""
    _state.stream = stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    """Context manager selecting ``s`` as the current stream (``torch.npu.stream``); ``None`` is a no-op."""
    if s is None:
        yield None
        return
    prev = getattr(_state, "stream", None)
    _state.stream = s
    try:
        yield s
    finally:
        _state.stream = prev


class Event:
    """``torch.npu.Event``: records a point on a stream. On the CPU every recorded point has completed."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any):
        self.enable_timing = enable_timing
        self.recorded = False
        self._after: tuple[Any, ...] = ()  # queued graph work the record follows (normally none)

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (default: current)."""
        self.recorded = True
        if _runtime is not None:
            self._after = _runtime.snapshot(stream if stream is not None else current_stream())

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` wait for the event; waiting on an unrecorded event is a no-op, as in CUDA/NPU."""
        if _runtime is not None and self._after:
            _runtime.wait_tasks(stream if stream is not None else current_stream(), self._after)

    def query(self) -> bool:
        """True when the recorded work has completed."""
        return True if _runtime is None else _runtime.tasks_done(self._after)

    def synchronize(self) -> None:
        """Wait for the recorded work (``RuntimeError`` if it is queued behind an ExternalEvent: a hang)."""
        if _runtime is not None:
            _runtime.synchronize_tasks(self._after, "Event.synchronize()")


def current_device() -> int:
    """Index of the current device: the simulator has one device, 0."""
    return 0


def device_count() -> int:
    """Number of simulated devices (1)."""
    return 1


def is_available() -> bool:
    """True: the simulated device is present."""
    return True


def set_device(device: Any) -> None:
    """Select the device; only device 0 (or ``"npu"``/``"npu:0"``) exists.

    Raises:
        RuntimeError: another index is asked for.
    """
    idx = getattr(device, "index", device)
    if isinstance(idx, str):
        idx = idx.partition(":")[2] or 0
    if idx not in (None, 0, "0"):
        raise RuntimeError(f"simulated NPU: device {device!r} does not exist (one device, index 0)")


@contextlib.contextmanager
def device(d: Any) -> Iterator[None]:
    """``torch.npu.device(d)`` context manager; validates the index like :func:`set_device`."""
    set_device(d)
    yield


def synchronize(device: Any = None) -> None:
    """Wait for all device work: CPU ops complete before they return (``RuntimeError`` when graph work is queued
    behind an unrecorded ExternalEvent - a real NPU would hang - or during a graph capture)."""
    if _runtime is not None:
        _runtime.device_synchronize()


def get_device_name(device: Any = None) -> str:
    """Device name of the simulated SoC."""
    return SOC_NAME


def get_soc_version() -> int:
    """ACL SoC version number (220 = Ascend910B1, Atlas A2)."""
    return SOC_VERSION


def empty_cache() -> None:
    """Release cached blocks: the simulator keeps no caching allocator."""


def set_compile_mode(jit_compile: bool = False) -> None:
    """Select operator JIT compilation: no effect on the CPU."""


class _Config:
    """``torch.npu.config``: ``allow_internal_format`` (private formats such as FRACTAL_NZ allowed)."""

    allow_internal_format = True


config = _Config()


def mirror_privateuse1_kernels_to_cpu() -> None:
    """Make every kernel registered for the ``PrivateUse1`` (NPU) dispatch key also serve CPU tensors.

    The simulated device's tensors are CPU tensors, so a custom op that upstream registers only for
    ``PrivateUse1`` by vLLM or vllm-ascend code (e.g. vllm-ascend 0.11's ``vllm::unified_ascend_attention_with_output``, through
    vLLM's ``direct_register_custom_op(..., dispatch_key="PrivateUse1")``) would find no kernel.
    This wraps :meth:`torch.library.Library.impl` once: a ``PrivateUse1`` registration is repeated
    for ``CPU`` with the same function. Registrations made before the simulator was installed are
    not mirrored (install it before importing vllm-ascend).
    """
    import functools

    import torch.library

    _MIRRORED = ("vllm", "vllm_ascend")  # upstream's custom ops only, not torch's own PrivateUse1 kernels
    orig = torch.library.Library.impl
    if getattr(orig, "_gptoss_sim_mirror", False):
        return

    @functools.wraps(orig)
    def impl(self, op_name, fn=None, dispatch_key="", *args, **kwargs):
        result = orig(self, op_name, fn, dispatch_key, *args, **kwargs)
        if dispatch_key == "PrivateUse1" and getattr(fn, "__module__", "").split(".")[0] in _MIRRORED:
            orig(self, op_name, fn, "CPU", *args, **kwargs)
        return result

    impl._gptoss_sim_mirror = True  # type: ignore[attr-defined]
    torch.library.Library.impl = impl  # type: ignore[method-assign]


def _lazy_init() -> None:
    """``torch.npu._lazy_init``: initialise the device runtime - nothing to initialise on the CPU."""


def _is_npu(d: Any) -> bool:
    import torch

    if isinstance(d, torch.device):
        return d.type == "npu"
    if isinstance(d, str):
        return d.partition(":")[0] == "npu"
    return False


_mode = None  # the mapping mode of the first thread that entered it; each thread's own: current_mapping()
_PIN_MEMORY = None
_DEVICE = None  # torch.device, bound by enter_device_mapping
_HISTC: tuple = (None, None)  # torch.histc, Tensor.histc; bound by enter_device_mapping (integers: aten.integer_histc)


class NPUOnCPU(TorchFunctionMode):
    """Rewrites ``device`` arguments that name the NPU to ``"cpu"`` (see :func:`enter_device_mapping`). At module
    level so that TorchDynamo can name it when vLLM (0.13+) saves a compiled model as a package."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if placement.active():  # the placement audit (placement.py) decides residency around the mapped call
            return placement.handle(func, args, kwargs, lambda a, k: self._mapped(func, a, k))
        return self._mapped(func, args, kwargs)

    def _mapped(self, func, args, kwargs):
        if func is _PIN_MEMORY:
            # ``Tensor.pin_memory()`` (vllm-ascend 0.15's metadata builder calls it before ``.to("npu")``):
            # page-locking is a transfer-speed property with no effect on values, and the simulated device
            # shares host memory; PyTorch's CPU pin_memory would ask for the PrivateUse1 hooks the simulator
            # does not register. Return a copy, as pin_memory() of an unpinned tensor does.
            return args[0].clone()
        if kwargs.get("pin_memory"):
            # ``torch.zeros(..., pin_memory=True)`` (NPUModelRunner's host staging buffers): page-locked host
            # memory, a transfer-speed property; the same allocation unpinned has the same values.
            kwargs = dict(kwargs, pin_memory=False)
        if func is _DEVICE and args and (_is_npu(args[0]) or (isinstance(args[0], int)
                                                            and not isinstance(args[0], bool))):
            # ``torch.device("npu", 0)``, ``torch.device("npu:0")``, ``torch.device(0)`` (index 0 of the current
            # accelerator, as vLLM's MemorySnapshot builds it from ``current_platform.current_device()``): all the same
            # host device, without an index, so that devices built either way compare equal (while auditing
            # placement: placement.NPU_MARK, the host device with index 0, so that the request stays recognisable)
            return placement.NPU_MARK if placement.active() else func("cpu")
        if func is _HISTC[0] or func is _HISTC[1]:
            first = args[0] if args else kwargs.get("input")
            if first is not None and not first.is_floating_point():
                # an integer histogram: aclnnHistc supports it on the device, PyTorch's CPU kernel does not
                return aten.integer_histc(*args, **kwargs)
        dev = kwargs.get("device")
        # the host stands for the NPU (placement.NPU_MARK while auditing placement: still recognisable downstream)
        host = placement.NPU_MARK if placement.active() else "cpu"
        # an int device is an index of the accelerator (torch.npu.current_device() returns one)
        if dev is not None and (_is_npu(dev) or (isinstance(dev, int) and not isinstance(dev, bool))):
            kwargs = dict(kwargs, device=host)
        if any(_is_npu(a) for a in args):
            args = tuple(host if _is_npu(a) else a for a in args)
        return func(*args, **kwargs)


def current_mapping() -> "NPUOnCPU | None":
    """The device-mapping mode this thread entered (None: it has not called :func:`enter_device_mapping`)."""
    return getattr(_state, "mode", None)


def enter_device_mapping() -> None:
    """Map every NPU device request to the CPU, for the current thread (idempotent).

    The simulated NPU's memory is host memory: ``torch.empty(..., device="npu")``,
    ``t.to("npu")``, ``with torch.device("npu"):`` and ``t.npu()`` give CPU tensors. Implemented as a
    :class:`torch.overrides.TorchFunctionMode` pushed once at the bottom of the mode stack, so
    ``torch.device`` context managers (which push their own mode on top) are rewritten too
    (``docs/simulator.md`` §2). Torch function modes are thread-local: call this in
    every thread that allocates on the simulated device.
    """
    global _mode, _PIN_MEMORY, _DEVICE, _HISTC
    import torch

    _PIN_MEMORY = torch.Tensor.pin_memory
    _DEVICE = torch.device
    _HISTC = (torch.histc, torch.Tensor.histc)

    if getattr(_state, "mapped", False):
        return
    mode = NPUOnCPU()
    mode.__enter__()
    _state.mapped = True
    _state.mode = mode
    if _mode is None:  # the first thread's (the main thread's, as the simulator is installed there)
        _mode = mode
    if not hasattr(torch.Tensor, "npu") or not getattr(torch.Tensor.npu, "_gptoss_sim", False):
        def npu(self, device=None, non_blocking=False, memory_format=None):
            """``Tensor.npu()``: the simulated device shares host memory, so the tensor itself (under the placement
            audit: a resident copy of a host tensor, ``placement.npu_copy``)."""
            return placement.npu_copy(self) if placement.active() else self

        npu._gptoss_sim = True  # type: ignore[attr-defined]
        torch.Tensor.npu = npu  # type: ignore[attr-defined]
    if not hasattr(torch.Tensor, "is_npu"):
        # what torch.utils.generate_methods_for_privateuse1_backend() defines (``device.type == "npu"``); TorchDynamo's
        # get_testing_overrides() reads it. Simulated NPU tensors are host tensors, so it answers as their device does.
        torch.Tensor.is_npu = property(lambda self: self.device.type == "npu")  # type: ignore[attr-defined]


#: name -> gloo backend of an ``hccl`` group, for every communicator whose name was asked (``get_hccl_comm_name``);
#: the strong reference keeps pybind11's Python wrapper alive, so the group's backend is the same object every time.
_HCCL_COMMS: dict[str, Any] = {}


def give_gloo_an_hccl_name() -> None:
    """Give the simulator's gloo backends the name of an HCCL communicator, and let MC2's operators find them by it.

    vllm-ascend asks the device group's backend for ``get_hccl_comm_name(rank)`` (``TokenDispatcherWithMC2.__init__``
    in ``vllm_ascend/ops/moe/token_dispatcher.py``; the ``_HCOMM_INFO`` of ``ops/linear_op.py``) and passes the name
    as ``group_ep`` to ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``, which address the communicator by it
    (op-plugin's example, ``torch_npu-npu_moe_distribute_combine_v2.md``, gets it the same way). The simulator's
    collectives run on gloo; this adds the method to ``ProcessGroupGloo``: each backend gets one name,
    ``"gptoss-sim-hccl-<n>"`` (n counts the communicators named in this process; the name is process-local, as the
    operators only use it on the rank that asked), whatever ``rank`` is passed (vllm-ascend passes the group rank in
    one place and the global rank in the other). :func:`hccl_backend` maps the name back to the backend.

    Raises (from the method):
        TypeError: ``rank`` is not a non-negative int.
    """
    import torch.distributed as dist

    cls = dist.ProcessGroupGloo
    if getattr(cls, "_gptoss_sim_named", False):
        return

    def get_hccl_comm_name(self, rank: int) -> str:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TypeError(f"get_hccl_comm_name(rank): rank must be a non-negative int, got {rank!r}")
        for name, backend in _HCCL_COMMS.items():
            if backend is self:
                return name
        name = f"gptoss-sim-hccl-{len(_HCCL_COMMS)}"
        _HCCL_COMMS[name] = self
        return name

    cls.get_hccl_comm_name = get_hccl_comm_name
    cls._gptoss_sim_named = True


def hccl_backend(name: str) -> Any:
    """The gloo backend named ``name`` by ``get_hccl_comm_name`` in this process (see :func:`give_gloo_an_hccl_name`).

    Raises:
        RuntimeError: no communicator of that name (the operator's ``group_ep`` / ``group_tp`` is wrong).
    """
    try:
        return _HCCL_COMMS[name]
    except KeyError:
        known = ", ".join(sorted(_HCCL_COMMS)) or "none"
        raise RuntimeError(f"no HCCL communicator named {name!r} in this process (named so far: {known}); pass "
                           "the name get_hccl_comm_name returned for the group") from None


def register_accelerator_hooks() -> None:
    """Register the simulated NPU with PyTorch's accelerator layer (``torch.accelerator``), as torch_npu does in C++.

    Renaming PrivateUse1 to ``npu`` and registering ``torch.npu`` make ``torch.accelerator.current_accelerator()``
    answer ``npu``; the C++ side then wants the backend's hooks and device guard (``PrivateUse1HooksInterface``,
    ``DeviceGuardImplInterface``), which the real torch_npu registers from C++. Without them, TorchDynamo (used by
    vLLM's piecewise compilation) fails at ``torch.accelerator.current_stream()`` and ``pin_memory=True`` fails.
    PyTorch's Python registration (``torch._C._acc.register_python_privateuseone_hook`` /
    ``register_python_privateuseone_device_guard``, the mechanism of
    ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, torch 2.9+) gives one device,
    index 0, whose current stream is its default stream (id 0): true of the one simulated NPU of a process. Idempotent.
    """
    import torch

    acc = getattr(torch._C, "_acc", None)
    if acc is None or getattr(register_accelerator_hooks, "_done", False):
        return

    class _Hooks(acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, dev_id: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class _Guard(acc.DeviceGuard):
        def type_(self):
            return torch._C._autograd.DeviceType.PrivateUse1

    # keep references: the C++ side holds raw pointers to these objects
    register_accelerator_hooks._objects = (_Hooks(), _Guard())  # type: ignore[attr-defined]
    acc.register_python_privateuseone_hook(register_accelerator_hooks._objects[0])
    acc.register_python_privateuseone_device_guard(register_accelerator_hooks._objects[1])
    # The simulator maps every ``torch.device("npu", i)`` to the host device (enter_device_mapping), so the
    # accelerator API receives ``cpu`` where the program named the NPU (TorchDynamo's stream guards evaluate
    # ``torch.device('npu', 0)``): read a host device as the simulated NPU's index.
    import torch.accelerator as accel
    import torch.accelerator._utils as accel_utils

    original = accel_utils._get_device_index

    def _get_device_index(device, optional: bool = False) -> int:
        if isinstance(device, torch.device) and device.type == "cpu":
            return 0 if device.index is None else device.index
        return original(device, optional)

    accel_utils._get_device_index = _get_device_index
    if getattr(accel, "_get_device_index", None) is original:
        accel._get_device_index = _get_device_index

    def synchronize(device=None) -> None:
        """``torch.accelerator.synchronize`` on the simulated NPU: wait until every stream of the device is idle.

        PyTorch's C++ side asks the backend's device guard (``DeviceGuardImplInterface::synchronizeDevice``), which the
        Python registration cannot provide ("Backend doesn't support synchronizing all streams on device"; vLLM
        0.18's ``GPUModelRunner.capture_model`` calls it). The simulator runs every operator on the host before the
        call returns, so every stream is idle already: nothing to wait for (as ``torch_npu.npu.synchronize`` here).
        """
        if device is not None:
            _get_device_index(device if not isinstance(device, str) else torch.device(device), True)

    accel.synchronize = synchronize
    register_accelerator_hooks._done = True  # type: ignore[attr-defined]


#: Where vLLM defines ``direct_register_custom_op`` (vLLM 0.11: ``vllm/utils/__init__.py``; 0.12 on:
#: ``vllm/utils/torch_utils.py``), through which vLLM and vllm-ascend register their Python custom-op kernels.
CUSTOM_OP_REGISTRARS = ("vllm.utils", "vllm.utils.torch_utils")


def _mapped_kernel(op_func: Any) -> Any:
    """``op_func`` running under a fresh :class:`NPUOnCPU` mode, with ``op_func``'s globals (torch's ``infer_schema``
    evaluates string annotations in the function's ``__globals__``), name, annotations and ``__wrapped__``."""
    import functools
    import types

    mode_cls = NPUOnCPU

    def kernel(*args, **kwargs):
        with mode_cls():
            return op_func(*args, **kwargs)

    mapped = types.FunctionType(kernel.__code__, op_func.__globals__, op_func.__name__, None, kernel.__closure__)
    functools.update_wrapper(mapped, op_func)
    mapped._gptoss_sim_mapped = True  # type: ignore[attr-defined]
    return mapped


def map_devices_in_custom_op_kernels() -> None:
    """Run the Python kernels of vLLM's and vllm-ascend's custom operators under the NPU -> CPU device mapping.

    vLLM's model calls its custom ops through ``torch.ops`` (``torch.ops.vllm.moe_forward``,
    ``unified_attention_with_output``, vllm-ascend's ``maybe_pad_and_reduce``, ...). A torch function mode sees that
    call and, as PyTorch does for every mode handler, runs it with the mode taken off the stack; the op's Python
    kernel therefore ran without the mapping, and a kernel that allocates on the NPU itself - vllm-ascend's All2All
    ``async_all_to_all`` (``ops/moe/comm_utils.py``: ``torch.empty(..., device=torch.npu.current_device())``) - reached
    PyTorch's PrivateUse1 backend ("Could not run ... from the 'npu' backend"). On the device such a tensor is NPU
    memory; on the simulated device it is host memory, as everywhere else. The hook wraps ``direct_register_custom_op``
    (:data:`CUSTOM_OP_REGISTRARS`, a post-import hook run before any model module imports it) so that each registered
    kernel enters a :class:`NPUOnCPU` mode for its own body (:func:`_mapped_kernel`). Fake (meta) kernels and the
    op schemas are untouched; idempotent.
    """
    import functools
    import sys

    import wrapt

    def hook(module) -> None:
        original = getattr(module, "direct_register_custom_op", None)
        if original is None or getattr(original, "_gptoss_sim_mapped", False):
            return

        @functools.wraps(original)
        def direct_register_custom_op(op_name, op_func, *args, **kwargs):
            return original(op_name, _mapped_kernel(op_func), *args, **kwargs)

        direct_register_custom_op._gptoss_sim_mapped = True  # type: ignore[attr-defined]
        module.direct_register_custom_op = direct_register_custom_op

    for name in CUSTOM_OP_REGISTRARS:
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            wrapt.register_post_import_hook(hook, name)


#: Where vllm-ascend builds its graph-fusion patterns (0.15.0rc1 on): ``GraphFusionPassManager.configure`` constructs
#: every pass, and each pass traces its pattern with example inputs allocated ``device="npu"``
#: (``vllm_ascend/compilation/passes/*.py``; first reached by the main job on 0.16.0rc1, whose default
#: ``fuse_muls_add`` adds ``muls_add_pass.py`` ``torch.randn(2, 2048, device="npu")``).
FUSION_PASS_SETUP = ("vllm_ascend.compilation.graph_fusion_pass_manager", "GraphFusionPassManager", "configure")


def map_devices_in_fusion_pass_setup() -> None:
    """Run vllm-ascend's graph-fusion pass set-up (:data:`FUSION_PASS_SETUP`) under the NPU -> CPU device mapping.

    vLLM calls the pass manager from its compile backend (``vllm/compilation/backends.py`` ``configure_post_pass``),
    which TorchDynamo invokes after tracing, with the torch function mode stack it saved for the traced frame set
    aside: the simulator's mapping (:func:`enter_device_mapping`, a :class:`NPUOnCPU` mode) is not active there, so
    ``device="npu"`` reached PyTorch's PrivateUse1 backend ("Could not run 'aten::empty.memory_format' with arguments
    from the 'npu' backend"; vllm-ascend 0.16.0rc1 - 0.18.0 with PIECEWISE graphs). On the device these example
    inputs are NPU tensors that only feed pattern tracing; on the simulated device they are host tensors, as
    everywhere else. Only the set-up is wrapped: the compile itself runs as before. Installed as a post-import hook
    (idempotent).
    """
    import sys

    import wrapt

    module_name, cls_name, method = FUSION_PASS_SETUP

    def mapped(wrapped, instance, args, kwargs):
        with NPUOnCPU():
            return wrapped(*args, **kwargs)

    def hook(module) -> None:
        cls = getattr(module, cls_name, None)
        if cls is None or getattr(cls.__dict__.get(method), "_self_gptoss_sim_mapped", False):
            return
        wrapt.wrap_function_wrapper(cls, method, mapped)
        cls.__dict__[method]._self_gptoss_sim_mapped = True  # on the wrapper itself (wrapt keeps _self_* there)

    if module_name in sys.modules:
        hook(sys.modules[module_name])
    else:
        wrapt.register_post_import_hook(hook, module_name)


def add_is_hccl_available() -> None:
    """``torch.distributed.is_hccl_available``: added to ``torch.distributed``, True once the simulator's ``hccl``
    backend is registered (:func:`gptoss_patch_testkit.npu_sim.distributed.register_hccl_backend`).

    The real torch_npu installs this function into ``torch.distributed`` at import (documented torch_npu
    API "(beta) torch.distributed.is_hccl_available", Ascend/op-plugin docs). vllm-ascend >= 0.15 imports it
    by name while its general plugin ``register_model_loader`` loads
    (vllm_ascend/model_loader/netloader/executor/netloader_pg.py), and vLLM's ``init_distributed_environment``
    asks ``torch.distributed.is_backend_available("hccl")`` - which calls it - before creating the process groups:
    answering False there made every device group fall back to gloo ("Distributed backend hccl is not available"),
    so the groups were not the ``hccl`` groups users get and graph capture did not record their collectives.
    """
    import torch.distributed as dist

    if not hasattr(dist, "is_hccl_available"):
        def is_hccl_available() -> bool:
            return "hccl" in dist.Backend.backend_list

        dist.is_hccl_available = is_hccl_available  # type: ignore[attr-defined]


def _is_in_bad_fork() -> bool:
    """``torch.npu._is_in_bad_fork``: False - the CPU-backed device survives ``fork`` (no device context to lose)."""
    return False


def manual_seed(seed: int) -> None:
    """``torch.npu.manual_seed``: the simulated device draws from the CPU generator, seeded by ``torch.manual_seed``."""


def manual_seed_all(seed: int) -> None:
    """``torch.npu.manual_seed_all``: see :func:`manual_seed` (one device)."""
