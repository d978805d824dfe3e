#!/usr/bin/env python3
"""Performance runner: evalscope perf on /v1/completions with ignore_eos, 128/128 and 1024/1024 at several
concurrencies; prints output tokens/s, TTFT, TPOT, ITL beside published figures (not measured here).

    python scripts/bench_serving.py --server http://HOST:8000 --model NAME --tokenizer CHECKPOINT_DIR \
        [--scenario 128/128 --scenario 1024/1024] [--concurrency 1,10,64] [--dry-run]

See 'python scripts/bench_serving.py --help' and the docstring of gptoss_patch/bench_serving.py.
Needs evalscope[perf] (pip install "evalscope[perf]").
"""

import sys
from pathlib import Path

try:
    from gptoss_patch import bench_serving
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gptoss_patch import bench_serving

if __name__ == "__main__":
    sys.exit(bench_serving.main(sys.argv[1:]))
