"""What vllm-ascend's worker process needs from the NPU runtime besides operators: extension loading, device memory
accounting, pyACL.

Semantics and sources:

* ``torch_npu.op_plugin.atb._atb_ops._register_atb_extensions()``: loads the ATB (Ascend Transformer Boost) operator
  library so that ``torch.ops.atb.*`` exist (torch_npu ``op_plugin/atb/_atb_ops.py``; vllm-ascend calls it in
  ``NPUWorker.__init__``, ``vllm_ascend/worker/worker_v1.py``). It returns nothing. The simulator registers no ATB
  operators, so a later ``torch.ops.atb.X`` call fails loudly ("no such operator"); the call itself is recorded.
* Device memory (``torch.npu.mem_get_info``, ``memory_stats``, ``memory_allocated``, ``memory_reserved`` and their
  ``max_`` forms, ``reset_peak_memory_stats``;
  torch_npu ``torch_npu/npu/memory.py``, the same contract as ``torch.cuda``): the simulated NPU's memory is this
  process's host memory. Its capacity is ``GPTOSS_PATCH_SIM_NPU_MEMORY`` (bytes, a plain integer or with a
  ``GiB``/``MiB`` suffix; default 8 GiB, far below a 910B3's 64 GB so that a KV cache sized by
  ``gpu_memory_utilization`` fits in host memory). "Allocated" is the growth of the process's resident set
  (``/proc/self/statm``) since the simulator was installed, and the peak is the growth of its high-water mark
  (``VmHWM`` in ``/proc/self/status``), both measured, not invented; ``reset_peak_memory_stats`` resets that mark
  through ``/proc/self/clear_refs`` (``5``, Linux ``proc(5)``). Free = capacity − allocated.
* pyACL ``acl.rt`` (CANN "acl.rt" Python API): only the names vllm-ascend binds at import
  (``vllm_ascend/device_allocator/camem.py``: ``memcpy``); calling one raises ``NotEmulatedError`` (sleep mode, the
  only user, is not simulated).
"""

from __future__ import annotations

import os

__all__ = ["register_atb_extensions", "atb_registered", "capacity_bytes", "mem_get_info", "memory_stats",
           "max_memory_allocated", "memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_peak_memory_stats"]

_atb_calls = 0
_PAGE = os.sysconf("SC_PAGE_SIZE")


def register_atb_extensions() -> None:
    """``_register_atb_extensions()``: the ATB library load; records the call, registers no operator (see module doc)."""
    global _atb_calls
    _atb_calls += 1


def atb_registered() -> int:
    """How many times the worker asked for the ATB extensions in this process."""
    return _atb_calls


def capacity_bytes() -> int:
    """Capacity of the simulated device in bytes (``GPTOSS_PATCH_SIM_NPU_MEMORY``, default 8 GiB).

    Raises:
        ValueError: the variable is not a positive integer with an optional ``KiB``/``MiB``/``GiB`` suffix.
    """
    from gptoss_patch_testkit import config

    return config.size_bytes(config.SIM_NPU_MEMORY)


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _hwm() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _rss()


_baseline = _rss()


def memory_allocated(device: object = None) -> int:
    """Bytes the simulated device holds now: resident-set growth since the simulator was installed (>= 0)."""
    return max(_rss() - _baseline, 0)


def max_memory_allocated(device: object = None) -> int:
    """Peak of :func:`memory_allocated` since start or the last :func:`reset_peak_memory_stats`."""
    return max(_hwm() - _baseline, memory_allocated())


def reset_peak_memory_stats(device: object = None) -> None:
    """Reset the peak to the current value (writes ``5`` to ``/proc/self/clear_refs``; ignored where not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def memory_reserved(device: object = None) -> int:
    """Bytes held by the (absent) caching allocator: equal to :func:`memory_allocated` - nothing is cached."""
    return memory_allocated()


def max_memory_reserved(device: object = None) -> int:
    """Peak of :func:`memory_reserved`: equal to :func:`max_memory_allocated`."""
    return max_memory_allocated()


def memory_stats(device: object = None) -> dict[str, int]:
    """The keys of ``torch.npu.memory_stats()`` that vllm-ascend reads: ``allocated_bytes.all.{current,peak}``
    (and the same for ``reserved_bytes``: the simulator keeps no caching allocator, so reserved == allocated)."""
    cur, peak = memory_allocated(), max_memory_allocated()
    return {"allocated_bytes.all.current": cur, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": cur, "reserved_bytes.all.peak": peak}


def mem_get_info(device: object = None) -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the simulated device: ``(capacity - allocated, capacity)``.

    Raises:
        RuntimeError: the process holds more host memory than the simulated capacity (the device would be out of
            memory); raise ``GPTOSS_PATCH_SIM_NPU_MEMORY``.
    """
    cap, used = capacity_bytes(), memory_allocated()
    if used > cap:
        raise RuntimeError(f"simulated NPU out of memory: {used} bytes in use > GPTOSS_PATCH_SIM_NPU_MEMORY={cap}")
    return cap - used, cap
