"""Every benchmark under ``scripts/`` runs from its usage line, at its smallest sizes, in the 0.11.0 cell (the venv
their usage names), and prints its figures (issue 32: a benchmark that cannot run is a claim nobody can check).

``scripts/bench_attention.py`` compares two venvs, this one (patched 0.11.0) and native 0.15.0rc1's: nox hands the
cell session that venv's python as ``GPTOSS_BENCH_PY015`` (noxfile.py ``CELLS["0.11.0"]["peers"]``).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: script arguments -> a line its output must hold (the figure it exists to print)
SMOKE = {
    "bench_activation.py --runs 1": r"activate\(\) \(decide, register, apply\): median [\d.]+ ms",
    "pad_report.py": r"Padding applies only where",
    "bench_padding.py --experts 2 --no-vllm": r"1\. pad_moe_layer_ \(gptoss_patch\) +extra peak +[\d.]+ MiB",
    "bench_graph_update.py --layers 2 --size 2 --steps 2": r"ratio ours / upstream: [\d.]+x",
    "bench_moe.py --experts 4 --tokens 1 --repeat 1": r"\n +1 \| +[\d.]+ / +[\d.]+ ms \| +[\d.]+ / +[\d.]+ ms",
    "bench_startup.py --runs 2 --no-callgrind": r"gptoss-patch installed +median +[\d.]+ ms",
    "bench_engine.py --steps 2 --skip-serve --workdir {tmp}": r"wall time per decode step: \d[\d.]* ms",
    "bench_mxfp4_load.py --dir {tmp}": r"rank slice equals transformers' dequantization \(experts 0-1\): True",
}


def test_every_benchmark_is_smoke_tested():
    benches = {p.name for p in (ROOT / "scripts").glob("bench_*.py")} | {"pad_report.py"}
    # bench_attention.py: its own test below (two venvs)
    assert benches == {args.split()[0] for args in SMOKE} | {"bench_attention.py"}


def test_bench_attention_prints_patched_and_native_side_by_side():
    """The performance goal's figure: host time per decode step, patched 0.11.0 (this venv) beside native
    0.15.0rc1, and their ratio, for a batch of 1 and of 64."""
    py015 = os.environ.get("GPTOSS_BENCH_PY015")
    assert py015, ("GPTOSS_BENCH_PY015 is not set: run this test through `nox -s cell-0.11.0` (which sets it to the "
                   "0.15.0rc1 cell's python), or set it to a python with vllm-ascend 0.15.0rc1 and gptoss-patch")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--steps", "2", "--rounds",
                           "1", "--py011", sys.executable, "--py015", py015], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    row = r" \| +[\d.]+ \([\d.]+\) = \d+ us/layer \| +[\d.]+ \([\d.]+\) = \d+ us/layer \| [\d.]+ \([\d.]+\)\n"
    assert "patched 0.11.0 ms/step" in out and "native 0.15.0rc1 ms/step" in out, out[-3000:]
    for batch in (1, 64):
        assert re.search(rf"\n +{batch}{row}", out), out[-3000:]


@pytest.mark.parametrize("args", list(SMOKE), ids=[a.split()[0] for a in SMOKE])
def test_benchmark_runs_and_prints_its_figures(args, tmp_path):
    argv = args.format(tmp=tmp_path).split()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(SMOKE[args], out), out[-3000:]
