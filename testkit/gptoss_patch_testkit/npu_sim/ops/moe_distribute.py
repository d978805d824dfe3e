"""MC2 operators of the simulated ``torch_npu``: ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``.

vllm-ascend's MC2 comm method (``TokenDispatcherWithMC2``, ``vllm_ascend/ops/moe/token_dispatcher.py``, 0.11.0 -
0.14.0rc1) sends every token to the EP ranks that hold its top-k experts with ``npu_moe_distribute_dispatch_v2``,
runs the expert MLP on what arrived (``unified_apply_mlp``: grouped matmul, swiglu(oai), grouped matmul) and brings
the rows back with ``npu_moe_distribute_combine_v2``, which multiplies them by the routing weights and sums them per
token. Sources: op-plugin's pages ``torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``torch_npu-npu_moe_distribute_combine_v2.md`` (tag OPD-mdd2 / OPD-mdc2 of ``docs/operators.md`` §1; the limits are
in §4.5).

Emulation (``docs/operators.md`` §4.5):

* **Which product.** The limits differ between Atlas A2 and Atlas A3; the simulated device's SoC version
  (``GPTOSS_PATCH_SIM_SOC_VERSION``, docs/simulator.md §2.1) decides. Only A3 is emulated: on A2 the operators need an
  EP world size of at least 16 (which vllm-ascend also requires before it picks MC2 there), and A2's
  ``ep_recv_counts`` layout depends on the server count - neither can be run here, so A2 raises
  :class:`NotEmulatedError`.
* **The exchange.** ``group_ep`` names a simulated HCCL communicator (``get_hccl_comm_name`` of an ``hccl`` group's
  backend, :func:`gptoss_patch_testkit.npu_sim.device.hccl_backend`); the operators exchange over that group's gloo
  backend directly, so inside an NPU graph capture the operator is one node that runs its exchange again at every
  replay (as the device replays the MC2 kernel, whose communication is part of the kernel).
* **The received rows.** Rank ``r`` holds experts ``[r·L, (r+1)·L)``, ``L = moe_expert_num / ep_world_size``
  (UNVERIFIED: the pages define ``L`` and put shared-expert ranks first, ``expert_shard_type`` 0, but do not spell
  out the placement; vLLM's ``determine_expert_map`` and vllm-ascend's expert maps place experts the same way).
  ``expand_x`` holds, for each local expert in ascending order, the rows routed to it, ordered by source rank and then
  by source token; ``expert_token_nums`` counts them per local expert (``expert_token_nums_type`` 0: prefix sums, 1:
  counts). ``expand_x`` has the documented ``A = BS·ep_world_size·min(L, K)`` rows (``global_bs·min(L, K)`` when
  ``global_bs`` is given); the rows past the received ones are memory the operator does not write (UNVERIFIED: the
  pages do not say what those rows hold), poisoned as ``docs/simulator.md`` §7 describes: NaN, or the largest finite
  value with ``GPTOSS_PATCH_SIM_UNINITIALISED=finite``. The page leaves the order of rows within an expert to the
  implementation; any order is correct as long as combine returns each row to its token, which is all vllm-ascend
  relies on.
* **The bookkeeping outputs** (``assist_info_for_combine``, ``ep_recv_counts``, ``tp_recv_counts``): the page says
  their values differ between products and versions and must only be passed to combine. The simulator writes its
  own: ``ep_recv_counts`` (``(ep_world_size·L,)`` int32, A3's shape) the prefix sums of the rows received per (local
  expert, source rank); ``assist_info_for_combine`` (``(A·128,)`` int32) the ``(source rank, token, k)`` of each
  received row in its first ``3·A`` entries; ``tp_recv_counts`` (``(tp_world_size,)`` int32) the rows received.
  ``expand_scales`` is None on A3 (documented), ``dynamic_scales`` None without quantisation.
* **Combine** returns the rows to their ranks and computes, per token ``t``, ``x[t] = Σ_k expert_scales[t, k] ·
  row(t, k)`` in float32 (``+ shared_expert_x[t]`` if given), cast to ``expand_x``'s dtype. Rows of tokens that
  ``x_active_mask`` excluded were never sent; the page does not say what combine writes for them, so they are
  uninitialised (poisoned the same way).
* **Not emulated** (``NotEmulatedError``): quantisation (``quant_mode`` 2, ``scales``, ``comm_quant_mode`` 2), a TP
  domain (``tp_world_size`` 2), shared-expert ranks, zero / copy / constant experts, ``elastic_info``, ``comm_alg``
  "fullmesh_v2".
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gptoss_patch_testkit.npu_sim._base import NotEmulatedError
from gptoss_patch_testkit.npu_sim.ops.moe import _poison_like_float

__all__ = ["OPS", "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"]

#: float32 ``x`` / ``expand_x`` accepted as a **simulator extension** (the real operators take bfloat16 / float16), so
#: that a float32 ``vllm serve`` - the one whose tokens can be compared exactly with transformers - runs MC2 too;
#: the same extension as the attention operators' (``attention.ACCEPT_FLOAT32``, docs/operators.md section 2).
#: False restores the documented dtype error.
ACCEPT_FLOAT32 = True

_A3_SOC = range(250, 256)  # Ascend910_9391 .. Ascend910_9362 (torch_npu NpuVariables.h); vllm-ascend reads them as A3
_ASSIST_STRIDE = 128  # assist_info_for_combine holds A * 128 int32 (OPD-mdd2 outputs)
_INT32_POISON = torch.iinfo(torch.int32).min


def _dtypes() -> tuple[torch.dtype, ...]:
    return (torch.bfloat16, torch.float16) + ((torch.float32,) if ACCEPT_FLOAT32 else ())


def _product(op: str) -> str:
    from gptoss_patch_testkit.npu_sim import device

    if device.SOC_VERSION in _A3_SOC:
        return "A3"
    raise NotEmulatedError(
        f"torch_npu.{op} on {device.SOC_NAME} (SoC version {device.SOC_VERSION}) is not emulated: the simulator "
        "emulates MC2 as on Atlas A3 (GPTOSS_PATCH_SIM_SOC_VERSION=250..255). On Atlas A2 the operator needs an EP "
        "world size of 16 or more (docs/operators.md section 4.5)")


def _not_emulated(op: str, what: str) -> NotEmulatedError:
    return NotEmulatedError(f"torch_npu.{op} with {what} is not emulated (docs/operators.md section 4.5)")


def _check_common(op: str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, k: int, bs: int, hidden: int,
                  h_max: int, ep_max: int, moe_max: int) -> int:
    """Check the A3 limits shared by dispatch and combine; return the local expert count."""
    if not 2 <= ep_world_size <= ep_max:
        raise RuntimeError(f"{op}: ep_world_size {ep_world_size} is out of range [2, {ep_max}] (Atlas A3)")
    if not 0 <= ep_rank_id < ep_world_size:
        raise RuntimeError(f"{op}: ep_rank_id {ep_rank_id} is out of range [0, {ep_world_size})")
    if not 1 <= moe_expert_num <= moe_max:
        raise RuntimeError(f"{op}: moe_expert_num {moe_expert_num} is out of range [1, {moe_max}]")
    if moe_expert_num % ep_world_size:
        raise RuntimeError(f"{op}: moe_expert_num {moe_expert_num} must be divisible by ep_world_size "
                           f"{ep_world_size} (no shared-expert ranks)")
    if not 1024 <= hidden <= h_max:
        raise RuntimeError(f"{op}: H {hidden} is out of range [1024, {h_max}] (Atlas A3)")
    if not 0 < bs <= 512:
        raise RuntimeError(f"{op}: BS {bs} is out of range (0, 512] (Atlas A3)")
    if not 0 < k <= min(16, moe_expert_num):
        raise RuntimeError(f"{op}: K {k} is out of range (0, {min(16, moe_expert_num)}]")
    return moe_expert_num // ep_world_size


def _active_slots(op: str, mask: torch.Tensor | None, bs: int, k: int) -> torch.Tensor:
    """``(BS, K)`` bool: which (token, k) slots take part (OPD-mdd2 ``x_active_mask``, A3: 1-D or 2-D)."""
    if mask is None:
        return torch.ones(bs, k, dtype=torch.bool)
    if mask.dtype != torch.bool:
        raise RuntimeError(f"{op}: x_active_mask must be bool, got {mask.dtype}")
    if mask.dim() == 1:
        if mask.shape[0] != bs:
            raise RuntimeError(f"{op}: x_active_mask has shape {tuple(mask.shape)}, expected ({bs},)")
        n = int(mask.sum())
        if not bool(mask[:n].all()):
            raise RuntimeError(f"{op}: x_active_mask must hold every true before every false, got {mask.tolist()}")
        return mask.reshape(bs, 1).expand(bs, k).clone()
    if mask.dim() == 2 and tuple(mask.shape) == (bs, k):
        return mask.clone()
    raise RuntimeError(f"{op}: x_active_mask has shape {tuple(mask.shape)}, expected ({bs},) or ({bs}, {k})")


def _backend(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int) -> Any:
    from gptoss_patch_testkit.npu_sim.device import hccl_backend

    backend = hccl_backend(group_ep)  # RuntimeError naming the group for an unknown name
    if backend.size() != ep_world_size or backend.rank() != ep_rank_id:
        raise RuntimeError(f"{op}: group_ep {group_ep!r} has {backend.size()} ranks and this is rank "
                           f"{backend.rank()}, but ep_world_size={ep_world_size}, ep_rank_id={ep_rank_id}")
    return backend


def _all_gather(backend: Any, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), through the group's gloo backend."""
    t = t.contiguous()
    outs = [torch.empty_like(t) for _ in range(backend.size())]
    backend.allgather([outs], [t]).wait()
    return outs


def _check_routing(op: str, expert_ids: torch.Tensor, moe_expert_num: int, active: torch.Tensor) -> None:
    ids = expert_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= moe_expert_num):
        raise RuntimeError(f"{op}: expert_ids must lie in [0, {moe_expert_num}), got [{int(ids.min())}, "
                           f"{int(ids.max())}]")
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1) & active.any(dim=1)
    if bool(dup.any()):
        t = int(dup.nonzero()[0])
        raise RuntimeError(f"{op}: the K expert ids of token {t} repeat: {expert_ids[t].tolist()}")


def npu_moe_distribute_dispatch_v2(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
    moe_expert_num: int, *, scales: torch.Tensor | None = None, x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None, elastic_info: torch.Tensor | None = None, group_tp: str = "",
    tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0, expert_token_nums_type: int = 1,
    comm_alg: str = "", zero_expert_num: int = 0, copy_expert_num: int = 0, const_expert_num: int = 0,
) -> tuple:
    """Send each token to the EP ranks of its top-k experts; return what this rank received, grouped by local expert.

    Args:
        x: ``(BS, H)`` bfloat16 / float16 (float32: :data:`ACCEPT_FLOAT32`), this rank's tokens.
        expert_ids: ``(BS, K)`` int32, each token's top-k expert ids in ``[0, moe_expert_num)``, no repeats in a row.
        group_ep: name of the EP communicator (``get_hccl_comm_name`` of an ``hccl`` group's backend).
        ep_world_size, ep_rank_id: the EP group's size and this rank's index in it.
        moe_expert_num: number of routed experts, divisible by ``ep_world_size``.
        x_active_mask: ``(BS,)`` bool (every true before every false) or ``(BS, K)`` bool; None = all active.
        group_tp / tp_world_size / tp_rank_id: a TP domain; only "no TP domain" (``tp_world_size`` 0 or 1) runs.
        expert_token_nums_type: 0 = prefix sums, 1 = counts (default).
        global_bs: 0, or the global batch (``max BS · ep_world_size``) when ranks' BS differ.
        Other keywords: quantisation, shared / special experts, elastic scaling - see "Raises".

    Returns:
        ``(expand_x (A, H) x.dtype, dynamic_scales None, assist_info_for_combine (A*128,) int32,
        expert_token_nums (L,) int64, ep_recv_counts (ep_world_size*L,) int32, tp_recv_counts (tp_world_size,)
        int32, expand_scales None)``, ``A = BS·ep_world_size·min(L, K)`` (``global_bs·min(L, K)`` if set).

    Raises:
        RuntimeError: a documented limit is broken (H outside [1024, 8192], BS outside (0, 512], K outside
            (0, 16], ep_world_size outside [2, 768], experts not divisible, dtype, mask order, ids out of range or
            repeated, an unknown ``group_ep``, ``global_bs`` other than 0 or BS·ep_world_size for equal BS, or
            other than max BS·ep_world_size when the ranks' BS differ, or not the same on every rank); a call
            refused on another rank of the group raises here too.
        NotEmulatedError: the device is not an Atlas A3, or quantisation, a TP domain, shared-expert ranks,
            special experts, ``elastic_info`` or ``comm_alg="fullmesh_v2"`` is asked for.

    Source: op-plugin ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` (OPD-mdd2); docs/operators.md §4.5.
    """
    op = "npu_moe_distribute_dispatch_v2"
    _product(op)
    if quant_mode != 0 or scales is not None:
        raise _not_emulated(op, f"quant_mode={quant_mode}, scales={'set' if scales is not None else None}")
    if tp_world_size not in (0, 1):
        raise _not_emulated(op, f"a TP domain (tp_world_size={tp_world_size})")
    if shared_expert_rank_num or zero_expert_num or copy_expert_num or const_expert_num:
        raise _not_emulated(op, "shared-expert ranks or zero / copy / constant experts")
    if elastic_info is not None or comm_alg == "fullmesh_v2":
        raise _not_emulated(op, "elastic_info or comm_alg='fullmesh_v2'")
    if comm_alg not in ("", "fullmesh_v1"):
        raise RuntimeError(f"{op}: comm_alg {comm_alg!r} is not one of '', 'fullmesh_v1', 'fullmesh_v2' (Atlas A3)")
    if expert_scales is not None:
        raise RuntimeError(f"{op}: expert_scales is not supported on Atlas A3 (leave it None)")
    if expert_shard_type != 0:
        raise RuntimeError(f"{op}: expert_shard_type must be 0 on Atlas A3, got {expert_shard_type}")
    if expert_token_nums_type not in (0, 1):
        raise RuntimeError(f"{op}: expert_token_nums_type must be 0 or 1, got {expert_token_nums_type}")
    if x.dim() != 2 or x.dtype not in _dtypes():
        raise RuntimeError(f"{op}: x must be a 2-D bfloat16 or float16 tensor, got {tuple(x.shape)} {x.dtype}")
    if expert_ids.dim() != 2 or expert_ids.dtype != torch.int32 or expert_ids.shape[0] != x.shape[0]:
        raise RuntimeError(f"{op}: expert_ids must be ({x.shape[0]}, K) int32, got {tuple(expert_ids.shape)} "
                           f"{expert_ids.dtype}")
    bs, hidden = int(x.shape[0]), int(x.shape[1])
    k = int(expert_ids.shape[1])
    local = _check_common(op, ep_world_size, ep_rank_id, moe_expert_num, k, bs, hidden, 8192, 768, 1024)
    backend = _backend(op, group_ep, ep_world_size, ep_rank_id)
    # checks of this rank's data: every rank learns the outcome before any exchange, so a refused call raises on every
    # rank instead of leaving the others waiting for it (a real collective would hang until HCCL's timeout)
    error: RuntimeError | None = None
    try:
        active = _active_slots(op, x_active_mask, bs, k)
        _check_routing(op, expert_ids, moe_expert_num, active)
    except RuntimeError as exc:
        error, active = exc, torch.zeros(bs, k, dtype=torch.bool)
    agreed = _all_gather(backend, torch.tensor([bs, global_bs, int(error is None), int(bool(active.all()))],
                                                dtype=torch.int64))
    if error is not None:
        raise error
    if not all(int(a[2]) for a in agreed):
        raise RuntimeError(f"{op}: another rank's call was refused (see its error)")
    sizes = [int(a[0]) for a in agreed]
    max_bs = max(sizes)
    if len({int(a[1]) for a in agreed}) > 1:
        raise RuntimeError(f"{op}: global_bs must be the same on every rank, got {[int(a[1]) for a in agreed]}")
    if len(set(sizes)) > 1:  # OPD-mdd2 global_bs: max BS * ep_world_size when the ranks' BS differ
        if global_bs != max_bs * ep_world_size:
            raise RuntimeError(f"{op}: the ranks' BS differ ({sizes}); global_bs must be max BS * ep_world_size = "
                               f"{max_bs * ep_world_size}, got {global_bs}")
        if not all(int(a[3]) for a in agreed):
            raise RuntimeError(f"{op}: when the ranks' BS differ every token must be active (x_active_mask)")
    elif global_bs not in (0, bs * ep_world_size):  # equal BS: 0 or BS * ep_world_size
        raise RuntimeError(f"{op}: with the same BS {bs} on every rank global_bs must be 0 or "
                           f"{bs * ep_world_size}, got {global_bs}")

    def padded(t: torch.Tensor, fill: Any) -> torch.Tensor:
        out = torch.full((max_bs,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
        out[:t.shape[0]] = t
        return out

    xs = _all_gather(backend, padded(x, 0))
    ids = _all_gather(backend, padded(expert_ids, -1))
    acts = _all_gather(backend, padded(active, False))

    rows = global_bs * min(local, k) if global_bs else bs * ep_world_size * min(local, k)
    first = ep_rank_id * local
    received: list[torch.Tensor] = []
    origin: list[tuple[int, int, int]] = []
    counts = torch.zeros(local, ep_world_size, dtype=torch.int64)
    for e in range(local):
        for src in range(ep_world_size):
            hit = (ids[src].long() == first + e) & acts[src]
            for t, kk in hit.nonzero().tolist():
                received.append(xs[src][t])
                origin.append((src, t, kk))
            counts[e, src] = int(hit.sum())
    n = len(received)  # <= rows: each of the ws * max BS tokens sends at most min(L, K) rows here

    expand_x = _poison_like_float((rows, hidden), x.dtype)
    if n:
        expand_x[:n] = torch.stack(received)
    assist = torch.full((rows * _ASSIST_STRIDE,), _INT32_POISON, dtype=torch.int32)
    if n:
        assist[:3 * n] = torch.tensor(origin, dtype=torch.int32).reshape(-1)
    per_expert = counts.sum(dim=1)
    expert_token_nums = per_expert.cumsum(0) if expert_token_nums_type == 0 else per_expert
    ep_recv_counts = counts.reshape(-1).cumsum(0).to(torch.int32)
    tp_recv_counts = torch.tensor([n] * tp_world_size, dtype=torch.int32)  # (tp_world_size,): empty for 0
    return expand_x, None, assist, expert_token_nums.to(torch.int64), ep_recv_counts, tp_recv_counts, None


def npu_moe_distribute_combine_v2(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
    moe_expert_num: int, *, tp_send_counts: torch.Tensor | None = None, x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None, shared_expert_x: torch.Tensor | None = None, group_tp: str = "",
    tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, global_bs: int = 0, comm_quant_mode: int = 0,
) -> torch.Tensor:
    """Return the expert rows of :func:`npu_moe_distribute_dispatch_v2` to their tokens, weighted and summed.

    ``x[t] = Σ_k expert_scales[t, k] · row(t, k) (+ shared_expert_x[t])`` in float32, cast to ``expand_x``'s dtype.

    Args:
        expand_x: ``(A, H)`` bfloat16 / float16 (float32: :data:`ACCEPT_FLOAT32`), the expert MLP's output for the
            rows dispatch delivered.
        expert_ids: ``(BS, K)`` int32, as given to dispatch.
        assist_info_for_combine, ep_send_counts, tp_send_counts: dispatch's outputs, passed through.
        expert_scales: ``(BS, K)`` float32 routing weights.
        group_ep, ep_world_size, ep_rank_id, moe_expert_num: as given to dispatch.
        x_active_mask: ``(BS,)`` bool, as given to dispatch.
        shared_expert_x: None or ``(BS, H)`` (or ``(a, b, H)`` with ``a·b = BS``) added to the result.

    Returns:
        ``(BS, H)`` tensor of ``expand_x``'s dtype; rows of tokens excluded by ``x_active_mask`` are uninitialised.

    Raises:
        RuntimeError: a documented limit is broken (as for dispatch; H outside [1024, 7168] - the combine page's
            range, narrower than dispatch's 8192 -, ep_world_size outside [2, 384], ``moe_expert_num`` above 512, a
            2-D ``x_active_mask``), shapes or dtypes that do not match dispatch's outputs, an unknown ``group_ep``.
        NotEmulatedError: the device is not an Atlas A3, or ``comm_quant_mode`` 2, a TP domain, shared-expert ranks.

    Source: op-plugin ``docs/context/torch_npu-npu_moe_distribute_combine_v2.md`` (OPD-mdc2); docs/operators.md §4.5.
    """
    op = "npu_moe_distribute_combine_v2"
    _product(op)
    if comm_quant_mode != 0:
        raise _not_emulated(op, f"comm_quant_mode={comm_quant_mode}")
    if tp_world_size not in (0, 1):
        raise _not_emulated(op, f"a TP domain (tp_world_size={tp_world_size})")
    if shared_expert_rank_num:
        raise _not_emulated(op, "shared-expert ranks")
    if expand_scales is not None:
        raise RuntimeError(f"{op}: expand_scales is not supported on Atlas A3 (leave it None)")
    if expand_x.dim() != 2 or expand_x.dtype not in _dtypes():
        raise RuntimeError(f"{op}: expand_x must be a 2-D bfloat16 or float16 tensor, got "
                           f"{tuple(expand_x.shape)} {expand_x.dtype}")
    if expert_ids.dim() != 2 or expert_ids.dtype != torch.int32:
        raise RuntimeError(f"{op}: expert_ids must be (BS, K) int32, got {tuple(expert_ids.shape)} {expert_ids.dtype}")
    bs, k = int(expert_ids.shape[0]), int(expert_ids.shape[1])
    rows, hidden = int(expand_x.shape[0]), int(expand_x.shape[1])
    local = _check_common(op, ep_world_size, ep_rank_id, moe_expert_num, k, bs, hidden, 7168, 384, 512)
    # (the page's "moe_expert_num / ep_world_size * ep_world_size <= 1280" cannot bind without shared-expert ranks)
    if x_active_mask is not None and x_active_mask.dim() != 1:
        raise RuntimeError(f"{op}: x_active_mask must be 1-D ({bs},) on Atlas A3, got {tuple(x_active_mask.shape)}")
    if assist_info_for_combine.dtype != torch.int32 or ep_send_counts.dtype != torch.int32:
        raise RuntimeError(f"{op}: assist_info_for_combine and ep_send_counts must be int32, got "
                           f"{assist_info_for_combine.dtype} and {ep_send_counts.dtype}")
    need = (global_bs or bs * ep_world_size) * min(local, k)
    if rows < need:
        raise RuntimeError(f"{op}: expand_x has {rows} rows, fewer than A = {need} (global_bs={global_bs})")
    if tuple(expert_scales.shape) != (bs, k) or expert_scales.dtype != torch.float32:
        raise RuntimeError(f"{op}: expert_scales must be ({bs}, {k}) float32, got {tuple(expert_scales.shape)} "
                           f"{expert_scales.dtype}")
    if tuple(assist_info_for_combine.shape) != (rows * _ASSIST_STRIDE,):
        raise RuntimeError(f"{op}: assist_info_for_combine has shape {tuple(assist_info_for_combine.shape)}, "
                           f"expected ({rows * _ASSIST_STRIDE},) for expand_x of {rows} rows")
    if tuple(ep_send_counts.shape) != (ep_world_size * local,):
        raise RuntimeError(f"{op}: ep_send_counts has shape {tuple(ep_send_counts.shape)}, expected "
                           f"({ep_world_size * local},) (Atlas A3)")
    active = _active_slots(op, x_active_mask, bs, k)
    _check_routing(op, expert_ids, moe_expert_num, active)
    backend = _backend(op, group_ep, ep_world_size, ep_rank_id)

    n = int(ep_send_counts[-1]) if ep_send_counts.numel() else 0
    origin = assist_info_for_combine[:3 * n].reshape(n, 3).long()
    # back to the sources: every rank's delivered rows and where they came from (gloo needs equal shapes)
    max_rows = max(int(r) for r in _all_gather(backend, torch.tensor([rows], dtype=torch.int64)))
    back_x = torch.zeros(max_rows, hidden, dtype=torch.float32)
    back_x[:n] = expand_x[:n].float()
    back_o = torch.full((max_rows, 3), -1, dtype=torch.int64)
    back_o[:n] = origin
    all_x = _all_gather(backend, back_x)
    all_o = _all_gather(backend, back_o)

    out = torch.zeros(bs, hidden, dtype=torch.float32)
    filled = torch.zeros(bs, k, dtype=torch.bool)
    scales = expert_scales.float()
    for rows_x, rows_o in zip(all_x, all_o):
        mine = (rows_o[:, 0] == ep_rank_id).nonzero().flatten()
        for i in mine.tolist():
            t, kk = int(rows_o[i, 1]), int(rows_o[i, 2])
            out[t] += scales[t, kk] * rows_x[i]
            filled[t, kk] = True
    if not torch.equal(filled, active):
        raise RuntimeError(f"{op}: the rows returned do not match this rank's active (token, k) slots - were "
                           "dispatch's outputs passed unchanged?")
    if shared_expert_x is not None:
        if (shared_expert_x.dtype != expand_x.dtype or shared_expert_x.dim() not in (2, 3)
                or shared_expert_x.shape[-1] != hidden or shared_expert_x.numel() != bs * hidden):
            raise RuntimeError(f"{op}: shared_expert_x has shape {tuple(shared_expert_x.shape)} "
                               f"{shared_expert_x.dtype}, expected ({bs}, {hidden}) {expand_x.dtype}")
        out += shared_expert_x.reshape(bs, hidden).float()
    result = out.to(expand_x.dtype)
    unsent = ~active.any(dim=1)  # never sent: the page does not say what combine writes there
    result[unsent] = _poison_like_float((int(unsent.sum()), hidden), expand_x.dtype)
    return result


OPS: dict[str, Callable[..., Any]] = {
    "npu_moe_distribute_dispatch_v2": npu_moe_distribute_dispatch_v2,
    "npu_moe_distribute_combine_v2": npu_moe_distribute_combine_v2,
}
