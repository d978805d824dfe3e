"""The test ids each nox session of ``nox -s tests`` runs, per cell, at this checkout or at another revision, and the
difference between two such lists: the evidence that making CI cheaper did not make it prove less (issue "the test
matrix doubles and still fits").

    python3 scripts/test_ids.py --out /tmp/ids-now                     # this checkout
    python3 scripts/test_ids.py --rev 3816a21^ --out /tmp/ids-before   # a git worktree of that revision
    python3 scripts/test_ids.py --diff /tmp/ids-before /tmp/ids-now    # per session: kept / dropped / added

Collection only (``pytest --collect-only -q``, nothing runs), in the cached venvs that ``nox`` built
(``GPTOSS_PATCH_VENV_CACHE``, default ``~/.cache/gptoss-patch/venvs``; run ``nox -s tests`` once first), each behind
a throwaway overlay with gptoss-patch and its runtime dependencies, as nox runs the tests (``noxfile.overlay_venv``;
needs ``nox`` and ``uv`` beside this python, as the README's commands install them). Each
session's paths come from the revision's own ``noxfile.py`` (``CELLS[release]["tests"]``, and the 0.11.0 cell's
``unit_upstream`` run as a session of its own); the marker expression is the one ``nox -s tests`` uses (``not soak``
where that revision's noxfile has the ``soak`` marker, ``not upstream`` for the unit session). The revision's tree
is put first on ``sys.path`` so its tests collect against its own ``gptoss_patch``. A session whose venv is missing is reported, not
guessed. Output: one ``<session>.txt`` per session (sorted node ids) and the counts on stdout.

Errors: exits 2 naming the revision when ``git worktree add`` fails, or the session whose collection failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("GPTOSS_PATCH_VENV_CACHE", Path.home() / ".cache" / "gptoss-patch" / "venvs"))

#: Printed by a child interpreter inside the revision's tree: {session: [pytest args]} and whether it has "soak".
_SPEC = """
import json, sys
sys.path.insert(0, sys.argv[1])
import noxfile
from gptoss_patch import matrix
tested = [r.vllm_ascend for r in matrix.ROWS if r.tested]
spec = {"unit": (None, ["tests/unit"])}
for r in tested:
    spec[f"cell-{r}"] = (r, list(noxfile.CELLS[r]["tests"]))
    if "unit_upstream" in noxfile.CELLS[r]:  # the unit tests marked upstream, run in that cell's venv
        spec[f"cell-{r}-unit-upstream"] = (r, list(noxfile.CELLS[r]["unit_upstream"]))
print(json.dumps({"sessions": spec, "soak": "soak" in open(sys.argv[1] + "/noxfile.py").read()}))
"""


def _venv_python(session: str) -> Path | None:
    """The newest complete cached venv of ``session`` (``cell-0.11.0`` -> ``cell-0.11.0-<key>``): collection needs the
    cell's vLLM / vllm-ascend, not the exact venv key of the revision's noxfile."""
    found = sorted((p for p in VENVS.glob(f"{session}-*") if (p / ".complete").exists()
                    and p.name[len(session) + 1:].isalnum()), key=lambda p: (p / ".complete").stat().st_mtime)
    return found[-1] / "bin" / "python" if found else None


def _overlay(base_py: Path, tree: Path, dest: Path) -> Path:
    """A throwaway venv over the cached venv of ``base_py`` with ``tree``'s gptoss-patch and its runtime dependencies
    (this checkout's ``noxfile.overlay_venv``); returns its python. Raises ``subprocess.CalledProcessError`` when the
    install fails."""
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    return noxfile.overlay_venv(base_py, tree, dest)


def collect(tree: Path, out: Path, only: list[str] | None = None) -> dict[str, int]:
    """Collect the test ids of every session of ``tree`` (or of the sessions named in ``only``) into
    ``out/<session>.txt``; returns ``{session: count}``."""
    proc = subprocess.run([sys.executable, "-c", _SPEC, str(tree)], capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:  # e.g. no `nox` beside this python (the noxfile imports it)
        print(f"reading {tree}/noxfile.py failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        raise SystemExit(2)
    spec = json.loads(proc.stdout)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.txt"):  # a reused directory: only this run's lists
        stale.unlink()
    counts: dict[str, int] = {}
    for session, (release, paths) in spec["sessions"].items():
        if only and session not in only:
            continue
        py = _venv_python("unit" if release is None else f"cell-{release}")
        if py is None:
            print(f"{session:<18} no cached venv under {VENVS}: run `nox -s {session}` first", file=sys.stderr)
            continue
        # the marker expression nox -s tests uses (noxfile `unit` / `_cell`): soak sweeps left out where the revision
        # has the marker, upstream-marked unit tests only in their own run
        soak = " and not soak" if spec["soak"] else ""
        marks = None if "-m" in paths else ("not upstream" + soak if release is None else soak.removeprefix(" and "))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}  # as nox's _clean_env
        env.update(PYTHONPATH=str(tree))
        if release is not None:
            env["GPTOSS_CELL"] = release
        with tempfile.TemporaryDirectory(prefix="test-ids-") as tmp:
            # the cached venvs hold upstream's wheels only; gptoss-patch and its runtime dependencies (wrapt) go into
            # a private overlay, as nox installs them (noxfile.overlay_venv)
            own = _overlay(py, tree, Path(tmp) / "venv")
            args = [str(own), "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *paths]
            if marks:
                args += ["-m", marks]
            proc = subprocess.run(args, capture_output=True, text=True, cwd=tree, env=env)
        ids = sorted(line for line in proc.stdout.splitlines() if "::" in line)
        if proc.returncode != 0 or not ids:
            print(f"{session}: collection failed (exit {proc.returncode}):\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}",
                  file=sys.stderr)
            raise SystemExit(2)
        (out / f"{session}.txt").write_text("\n".join(ids) + "\n")
        counts[session] = len(ids)
        print(f"{session:<18} {len(ids):4d} tests")
    return counts


def diff(before: Path, after: Path) -> None:
    """Print per session: tests kept, dropped (in ``before`` only) and added (in ``after`` only), dropped ids in
    full."""
    for name in sorted({p.stem for p in before.glob("*.txt")} | {p.stem for p in after.glob("*.txt")}):
        old = set((before / f"{name}.txt").read_text().splitlines()) if (before / f"{name}.txt").exists() else set()
        new = set((after / f"{name}.txt").read_text().splitlines()) if (after / f"{name}.txt").exists() else set()
        print(f"{name:<18} before {len(old):4d}  after {len(new):4d}  kept {len(old & new):4d}  "
              f"dropped {len(old - new):3d}  added {len(new - old):3d}")
        for test_id in sorted(old - new):
            print(f"    dropped: {test_id}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="a git revision of this repository (default: the checkout itself)")
    ap.add_argument("--out", type=Path, help="directory for the <session>.txt lists")
    ap.add_argument("--only", nargs="+", metavar="SESSION", help="these sessions only (unit, cell-0.11.0, ...)")
    ap.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two --out directories")
    args = ap.parse_args()
    if args.diff:
        diff(*args.diff)
        return
    if args.out is None:
        ap.error("--out DIR is required (or --diff BEFORE AFTER)")
    if args.rev is None:
        collect(ROOT, args.out, args.only)
        return
    with tempfile.TemporaryDirectory(prefix="gptoss-test-ids-") as tmp:
        tree = Path(tmp) / "tree"
        add = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.rev],
                             capture_output=True, text=True)
        if add.returncode != 0:
            print(f"git worktree add {args.rev!r} failed: {add.stderr.strip()}", file=sys.stderr)
            raise SystemExit(2)
        try:
            collect(tree, args.out, args.only)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
