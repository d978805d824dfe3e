"""The simulator calibrated on upstream's plain paths (issue 32), patched cells: transformers' own tiny Llama (and, in
the 0.11.0 cell, Qwen2 with its q/k/v biases) served through ``vllm serve`` on the simulated NPU with gptoss-patch
active answers exactly transformers' float32 tokens - upstream's own attention operators (ATB ``_npu_flash_attention``
with vllm-ascend's causal mask, ``_npu_paged_attention``, the chunked-prefill path) computed right, and no GPT-OSS patch
on the way (:mod:`gptoss_patch_testkit.jobs.plain_models`). The simulator once read vllm-ascend's float32 mask
(``1`` = masked) as additive: 0 of 12 tokens equal on the prompts without a prefix
(tests/unit/test_sim_attention.py ``test_flash_attention_packed_prefill`` is that negative control, per operator).
"""

import os
from pathlib import Path

import pytest
from conftest import CELL, ROW

from gptoss_patch_testkit.jobs import plain_models

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"

#: (arch, mode) served in this cell: Llama with PIECEWISE graphs in every cell; Qwen2 eager in the 0.11.0 cell.
RUNS = [("llama", "PIECEWISE")] + ([("qwen2", "eager")] if CELL == "0.11.0" else [])


@pytest.mark.expensive(40)
@pytest.mark.parametrize("arch, mode", RUNS)
def test_plain_model_served_equals_transformers(arch, mode):
    report = plain_models.run(WORKDIR, arch, mode)
    assert report.problems(ROW.verdict) == []
    assert [c[0] for c in report.completions] == list(plain_models.COMPLETIONS)
