"""``pairing.structured_outputs``: what verify says about vLLM's structured outputs on vllm-ascend, read from the
installed files (no import). Each case lays out the two code shapes the releases have (vllm-ascend's own
``apply_grammar_bitmask`` with a list of indices, 0.11.0 / 0.12.0rc1; vLLM's, which passes a tensor, 0.13.0 on) and an
xgrammar version; tests/cell/test_api.py shows the crash itself where this says it happens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN = "def apply_grammar_bitmask(self):\n    xgr.apply_token_bitmask_inplace(logits, mask, indices=out_indices)\n"
VLLMS = "from vllm.v1.structured_output.utils import apply_grammar_bitmask\n"
UTILS_TENSOR = "xgr.apply_token_bitmask_inplace(logits, grammar_bitmask, indices=index_tensor)\n"


def judge(tmp_path: Path, runner: str, xgrammar: str | None) -> dict:
    for pkg, rel, text in (("vllm", "v1/structured_output/utils.py", UTILS_TENSOR),
                           ("vllm_ascend", "worker/model_runner_v1.py", runner)):
        f = tmp_path / pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        (tmp_path / pkg / "__init__.py").write_text("raise ImportError('read, never imported')\n")
    if xgrammar:
        meta = tmp_path / f"xgrammar-{xgrammar}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: xgrammar\nVersion: {xgrammar}\n")
    code = "import json; from gptoss_patch import pairing; print(json.dumps(pairing.structured_outputs()))"
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {[str(tmp_path), str(ROOT)]!r}; "
                          + code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("runner, xgrammar, indices, crashes", [
    (VLLMS, "0.1.27", "tensor", True),    # vllm-ascend 0.13.0 with vLLM 0.13's pin
    (VLLMS, "0.1.29", "tensor", True),    # vLLM 0.14-0.17's pin, without vllm-ascend's floor
    (VLLMS, "0.1.30", "tensor", False),   # vllm-ascend >= 0.14.0rc1's floor
    (OWN, "0.1.27", "list", False),       # vllm-ascend 0.12.0rc1
])
def test_the_crashing_pairing_is_named_with_its_fix(tmp_path, runner, xgrammar, indices, crashes):
    got = judge(tmp_path, runner, xgrammar)
    assert (got["xgrammar"], got["indices"]) == (xgrammar, indices)
    if crashes:
        assert "kills the engine" in got["problem"] and 'pip install "xgrammar>=0.1.30"' in got["problem"]
    else:
        assert got["problem"] is None


def test_a_missing_xgrammar_is_named(tmp_path):
    got = judge(tmp_path, OWN, None)
    assert got["xgrammar"] is None and "xgrammar is not installed" in got["problem"]
