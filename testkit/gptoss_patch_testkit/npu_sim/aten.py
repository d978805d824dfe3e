"""PyTorch (aten) kernels the simulated device computes where PyTorch's CPU build has none for what the NPU accepts.

The device mapping (:mod:`gptoss_patch_testkit.npu_sim.device`) routes a call here. Nothing in this module imports the
rest of the simulator, so the device, the graph API and the operators keep no import circle.
"""

from __future__ import annotations

import torch


#: Integer dtypes aclnnHistc accepts beside FLOAT16/FLOAT32 (CANN aclnnHistc, "self ... INT32、INT64、INT16、INT8、
#: UINT8"; Atlas A2/A3); PyTorch's CPU ``histc`` implements floating dtypes only.
HISTC_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def integer_histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *,  # noqa: A002 - torch's names
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.histc`` of an integer tensor on the NPU: what aclnnHistc computes (CANN ``aclnnHistc``).

    Semantics (the operator page): ``bins`` equal-width intervals between ``min`` and ``max`` (both inclusive); each
    element is counted in its interval, elements below ``min`` or above ``max`` are not counted; when ``min`` equals
    ``max`` the tensor's own minimum and maximum are the bounds. The output is 1-D with ``bins`` elements in the
    input's dtype. vllm-ascend's All2All dispatcher counts tokens per expert this way, on int32 expert ids
    (``ops/moe/token_dispatcher.py``: ``torch.histc(topk_ids, bins=num_experts, min=0, max=num_experts - 1)``).
    Computed with PyTorch's ``histc`` on the values in float64 (exact for every integer below 2**53, so each element
    falls in the same interval as on the device), then cast back.

    Args:
        input: integer tensor of any shape (:data:`HISTC_INT_DTYPES`).
        bins: number of intervals, > 0. min / max: the bounds (numbers), ``min <= max``.
        out: optional 1-D tensor of ``bins`` elements receiving the counts.

    Raises:
        RuntimeError: ``bins <= 0``, ``min > max``, an unsupported dtype, or ``out`` of the wrong size (the operator's
            parameter checks).
    """
    if input.dtype not in HISTC_INT_DTYPES:
        raise RuntimeError(f"histc: input dtype {input.dtype} is not one aclnnHistc accepts "
                           f"({', '.join(str(d) for d in HISTC_INT_DTYPES)} or float16/float32)")
    if int(bins) <= 0:
        raise RuntimeError(f"histc: bins must be > 0, got {bins}")
    if float(min) > float(max):
        raise RuntimeError(f"histc: min ({min}) must not be greater than max ({max})")
    counts = torch.histc(input.to(torch.float64), bins=int(bins), min=float(min), max=float(max)).to(input.dtype)
    if out is None:
        return counts
    if out.dim() != 1 or out.numel() != int(bins):
        raise RuntimeError(f"histc: out must be 1-D with {bins} elements, got shape {list(out.shape)}")
    return out.copy_(counts)
