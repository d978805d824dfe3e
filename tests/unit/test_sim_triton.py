"""The NPU simulator's emulation of vLLM's Triton slot-mapping kernel (``npu_sim.triton_kernels``), against slots worked
out by hand from the kernel's source (vLLM 0.19.1 ``vllm/v1/worker/block_table.py`` ``_compute_slot_mapping_kernel``)."""

import sys
import types

import pytest
import torch

from gptoss_patch_testkit.npu_sim import triton_kernels as T

PAD = -1


def _launch(qsl, positions, table, block_size, max_tokens, num_tokens=None, world=1, rank=0, inter=1):
    table = torch.tensor(table, dtype=torch.int32)
    slots = torch.full((max_tokens,), 777, dtype=torch.int64)
    num_reqs = len(qsl) - 1
    T.KERNELS["vllm.v1.worker.block_table"]["_compute_slot_mapping_kernel"][(num_reqs + 1,)](
        len(positions) if num_tokens is None else num_tokens, max_tokens, torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int64), table, table.stride(0), block_size, slots,
        TOTAL_CP_WORLD_SIZE=world, TOTAL_CP_RANK=rank, CP_KV_CACHE_INTERLEAVE_SIZE=inter, PAD_ID=PAD,
        BLOCK_SIZE=1024)
    return slots.tolist()


def test_two_requests_cross_a_block_edge_and_the_tail_is_padded():
    # block size 4; request 0 holds blocks [7, 3], request 1 block [5]; request 0's positions 2..5 cross its first block
    slots = _launch(qsl=[0, 4, 6], positions=[2, 3, 4, 5, 0, 1], table=[[7, 3], [5, 0]], block_size=4, max_tokens=9)
    assert slots == [30, 31, 12, 13, 20, 21, PAD, PAD, PAD]


def test_tokens_past_the_last_request_keep_their_value():
    # num_tokens 5 but the requests cover 4: token 4 is written by no program (as on the device)
    slots = _launch(qsl=[0, 4], positions=[0, 1, 2, 3, 9], table=[[2]], block_size=4, max_tokens=6, num_tokens=5)
    assert slots == [8, 9, 10, 11, 777, PAD]


def test_context_parallel_ranks_take_interleaved_tokens():
    # 2 ranks, interleave 1, block size 2: a virtual block of 4 tokens; rank 1 owns offsets 1 and 3 of each
    kw = dict(qsl=[0, 6], positions=[0, 1, 2, 3, 4, 5], table=[[4, 9]], block_size=2, max_tokens=6, world=2)
    assert _launch(rank=0, **kw) == [8, PAD, 9, PAD, 18, PAD]
    assert _launch(rank=1, **kw) == [PAD, 8, PAD, 9, PAD, 18]


def test_a_bad_grid_or_table_is_refused():
    kernel = T.KERNELS["vllm.v1.worker.block_table"]["_compute_slot_mapping_kernel"]
    with pytest.raises(TypeError, match="launch grid of ints"):
        kernel[lambda meta: (1,)]
    table = torch.zeros(4, 2, dtype=torch.int32).t()  # rows not contiguous
    with pytest.raises(ValueError, match="is not rows of"):
        kernel[(2,)](1, 1, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int64), table, 4, 2,
                     torch.zeros(1, dtype=torch.int64), TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                     CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=PAD, BLOCK_SIZE=1024)


def test_install_replaces_the_placeholder_function_only(monkeypatch):
    def placeholder(*args):  # what vllm.triton_utils' TritonPlaceholder leaves: the undecorated function
        raise AssertionError("never called")

    real = object()  # stands for a real triton.jit kernel: left alone
    mods = {"vllm.v1.worker.block_table": types.ModuleType("vllm.v1.worker.block_table"),
            "vllm_ascend.worker.block_table": types.ModuleType("vllm_ascend.worker.block_table")}
    mods["vllm.v1.worker.block_table"]._compute_slot_mapping_kernel = placeholder
    mods["vllm_ascend.worker.block_table"]._compute_slot_mapping_kernel = real
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    T.install()
    assert isinstance(mods["vllm.v1.worker.block_table"]._compute_slot_mapping_kernel, T.Kernel)
    assert mods["vllm_ascend.worker.block_table"]._compute_slot_mapping_kernel is real
