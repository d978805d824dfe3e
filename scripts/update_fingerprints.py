"""Rebuild ``gptoss_patch/upstream_fingerprints.json`` from the released vllm-ascend wheels.

For every release of the version matrix (:data:`gptoss_patch.matrix.ROWS`), download its wheel (or, where PyPI has
no cp311 wheel, its sdist) into ``--wheels DIR`` (:func:`gptoss_patch_testkit.release_source.release_tree`), read it
without installing or importing it, and fingerprint every patch target of every layout (:data:`gptoss_patch.matrix.LAYOUTS`; module-only
keys have no source segment and are skipped; a target absent from a release is left out). The fingerprint is
:func:`gptoss_patch.fingerprint.fingerprint_in_file`: sha256 of the def's source segment (``docs/upstream.md`` §6).

Usage::

    python scripts/update_fingerprints.py            # download into a temporary directory
    python scripts/update_fingerprints.py --wheels /tmp/wh --check   # exit 1 if the stored table differs

Run it after adding a row or a target; the cells check the table against the installed wheels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptoss_patch import drift, matrix  # noqa: E402


class ReleaseUnavailable(RuntimeError):
    """A release's wheel / sdist could not be downloaded or read (the message names the release and why)."""


def build(wheels: Path) -> dict[str, dict[str, str]]:
    """The whole table for every matrix row.

    Raises:
        ReleaseUnavailable: a release cannot be downloaded (no network, index without it) or its file is unreadable.
    """
    import subprocess
    import tarfile
    import zipfile

    from gptoss_patch_testkit.release_source import release_tree

    targets = drift.all_targets()
    table = {}
    for row in sorted(matrix.ROWS, key=lambda r: r.version):
        try:
            tree = release_tree(row.vllm_ascend, wheels)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, zipfile.BadZipFile,
                tarfile.TarError) as exc:
            raise ReleaseUnavailable(f"vllm-ascend {row.vllm_ascend}: its wheel (or sdist) could not be downloaded "
                                     f"into or read from {wheels} - {type(exc).__name__}: {exc}") from None
        table[row.vllm_ascend] = drift.fingerprints_in_tree(tree, targets)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, help="directory holding (or receiving) the vllm-ascend wheels")
    ap.add_argument("--check", action="store_true", help="compare with the stored table instead of writing it")
    args = ap.parse_args(argv)
    from gptoss_patch_testkit.release_source import CACHE

    try:
        table = build(args.wheels or CACHE)
    except ReleaseUnavailable as exc:
        print(f"error: {exc}\n(check the package index / network that pip uses, or put the file into --wheels DIR; "
              "nothing was written)", file=sys.stderr)
        return 1
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
