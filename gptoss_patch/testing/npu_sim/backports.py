"""Test-only backport of one upstream fix into the engine processes of a native calibration cell.

``GPTOSS_PATCH_SIM_BACKPORT_8387=1`` (read when the simulator installs, so it reaches vLLM's engine-core process):
vllm-ascend 0.15.0rc1 - 0.18.0 give GPT-OSS's sliding-window layers ``atten_mask = attn_metadata.swa_mask`` with
``sparse_mode=4``, a mask that breaks the operator's documented constraint (docs/upstream.md §4.4); the simulator
refuses it, the hardware computes something undocumented. Upstream's fix (vllm-ascend PR #8387, commit e15d766aba,
first in 0.19.1rc1) passes the causal template ``attn_metadata.attn_mask`` instead. With the switch on,
``AscendAttentionMetadataBuilder.build`` returns its metadata with ``swa_mask`` replaced by ``attn_mask`` - exactly the
substitution the operator-level calibration makes (tests/cell/native_015/test_native_attention.py) - so the real
engine can be calibrated against transformers on those releases too. Never installed by the product; a release
without ``swa_mask`` is left untouched.
"""

from __future__ import annotations

import os
import sys

__all__ = ["install"]

VARIABLE = "GPTOSS_PATCH_SIM_BACKPORT_8387"


def _hook(module) -> None:
    import dataclasses

    import wrapt

    meta = getattr(module, "AscendMetadata", None)
    builder = getattr(module, "AscendAttentionMetadataBuilder", None)
    if meta is None or builder is None or "swa_mask" not in {f.name for f in dataclasses.fields(meta)}:
        return

    def build(wrapped, instance, args, kwargs):
        md = wrapped(*args, **kwargs)
        if getattr(md, "swa_mask", None) is not None:
            md = dataclasses.replace(md, swa_mask=md.attn_mask)
        return md

    wrapt.wrap_function_wrapper(module, "AscendAttentionMetadataBuilder.build", build)


def install() -> None:
    """Register the backport when ``GPTOSS_PATCH_SIM_BACKPORT_8387=1``; otherwise do nothing."""
    if os.environ.get(VARIABLE, "").strip() != "1":
        return
    name = "vllm_ascend.attention.attention_v1"
    if name in sys.modules:
        _hook(sys.modules[name])
        return
    import wrapt

    wrapt.register_post_import_hook(_hook, name)
