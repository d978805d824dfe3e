#!/usr/bin/env python3
"""Benchmark: start-up time that the installed ``gptoss_patch.pth`` adds to ``python -c pass``.

Builds two throw-away virtual environments from the same interpreter (``--without-pip``): A is bare,
B is A plus gptoss-patch's package directory, byte-compiled as pip does, and its ``.pth`` (what the wheel
installs), then
runs ``python -c pass`` in each, alternating A/B, ``--runs`` times (default 40), and prints the
median and the difference (goal <= 1 ms), and, when ``valgrind`` is on ``PATH``, the instructions each side
executes (``valgrind --tool=callgrind``, total ``Ir``; repeatable to ~0.1 M where a wall-clock median on a shared
host is not; goal <= 0.4 M added). Usage: ``python scripts/bench_startup.py [--runs N] [--no-callgrind]``.

Where the instructions go (CPython 3.11.7, bare venv, ``python -c pass`` = 35.5 M; each line measured by replacing the
``.pth`` line; repeatable to ~0.05 M): any ``.pth`` file (``import sys``) +0.2 M; an ``exec`` of a string in it
(the ``try`` that keeps an orphaned ``.pth`` silent) +0.3-0.6 M, the parser's cost; the first path-based import at
``.pth`` time (the path finders for the stdlib directories and site-packages: an import of a missing name alone costs
+0.8 M); the package ``__init__`` +0.1 M; ``_bootstrap`` (a finder for the package directory, its ``.pyc``, three
classes) +1.1 M; ``install()`` +0.45 M, nearly all of it for having a Python finder in ``sys.meta_path`` at all (creating
the finder +0.02 M; inserting it +0.5 M: the garbage collections and the module teardown at exit walk what it keeps
alive). A one-line ``.pth`` that installs any Python-level finder without importing anything (a module object with a
``lambda``) already measures +1.0 M (the parse of the line, the finder in ``sys.meta_path``): the 0.4 M goal is below
what a Python finder installed by a ``.pth`` costs here. Docstrings make no difference (the ``.pyc`` without them
measures the same).

Measured again in session 10 (2026-12-02; the figure had grown to +2.90 M): in a venv, CPython 3.11.7's ``site`` runs
every ``.pth`` line twice (``site.venv()`` and ``site.main()`` both process site-packages: a line printing to stderr
prints twice), so both the parse and the already-imported ``install()`` are paid twice; the parser costs roughly 1.5-3 K
instructions per character of a line (plus ~0.2 M for the first compile in the process); every import through the path
finders ~0.45 M, two here (the package, then ``_bootstrap``). A lazy variant (a stub finder built in the ``.pth`` line,
importing ``_bootstrap`` only on the first ``vllm_ascend`` lookup) measured +1.79 M; it was not adopted: it had to
release importlib's lock inside a lookup, it imported ``gptoss_patch`` from whatever ``sys.path`` holds then (a
``gptoss_patch/`` folder in the working directory would shadow the installed one; at ``.pth`` time ``sys.path`` has no
script directory yet), and it still was 4x the goal.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_venv(path: Path) -> tuple[Path, Path]:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    return py, Path(purelib)


def run_once(py: Path, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(py), "-c", "pass"], check=True, env=env)
    return time.perf_counter() - t0


def instructions(py: Path, env: dict) -> int | None:
    """Instructions ``python -c pass`` executes (callgrind's total ``Ir``), or None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(py), "-c", "pass"],
                             env=env, capture_output=True, text=True)
        found = re.search(r"Collected : (\d+)", run.stderr)
        return int(found.group(1)) if run.returncode == 0 and found else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40, help="runs per side (>= 30 recommended)")
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction count")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_") and k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as tmp:
        py_a, _ = make_venv(Path(tmp) / "bare")
        py_b, site_b = make_venv(Path(tmp) / "patched")
        shutil.copytree(ROOT / "gptoss_patch", site_b / "gptoss_patch",
                        ignore=shutil.ignore_patterns("testing", "__pycache__"))
        shutil.copy(ROOT / "gptoss_patch.pth", site_b / "gptoss_patch.pth")
        # pip byte-compiles what it installs (compileall), whatever PYTHONDONTWRITEBYTECODE says; do the same
        subprocess.run([str(py_b), "-m", "compileall", "-q", str(site_b / "gptoss_patch")], check=True)
        for py in (py_a, py_b):  # warm up, and byte-compile
            for _ in range(3):
                run_once(py, env)
        ia = ib = None
        if not args.no_callgrind:
            ia, ib = instructions(py_a, env), instructions(py_b, env)
        a, b = [], []
        for _ in range(args.runs):
            a.append(run_once(py_a, env))
            b.append(run_once(py_b, env))
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"python -c pass, {args.runs} runs each, alternating ({sys.version.split()[0]})")
    print(f"  without gptoss_patch.pth: median {ma:.2f} ms")
    print(f"  with    gptoss_patch.pth: median {mb:.2f} ms")
    print(f"  added by the .pth:        {mb - ma:+.2f} ms (goal <= 1 ms)")
    if ia is not None and ib is not None:
        print(f"instructions (valgrind --tool=callgrind, Ir): without {ia / 1e6:.2f} M, with {ib / 1e6:.2f} M, "
              f"added {(ib - ia) / 1e6:+.2f} M (goal <= 0.4 M)")
    elif not args.no_callgrind:
        print("instructions: valgrind not found (apt-get install valgrind), not counted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
