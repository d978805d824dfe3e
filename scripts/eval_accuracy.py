#!/usr/bin/env python3
"""Accuracy runner: MMLU / GSM8K subsets from local files against an OpenAI-compatible server, scored by lm-eval.

    python scripts/eval_accuracy.py --server http://HOST:8000 --model NAME --mmlu DIR --gsm8k FILE \
        [--limit N] [--max-tokens 4096] [--reasoning-effort medium] [--dry-run]

See 'python scripts/eval_accuracy.py --help' and the docstring of gptoss_patch/eval_accuracy.py.
Needs lm-eval[api] (pip install "lm-eval[api]").
"""

import sys
from pathlib import Path

try:
    from gptoss_patch import eval_accuracy
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gptoss_patch import eval_accuracy

if __name__ == "__main__":
    sys.exit(eval_accuracy.main(sys.argv[1:]))
