#!/usr/bin/env python3
"""Serve gpt-oss-120b BF16 at TP=8 on vllm-ascend with gptoss-patch: the '120b-tp8' recipe of gptoss_patch.serve.

    python scripts/serve_gpt_oss_120b_tp8.py --model DIR --tokenizer-dir DIR [--dry-run] [options] [-- vllm args]

See 'python -m gptoss_patch.serve 120b-tp8 --help' and the docstring of gptoss_patch/serve.py.
"""

import sys
from pathlib import Path

try:
    from gptoss_patch import serve
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gptoss_patch import serve

if __name__ == "__main__":
    sys.exit(serve.main(["120b-tp8", *sys.argv[1:]]))
