"""YaRN rotary frequencies with GPT-OSS's ``truncate: false``.

GPT-OSS configs carry ``rope_scaling = {"rope_type": "yarn", "factor": 32, "beta_fast": 32, "beta_slow": 1,
"original_max_position_embeddings": 4096, "truncate": false}``. ``truncate`` says whether the YaRN
correction range ``[low, high]`` is rounded outward to whole dimensions (floor/ceil) before the linear
ramp between interpolated and extrapolated frequencies. The reference model does not round
(transformers ``_compute_yarn_parameters``: ``if truncate: low, high = floor(low), ceil(high)``; vLLM
>= 0.12 ``yarn_find_correction_range(..., truncate)``); vLLM 0.11 always rounds. The inverse frequencies
differ in the ramp region, so cos/sin differ by up to 2.69 for head_dim 64 (over all 131072 positions;
the phase error grows with the position; ``tests/cell/test_rope.py``).
"""

from __future__ import annotations

import torch


def yarn_inv_freq(*, base: float, rotary_dim: int, scaling_factor: float, beta_fast: float, beta_slow: float,
                  max_position_embeddings: int, extrapolation_factor: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies ``[rotary_dim // 2]`` float32, with or without rounding the correction range.

    Same formula as vLLM's ``YaRNScalingRotaryEmbedding._compute_inv_freq`` (vllm 0.11/0.15
    ``rotary_embedding/yarn_scaling_rope.py``), using vLLM's own ``yarn_find_correction_dim`` and
    ``yarn_linear_ramp_mask``; only the rounding of ``[low, high]`` depends on ``truncate``
    (vLLM 0.15 ``common.yarn_find_correction_range``).
    """
    import math

    from vllm.model_executor.layers.rotary_embedding.common import (yarn_find_correction_dim,
                                                                    yarn_linear_ramp_mask)

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (scaling_factor * pos_freqs)
    low = yarn_find_correction_dim(beta_fast, rotary_dim, base, max_position_embeddings)
    high = yarn_find_correction_dim(beta_slow, rotary_dim, base, max_position_embeddings)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    mask = (1 - yarn_linear_ramp_mask(low, high, rotary_dim // 2, dtype=torch.float)) * extrapolation_factor
    return inv_inter * (1 - mask) + inv_extra * mask
