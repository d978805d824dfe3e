"""The untested rows of the matrix are decided from the released wheels (issue 8).

Each release's wheel is downloaded from PyPI once (``pip download --no-deps``; cached under
``~/.cache/gptoss-patch/wheels``), its Python files extracted - nothing is installed or imported - and
:func:`gptoss_patch.matrix.decide` is run in a child interpreter that sees only that tree as ``vllm_ascend``,
with the real static structural check (:func:`gptoss_patch.pairing.structural_check`, ``ast`` only).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptoss_patch import matrix

DECIDE = """
import json, sys
import functools
from gptoss_patch import matrix, pairing
# the paired vLLM stands for the installed one: only the vllm-ascend side is read (the tree on PYTHONPATH)
check = functools.partial(pairing.structural_check, installed_vllm=sys.argv[2])
d = matrix.decide(sys.argv[1], sys.argv[2], structural_check=check)
print(json.dumps({"verdict": d.verdict, "reason": d.reason, "row": d.row.vllm_ascend if d.row else None,
                  "failures": list(d.structural_failures)}))
"""


def _tree(release: str) -> Path:
    from gptoss_patch_testkit.release_source import release_tree

    return release_tree(release)


def _decide(release: str, vllm: str, as_version: str | None = None) -> dict:
    """decide() for the tree of ``release`` (reported as ``as_version`` when given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}
    env["PYTHONPATH"] = str(_tree(release))
    proc = subprocess.run([sys.executable, "-c", DECIDE, as_version or release, vllm], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


UNTESTED_APPLY = [r for r in matrix.ROWS if r.verdict == matrix.APPLY and not r.tested]


@pytest.mark.parametrize("row", UNTESTED_APPLY, ids=[r.vllm_ascend for r in UNTESTED_APPLY])
def test_untested_row_wheel_passes_the_structural_check_of_its_tested_row(row):
    """Judged against the tested row of its series, or - a series no cell runs (0.20 - 0.30, layout J) - against its
    own layout: its wheel (or sdist) has every target of the layout, with the defect the patch fixes."""
    d = _decide(row.vllm_ascend, row.vllm)
    assert d["verdict"] == matrix.APPLY, d
    judged = {r.vllm_ascend: r for r in matrix.ROWS}[d["row"]]
    assert judged.layout == row.layout, (d, row)
    assert f"structurally compatible with {judged.vllm_ascend}" in d["reason"]
    if not judged.tested:
        assert judged == row and matrix.nearest_tested(row.version) is None, (d, row)
        assert f"(not tested here; layout {row.layout})" in d["reason"], d


def test_rc0_wheel_is_structurally_different_as_well_as_refused():
    d = _decide("0.11.0rc0", "0.11.0")
    assert d["verdict"] == matrix.REFUSE and "different architecture" in d["reason"]
    # its tree, presented as another 0.11 build, fails the 0.11.0 layout (the MoE method module differs)
    env_check = _decide("0.11.0rc0", "0.11.0", as_version="0.11.0rc1.dev1")
    assert env_check["verdict"] == matrix.REFUSE and env_check["failures"], env_check


def test_013rc3_wheel_is_refused_by_its_row_whatever_its_structure():
    d = _decide("0.13.0rc3", "0.13.0")
    assert d["verdict"] == matrix.REFUSE and "separate build" in d["reason"]
    # its tree passes the 0.13.0 structural check (only the MoE apply's body differs), so the row alone refuses
    # it - also as a local build of it
    other = _decide("0.13.0rc3", "0.13.0", as_version="0.13.0rc4.dev1")
    assert other["verdict"] == matrix.APPLY, other
    local = _decide("0.13.0rc3", "0.13.0", as_version="0.13.0rc3+local")
    assert local["verdict"] == matrix.REFUSE and "separate build" in local["reason"]


@pytest.mark.parametrize("release", [r.vllm_ascend for r in matrix.ROWS])
def test_fingerprint_table_entry_equals_the_released_wheel(release):
    """Every row's entry (also untested, refused and stand-down rows) is what its wheel ships."""
    from gptoss_patch import drift

    live = drift.fingerprints_in_tree(_tree(release))
    assert live == drift.table()[release]


def test_the_moe_enum_patch_is_refused_where_upstream_already_compares_enum_members():
    """0.23.0's ``unquant_apply_mlp`` compares ``MoEActivation.SWIGLUOAI``: handing it the Enum's string value would
    make every expert plain SwiGLU. Presented as a build of the 0.18 series, its tree fails layout G's defect check."""
    d = _decide("0.23.0", "0.18.0", as_version="0.18.1rc1.dev100+gabc")
    assert d["verdict"] == matrix.REFUSE, d
    assert any("upstream handles it" in f or "no longer contains" in f for f in d["failures"]), d
    ok = _decide("0.18.0", "0.18.0", as_version="0.18.1rc1.dev100+gabc")  # control: 0.18.0's own tree passes
    assert ok["verdict"] == matrix.APPLY and ok["row"] == "0.18.0", ok
