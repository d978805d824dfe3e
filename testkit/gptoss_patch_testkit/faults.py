"""Faults a test injects into a served engine's processes, to show a check fails for the reason it is named after.

A served negative control must run the faulty code, not compare with a model that imitates it. The served engine's
processes (API server, engine core, one worker per rank, started by ``spawn``) are out of a test's reach, so a fault
is named in the environment - ``GPTOSS_TESTKIT_FAULT=<name>`` (:func:`env`) - and installed in every process that
installs the NPU simulator (:func:`gptoss_patch_testkit.npu_sim.install` calls :func:`install_from_env`). Test-only,
like the simulator: nothing here is in the product's wheel.

Faults (:data:`FAULTS`):

* ``down_proj_bias_every_rank``: vLLM's BF16 GPT-OSS loader keeps the expert ``down_proj`` bias (``w2_bias``) whole on
  every tensor-parallel rank. Upstream keeps it on rank 0 and zeroes it on the others (``GptOssModel.
  _load_weights_other``, vLLM 0.11.0 - 0.19.1: "only load on rank 0 to avoid duplication"), because every rank adds
  its own copy inside the down-projection grouped matmul (``npu_grouped_matmul(bias=...)``, vllm-ascend's
  ``unquant_apply_mlp`` and ours) before the MoE all-reduce sums the ranks. With the fault each rank adds the whole
  bias and the sum carries it ``tp_size`` times: the double add, run for real.
* ``swa_mask_as_template``: vllm-ascend 0.15.0rc1 - 0.18.0's attention metadata builder hands the sliding layers the
  causal template ``attn_mask`` in place of its band-shaped ``swa_mask`` - the one substitution upstream's PR #8387
  made (0.19.1rc1) - so the fused operator, called with ``sparse_mode=4``, gets the mask its documentation requires
  (docs/operators.md) and the unpatched stack answers instead of stopping at the first prefill. Everything else is
  the release's own code (tests/cell/native_015/test_native_serve.py).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

ENV = "GPTOSS_TESTKIT_FAULT"
FAULTS = ("down_proj_bias_every_rank", "swa_mask_as_template")
_installed: set[str] = set()
#: how the fault says it ran (stderr of each rank's process)
LINE = "gptoss-patch-testkit fault down_proj_bias_every_rank"


def env(name: str) -> dict[str, str]:
    """The environment that installs fault ``name`` in a served engine's processes (merge it into the server's).

    Raises:
        ValueError: ``name`` is not one of :data:`FAULTS`.
    """
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}: use one of {', '.join(FAULTS)}")
    return {ENV: name}


def install_from_env() -> list[str]:
    """Install the fault named by ``GPTOSS_TESTKIT_FAULT`` in this process (idempotent); returns the faults installed
    by this call. Unset or empty: nothing.

    Raises:
        ValueError: the variable names no known fault (a misspelt fault must not pass as "no fault").
    """
    name = os.environ.get(ENV, "").strip()
    if not name or name in _installed:
        return []
    if name not in FAULTS:
        raise ValueError(f"{ENV}={name!r} is not a known fault: use one of {', '.join(FAULTS)}")
    import wrapt

    if name == "down_proj_bias_every_rank":
        wrapt.register_post_import_hook(_down_proj_bias_every_rank, "vllm.model_executor.models.gpt_oss")
    else:
        wrapt.register_post_import_hook(_swa_mask_as_template, "vllm_ascend.attention.attention_v1")
    _installed.add(name)
    return [name]


def _down_proj_bias_every_rank(module: Any) -> None:
    """Wrap ``GptOssModel._load_weights_other``: each ``w2_bias`` tensor of the stream is kept before upstream zeroes
    it on ranks other than 0 (in place), and copied whole into the rank's parameter after upstream's loader ran."""
    import wrapt

    def load(wrapped, instance, args, kwargs):
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        kept: dict[str, Any] = {}

        def keep(weights):
            for name, weight in weights:
                if name.endswith(".w2_bias"):
                    kept[name] = weight.clone()
                yield name, weight

        bound.arguments["weights"] = keep(bound.arguments["weights"])
        loaded = wrapped(*bound.args, **bound.kwargs)
        params = dict(instance.named_parameters())
        for name, whole in kept.items():
            params[name].data.copy_(whole)
        if not kept:
            raise RuntimeError(f"fault down_proj_bias_every_rank: no w2_bias in the weights {wrapped.__qualname__} "
                               "loaded (the fault would not run)")
        from vllm.distributed import get_tensor_model_parallel_rank

        # the evidence that the fault ran, one line per rank in the server's output
        sys.stderr.write(f"{LINE} on TP rank {get_tensor_model_parallel_rank()}: {len(kept)} w2_bias tensors kept "
                         "whole\n")
        sys.stderr.flush()
        return loaded

    wrapt.wrap_function_wrapper(module, "GptOssModel._load_weights_other", load)


#: how ``swa_mask_as_template`` says it ran (stderr, once per process, at the first metadata with a ``swa_mask``)
TEMPLATE_LINE = "gptoss-patch-testkit fault swa_mask_as_template: sliding layers get the causal template attn_mask"


def _swa_mask_as_template(module: Any) -> None:
    """Wrap ``AscendAttentionMetadataBuilder.build``: metadata carrying a ``swa_mask`` carries the builder's
    ``attn_mask`` there instead (``tests/cell/native_015/test_native_attention.py`` ``_template_metadata``, served).

    Raises:
        RuntimeError: the release's ``AscendMetadata`` has no ``swa_mask`` (0.19.1rc1 on: nothing to substitute).
    """
    import dataclasses

    import wrapt

    if "swa_mask" not in {f.name for f in dataclasses.fields(module.AscendMetadata)}:
        raise RuntimeError("fault swa_mask_as_template: this vllm-ascend's AscendMetadata has no swa_mask")
    said = []

    def build(wrapped, instance, args, kwargs):
        md = wrapped(*args, **kwargs)
        if getattr(md, "swa_mask", None) is not None:
            md.swa_mask = md.attn_mask
            if not said:
                said.append(True)
                sys.stderr.write(TEMPLATE_LINE + "\n")
                sys.stderr.flush()
        return md

    wrapt.wrap_function_wrapper(module, "AscendAttentionMetadataBuilder.build", build)
