"""Every benchmark under ``scripts/`` runs from its usage line, at its smallest sizes, in the 0.11.0 cell (the venv
their usage names), and prints its figures (issue 32: a benchmark that cannot run is a claim nobody can check).

``scripts/bench_attention.py`` is the exception: it compares two venvs (patched 0.11.0 against native 0.15.0rc1,
``--py011`` / ``--py015``), which one cell session does not have; run it by hand from its usage line.
"""

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
    assert benches - {"bench_attention.py"} == {args.split()[0] for args in SMOKE}


@pytest.mark.parametrize("args", list(SMOKE), ids=[a.split()[0] for a in SMOKE])
def test_benchmark_runs_and_prints_its_figures(args, tmp_path):
    argv = args.format(tmp=tmp_path).split()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(SMOKE[args], out), out[-3000:]
