"""Rebuild ``gptoss_patch/upstream_fingerprints.json`` from the released vllm-ascend wheels.

For every release of the version matrix (:data:`gptoss_patch.matrix.ROWS`), download its wheel from PyPI
(``pip download --no-deps vllm-ascend==X``; or take it from ``--wheels DIR``), read it without installing or
importing it, and fingerprint every patch target of every layout (:data:`gptoss_patch.matrix.LAYOUTS`; module-only
keys have no source segment and are skipped; a target absent from a release is left out). The fingerprint is
:func:`gptoss_patch.registry.fingerprint_in_file`: sha256 of the def's source segment, the method of
``shared/reference/upstream_fingerprints.json``.

Usage::

    python scripts/update_fingerprints.py            # download into a temporary directory
    python scripts/update_fingerprints.py --wheels /tmp/wh --check   # exit 1 if the stored table differs

Run it after adding a row or a target; the cells check the table against the installed wheels.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptoss_patch import drift, matrix  # noqa: E402


def wheel_for(release: str, wheels: Path) -> Path:
    """The vllm-ascend wheel of ``release`` in ``wheels`` (downloaded there with pip when missing)."""
    pattern = str(wheels / f"vllm_ascend-{release}-*.whl")
    found = glob.glob(pattern)
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm-ascend=={release}",
                        "-d", str(wheels)], check=True)
        found = glob.glob(pattern)
    if not found:
        raise SystemExit(f"no wheel for vllm-ascend {release} in {wheels}")
    return Path(found[0])


def fingerprints_of(wheel: Path, targets: list[str], workdir: Path) -> dict[str, str]:
    """Fingerprints of ``targets`` in ``wheel`` (extracted under ``workdir``; nothing imported)."""
    root = workdir / wheel.stem
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root, [n for n in zf.namelist() if n.startswith("vllm_ascend/") and n.endswith(".py")])
    return drift.fingerprints_in_tree(root, targets)


def build(wheels: Path) -> dict[str, dict[str, str]]:
    """The whole table for every matrix row."""
    targets = drift.all_targets()
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in sorted(matrix.ROWS, key=lambda r: r.version):
            table[row.vllm_ascend] = fingerprints_of(wheel_for(row.vllm_ascend, wheels), targets, Path(tmp))
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, help="directory holding (or receiving) the vllm-ascend wheels")
    ap.add_argument("--check", action="store_true", help="compare with the stored table instead of writing it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = build(args.wheels or Path(tmp))
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.check:
        stored = drift.TABLE_PATH.read_text(encoding="utf-8") if drift.TABLE_PATH.exists() else ""
        if stored != text:
            print(f"{drift.TABLE_PATH} is stale: run scripts/update_fingerprints.py", file=sys.stderr)
            return 1
        print(f"{drift.TABLE_PATH}: up to date ({len(table)} releases)")
        return 0
    drift.TABLE_PATH.write_text(text, encoding="utf-8")
    for release, fps in table.items():
        print(f"{release:>10}: {len(fps)} targets")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
