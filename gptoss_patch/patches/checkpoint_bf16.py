"""Checkpoint at expert parallel: vLLM 0.11.0's BF16 GPT-OSS loader gets the rank's expert range back in order.

Why
    With ``--enable-expert-parallel`` (vllm-ascend's own GPT-OSS tutorial serves TP 4 with it), vLLM 0.11.0's
    ``GptOssModel.load_weights`` computes the rank's experts ``[ep_rank_start, ep_rank_end)`` and calls
    ``self._load_weights_other(ep_rank_end, ep_rank_start, ...)``, while ``_load_weights_other`` is declared
    ``(self, ep_rank_start, ep_rank_end, ...)`` (``vllm/model_executor/models/gpt_oss.py``, vLLM 0.11.0; the MXFP4
    loader beside it is declared end-first and is called correctly). Every ``weight[ep_rank_start:ep_rank_end]``
    slice of the experts is then empty and loading stops at the first expert tensor: "The size of tensor a (4) must
    match the size of tensor b (0) at non-singleton dimension 0" - at every EP size, 1 included. vLLM 0.12.0 declared
    ``_load_weights_other`` end-first too, which fixed it (docs/upstream.md §4.12).
How
    One ``wrapt`` wrapper on ``GptOssModel._load_weights_other``: when its ``ep_rank_start`` is greater than its
    ``ep_rank_end`` - never a meaningful range, and exactly what the swapped call passes - the two are exchanged before
    upstream's loader runs; any other call passes through unchanged. Registered with the vLLM-side checkpoint patches
    on the releases whose ``checkpoint_bf16`` capability is *patched* (:data:`gptoss_patch.matrix.ROWS`, the rows
    paired with vLLM 0.11.0), and applied only where the target is still declared start-first (the defect check of
    :class:`gptoss_patch.registry.PatchSpec`).
Removal
    When no row paired with vLLM 0.11.0 is left in the matrix (vLLM 0.12.0 and later never need it).
Proof
    ``tests/cell/test_serve_more.py``: ``vllm serve --tensor-parallel-size 2 --enable-expert-parallel`` in the 0.11.0
    cell answers with transformers' tokens; with the patch disabled the server does not start (the error above).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from gptoss_patch.evidence import LOGGER_NAME
from gptoss_patch.registry import PatchSpec

__all__ = ["PATCHES", "TARGETS", "ordered_expert_range"]

_log = logging.getLogger(LOGGER_NAME)  # under vLLM's logger: the line shows in the server's output

#: Where the patch hooks (vLLM-side; the same in every vLLM with the defect).
TARGETS: dict[str, str] = {
    "gpt_oss_load_weights_other": "vllm.model_executor.models.gpt_oss:GptOssModel._load_weights_other",
}


def ordered_expert_range(start: int, end: int) -> tuple[int, int]:
    """The expert range ``[start, end)`` of an expert-parallel rank in order: ``(end, start)`` swapped back when
    ``start > end`` (a reversed range names no expert), else unchanged. Ints, expert indices."""
    return (end, start) if start > end else (start, end)


def _load_weights_other(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    start, end = bound.arguments["ep_rank_start"], bound.arguments["ep_rank_end"]
    fixed = ordered_expert_range(start, end)
    if fixed != (start, end):
        # vLLM 0.11.0 computes (and swaps) the range at every load; it slices by it only with expert parallel
        if getattr(getattr(instance, "parallel_config", None), "enable_expert_parallel", False):
            _log.info("gptoss-patch: expert-parallel weight range passed reversed (%d, %d); loading experts [%d, %d)",
                      start, end, *fixed)
        bound.arguments["ep_rank_start"], bound.arguments["ep_rank_end"] = fixed
    return wrapped(*bound.args, **bound.kwargs)


PATCHES: list[PatchSpec] = [
    PatchSpec(
        name="checkpoint_bf16.ep_expert_range",
        target_key="gpt_oss_load_weights_other",
        wrapper=_load_weights_other,
        params=("ep_rank_start", "ep_rank_end", "weights"),
        # vLLM 0.11.0 declares start first (and calls end first); 0.12.0+ declare end first and call end first
        defect_present=("ep_rank_start: int,\n        ep_rank_end: int,",),
        summary="vLLM 0.11.0's BF16 GPT-OSS loader gets the expert-parallel range back in order (it is passed "
                "swapped: every expert slice was empty with --enable-expert-parallel)",
    ),
]
