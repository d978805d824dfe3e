"""The simulator calibrated on upstream's plain paths (issue 32), native cells: transformers' own tiny Llama with
PIECEWISE graphs (and, in the 0.15.0rc1 cell, Qwen2 eager) served through ``vllm serve`` on the simulated NPU answers
exactly transformers' float32 tokens, through this release's own attention and no GPT-OSS patch
(:mod:`gptoss_patch_testkit.jobs.plain_models`; tests/cell/test_plain_models.py for the patched cells)."""

import os
from pathlib import Path

import pytest
from conftest import CELL, ROW

from gptoss_patch_testkit.jobs import plain_models

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"

RUNS = [("llama", "PIECEWISE")] + ([("qwen2", "eager")] if CELL == "0.15.0rc1" else [])


@pytest.mark.expensive(60)
@pytest.mark.parametrize("arch, mode", RUNS)
def test_plain_model_served_equals_transformers(arch, mode):
    report = plain_models.run(WORKDIR, arch, mode)
    assert report.problems(ROW.verdict) == []
    assert [c[0] for c in report.completions] == list(plain_models.COMPLETIONS)
