"""Drift: is the code we are about to patch the code a tested release shipped?

For every release of the version matrix (patched, refused and stand-down rows), ``upstream_fingerprints.json`` (next to this module) holds
a fingerprint of each patch target: the sha256 of the target's source segment (``ast.get_source_segment`` of its
``def``/``class``, decorators excluded: ``docs/upstream.md`` §6), computed
from the released wheel by ``scripts/update_fingerprints.py``. When ``status()`` or ``verify`` asks (never on a
worker's import path: :func:`describe` is called by :func:`gptoss_patch._state.status`), every applied target is
fingerprinted again from the installed files (:func:`gptoss_patch.fingerprint.fingerprint`) and classified here:

* *tested code*: the fingerprint equals that of a tested release (a nox cell ran the suite against it);
* *untested code*: it matches no tested release - an edited install, a local build, a release we have not run.
  ``verify`` marks it. Whether to apply is still the structural check's call (signature and presence), so an
  edit that keeps the structure is applied and reported, not refused.

Every patched cell checks that the installed release's live fingerprints equal its entry in the table
(``tests/cell/test_activation.py``); the other rows' entries are checked against their wheels by
``tests/unit/test_matrix_wheels.py`` (see also ``scripts/update_fingerprints.py --check``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

#: The table: ``{vllm_ascend_release: {"module:qualname": sha256}}``.
TABLE_PATH = Path(__file__).with_name("upstream_fingerprints.json")

TESTED = "tested code"
UNTESTED = "untested code"
UNKNOWN = "no fingerprint"


@dataclass(frozen=True)
class Drift:
    """How one target's installed code compares with the releases we know.

    Attributes:
        verdict: :data:`TESTED`, :data:`UNTESTED` or :data:`UNKNOWN` (no source to hash, e.g. a module target).
        matches: releases (tested or not) whose shipped target has this fingerprint, oldest first.
        text: one human line for ``verify``.
    """

    verdict: str
    matches: tuple[str, ...]
    text: str


@functools.lru_cache(maxsize=1)
def table() -> Mapping[str, Mapping[str, str]]:
    """The fingerprint table (read once). An unreadable table gives ``{}``: drift then reports *untested code*.

    Raises nothing: drift is informative and must never stop activation.
    """
    try:
        return json.loads(TABLE_PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def all_targets() -> list[str]:
    """Every ``module:qualname`` patch target of every layout of the matrix, sorted (module-only keys excluded)."""
    from gptoss_patch import matrix

    return sorted({t for layout in matrix.LAYOUTS.values() for t in layout.values() if ":" in t})


def fingerprints_in_tree(root: Path, targets: list[str] | None = None) -> dict[str, str]:
    """Fingerprints of ``targets`` (default :func:`all_targets`) in an unpacked source tree, nothing imported.

    Args:
        root: directory holding the ``vllm_ascend/`` package sources (e.g. an extracted wheel).
        targets: ``module:qualname`` strings; a target whose module or def is absent is left out.

    Returns:
        ``{target: sha256 hex}`` (:func:`gptoss_patch.fingerprint.fingerprint_in_file`).
    """
    from gptoss_patch.fingerprint import fingerprint_in_file, split_target

    out = {}
    for target in all_targets() if targets is None else targets:
        module, qualname = split_target(target)
        base = Path(root).joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                fp = fingerprint_in_file(path, qualname)
                if fp is not None:
                    out[target] = fp
                break
    return out


def _tested_releases() -> set[str]:
    from gptoss_patch import matrix

    return {r.vllm_ascend for r in matrix.ROWS if r.tested and r.verdict == matrix.APPLY}


def classify(target: str, fingerprint: str | None,
             fingerprints: Mapping[str, Mapping[str, str]] | None = None,
             tested: set[str] | None = None) -> Drift:
    """Classify ``target``'s installed ``fingerprint`` against the table.

    Args:
        target: ``"module:qualname"`` as in :data:`gptoss_patch.matrix.LAYOUTS`.
        fingerprint: sha256 hex of its installed source segment, or None when it has none.
        fingerprints: the table (default :func:`table`); tests pass their own.
        tested: releases that count as tested (default: matrix rows with ``tested=True`` and verdict apply).
    """
    if fingerprint is None:
        return Drift(UNKNOWN, (), "no source to fingerprint")
    fingerprints = table() if fingerprints is None else fingerprints
    tested = _tested_releases() if tested is None else tested
    from packaging.version import Version

    matches = tuple(sorted((rel for rel, fps in fingerprints.items() if fps.get(target) == fingerprint),
                           key=Version))
    tested_matches = [m for m in matches if m in tested]
    if tested_matches:
        return Drift(TESTED, matches, f"{TESTED} (as shipped in {', '.join(tested_matches)})")
    if matches:
        return Drift(UNTESTED, matches, f"{UNTESTED}: as shipped in {', '.join(matches)}, which no patched cell tests")
    return Drift(UNTESTED, (), f"{UNTESTED}: fingerprint {fingerprint[:12]} matches no release we know "
                               "(edited or local build); applied because the structural check passed")


@functools.lru_cache(maxsize=None)
def describe(target: str) -> tuple[str | None, str | None]:
    """``(fingerprint, drift text)`` of an installed target, computed once per process (read, hashed, classified).

    For ``status()`` / ``verify``; ``(None, None)`` when it cannot be read (drift is informative only: never raises).
    """
    from gptoss_patch.fingerprint import fingerprint

    try:
        fp = fingerprint(target)
        return fp, classify(target, fp).text
    except Exception:  # noqa: BLE001 - a fingerprint is informative only
        return None, None
