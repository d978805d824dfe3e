"""The simulated ``torch.npu`` / ``torch_npu.npu`` device namespace: one NPU backed by host memory.

Semantics follow torch_npu's Python API (Ascend/pytorch ``torch_npu/npu/__init__.py``,
``streams.py``, ``utils.py``; ``shared/reference/npu_ops.md`` §8). Streams and events keep no
real concurrency (CPU execution is synchronous) but keep their documented ordering rules, so
misuse is still an error. Device memory *is* host memory: ``mem_get_info`` reports the host's
available/total memory (``/proc/meminfo``), ``synchronize`` is a no-op because every CPU op
has completed when it returns.

The simulated device is an Atlas A2 (Ascend910B1, SoC version 220), matching the
``vllm_ascend/_build_info.py`` of the x86_64 wheels (``__soc_version__ = 'ASCEND910B1'``) and
vllm-ascend's mapping 220-225 → A2 (``vllm_ascend/utils.py`` ``init_ascend_soc_version``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

#: ACL SoC version of Ascend910B1 (torch_npu ``NpuVariables.h`` ``SocVersion::Ascend910B1``).
SOC_VERSION = 220
SOC_NAME = "Ascend910B1"


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
        """Wait for the stream's work: nothing is outstanding on the CPU."""

    def query(self) -> bool:
        """True: all work submitted to this stream has completed."""
        return True

    def wait_stream(self, stream: "Stream") -> None:
        """Make this stream wait for ``stream``: already ordered on the CPU."""

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

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (default: current)."""
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` wait for the event; waiting on an unrecorded event is a no-op, as in CUDA/NPU."""

    def query(self) -> bool:
        """True: the recorded work has completed."""
        return True

    def synchronize(self) -> None:
        """Wait for the recorded work: complete already."""


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
    """Wait for all device work: CPU ops complete before they return."""


def get_device_name(device: Any = None) -> str:
    """Device name of the simulated SoC."""
    return SOC_NAME


def get_soc_version() -> int:
    """ACL SoC version number (220 = Ascend910B1, Atlas A2)."""
    return SOC_VERSION


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the simulated device = the host's MemAvailable / MemTotal."""
    info = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info["MemAvailable"], info["MemTotal"]


def empty_cache() -> None:
    """Release cached blocks: the simulator keeps no caching allocator."""


def set_compile_mode(jit_compile: bool = False) -> None:
    """Select operator JIT compilation: no effect on the CPU."""


class _Config:
    """``torch.npu.config``: ``allow_internal_format`` (private formats such as FRACTAL_NZ allowed)."""

    allow_internal_format = True


config = _Config()
