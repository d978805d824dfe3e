"""Upstream Triton kernels the real worker launches on the NPU, emulated on the CPU.

On an Ascend host vLLM's Triton kernels run through triton-ascend; here Triton is absent and must stay absent (its
presence switches vllm-ascend onto other code paths: docs/simulator.md), so ``vllm.triton_utils`` hands out its
``TritonPlaceholder``: ``@triton.jit`` returns the undecorated Python function, and a launch ``kernel[grid](...)``
fails with ``TypeError: 'function' object is not subscriptable``. A kernel a served release launches unconditionally is
emulated here from its own source (the Triton program is the specification: one program instance per grid index,
``tl.load`` / ``tl.store`` on the flat buffers), and installed in place of the placeholder function in the modules
that launch it - only while the name is still the undecorated function, i.e. never over a real Triton kernel.

* :func:`compute_slot_mapping` - vLLM 0.19.1's ``_compute_slot_mapping_kernel`` (``vllm/v1/worker/block_table.py``),
  which vllm-ascend 0.19.1rc1's ``BlockTable.compute_slot_mapping`` (``vllm_ascend/worker/block_table.py``) launches
  for every batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Kernel", "compute_slot_mapping", "install", "KERNELS"]


class Kernel:
    """A Triton kernel's launch syntax over a CPU emulation: ``Kernel(fn)[grid](*args, **constexprs)`` calls
    ``fn(grid, *args, **constexprs)``, ``grid`` a tuple of ints (Triton's launch grid; a callable grid is refused)."""

    def __init__(self, fn: Callable[..., None], name: str) -> None:
        self.fn = fn
        self.__name__ = name
        self.__gptoss_simulator__ = True

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if callable(grid) or not isinstance(grid, tuple) or not all(isinstance(g, int) for g in grid):
            raise TypeError(f"{self.__name__}: the emulation takes a launch grid of ints, got {grid!r}")
        return lambda *args, **kwargs: self.fn(grid, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<NPU simulator emulation of the Triton kernel {self.__name__}>"


def compute_slot_mapping(grid: tuple[int, ...], num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int, block_size: int,
                         slot_mapping: torch.Tensor, *, TOTAL_CP_WORLD_SIZE: int, TOTAL_CP_RANK: int,
                         CP_KV_CACHE_INTERLEAVE_SIZE: int, PAD_ID: int, BLOCK_SIZE: int) -> None:
    """vLLM 0.19.1's ``_compute_slot_mapping_kernel`` (``vllm/v1/worker/block_table.py``), program by program.

    Grid ``(num_reqs + 1,)``. Program ``r < num_reqs`` maps each token ``i`` of request ``r``
    (``query_start_loc[r] <= i < query_start_loc[r + 1]``) at position ``p = positions[i]`` to its KV-cache slot: with
    ``W = TOTAL_CP_WORLD_SIZE`` ranks sharing a virtual block of ``block_size * W`` tokens, block index
    ``b = p // (block_size * W)``, block number ``n = block_table[r, b]`` (read as ``block_table_ptr + r *
    block_table_stride + b``), offset ``o = p - b * block_size * W``; the token is this rank's when ``(o //
    CP_KV_CACHE_INTERLEAVE_SIZE) % W == TOTAL_CP_RANK``, and then ``slot = n * block_size + (o // (W * I)) * I + o %
    I`` (``I`` the interleave size), else ``PAD_ID``. The last program writes ``PAD_ID`` to ``slot_mapping[num_tokens:
    max_num_tokens]`` (padding for graph replay). Tokens in ``[query_start_loc[num_reqs], num_tokens)`` are written by
    no program and keep their values, as on the device. ``BLOCK_SIZE`` (the program's vector width) does not change
    the result.

    Args:
        query_start_loc: int32 ``[>= num_reqs + 1]``. positions: int64 ``[>= num_tokens]``.
        block_table: int32 ``[max_num_reqs, max_num_blocks_per_req]``, row stride ``block_table_stride`` elements.
        slot_mapping: int64 ``[>= max_num_tokens]``, written in place.

    Raises:
        ValueError: a grid that is not ``(num_reqs + 1,)``-shaped, or a ``block_table`` whose rows are not
            ``block_table_stride`` elements apart in one contiguous buffer (the pointer arithmetic above).
    """
    if len(grid) != 1 or grid[0] < 1:
        raise ValueError(f"_compute_slot_mapping_kernel: grid {grid} is not (num_reqs + 1,)")
    if block_table.dim() != 2 or block_table.stride() != (block_table_stride, 1):
        raise ValueError(f"_compute_slot_mapping_kernel: block_table of shape {tuple(block_table.shape)} and strides "
                         f"{block_table.stride()} is not rows of {block_table_stride} contiguous elements")
    num_reqs = grid[0] - 1
    world, rank, inter = TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE
    virtual = block_size * world
    flat = block_table.reshape(-1)
    starts = query_start_loc[:num_reqs + 1].to(torch.int64).tolist()
    for r in range(num_reqs):
        s, e = starts[r], starts[r + 1]
        if e <= s:
            continue
        pos = positions[s:e].to(torch.int64)
        index = pos // virtual
        number = flat[r * block_table_stride + index].to(torch.int64)
        offset = pos - index * virtual
        local = (offset // inter) % world == rank
        slots = number * block_size + (offset // (world * inter)) * inter + offset % inter
        slot_mapping[s:e] = torch.where(local, slots, torch.full_like(slots, PAD_ID)).to(slot_mapping.dtype)
    if max_num_tokens > num_tokens:
        slot_mapping[num_tokens:max_num_tokens] = PAD_ID


#: module -> attribute -> emulation: where a served release launches the kernel (vllm-ascend 0.19.1rc1 imports the
#: name from vLLM's module into its own, so both bindings are replaced).
KERNELS: dict[str, dict[str, Kernel]] = {
    "vllm.v1.worker.block_table": {"_compute_slot_mapping_kernel": Kernel(compute_slot_mapping,
                                                                          "_compute_slot_mapping_kernel")},
    "vllm_ascend.worker.block_table": {"_compute_slot_mapping_kernel": Kernel(compute_slot_mapping,
                                                                              "_compute_slot_mapping_kernel")},
}


def install() -> None:
    """Replace each kernel of :data:`KERNELS` when its module is imported (now, if it already is); idempotent.
    A name that is not a plain Python function (a real ``triton.jit`` kernel, or already emulated) is left alone."""
    import inspect

    import wrapt

    for module_name, kernels in KERNELS.items():
        def hook(module, kernels=kernels) -> None:
            for attr, emulation in kernels.items():
                if inspect.isfunction(getattr(module, attr, None)):
                    setattr(module, attr, emulation)

        wrapt.register_post_import_hook(hook, module_name)
