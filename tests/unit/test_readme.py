"""The README is a user's page, and the pages it points to show the data the runtime uses (issues 8 and 28)."""

import re
from pathlib import Path

from gptoss_patch import matrix

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_version_matrix_page_is_the_decision_table():
    text = (ROOT / "docs" / "version-matrix.md").read_text(encoding="utf-8")
    assert matrix.markdown() in text, "docs/version-matrix.md is stale: paste `gptoss_patch.matrix.markdown()`"


def test_readme_release_table_is_the_decision_table_by_series():
    text = README.read_text(encoding="utf-8")
    assert matrix.series_markdown() in text, "README's release table is stale: paste `matrix.series_markdown()`"


def test_readme_refusal_table_is_every_refused_capability_with_its_setting():
    text = README.read_text(encoding="utf-8")
    assert matrix.refusals_markdown() in text, "README's refusal table is stale: paste `matrix.refusals_markdown()`"
    refused = {c for r in matrix.ROWS for c, cap in r.caps.items() if cap.state == matrix.REFUSED}
    assert refused and refused <= set(matrix.AVOIDS) and refused <= set(matrix.REFUSED_WHEN)
    for cap in refused:
        assert f"(`{cap}`)" in matrix.refusals_markdown()


def test_every_declared_patch_has_a_row_on_the_patches_page():
    """The layout patches (``all_specs``) and the vLLM-side checkpoint patches of both checkpoint capabilities: each
    name stands on the page in a table row of its own."""
    from gptoss_patch import patches
    from gptoss_patch.patches import checkpoint_bf16, checkpoint_mxfp4

    text = (ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    rows = {m for line in text.splitlines() if line.startswith("| `")
            for m in re.findall(r"`([a-z0-9_]+\.[a-z0-9_]+)`", line.split(" | ")[0])}
    declared = set(patches.all_specs()) | {s.name for s in (*checkpoint_bf16.PATCHES, *checkpoint_mxfp4.PATCHES)}
    assert len(declared) == 19 and declared - rows == set()


def test_readme_is_a_users_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for heading in ("## Install and run", "## Check your stack", "## Releases",
                    "## What is refused, and the setting that avoids it", "## Configuration", "## Operations kit",
                    "## Contributing"):
        assert heading in text


def test_readme_has_exactly_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert text.count("python3 -m pip install -q nox uv && python3 -m nox -s ") == 2


def test_the_patches_page_names_the_layouts_each_patch_is_planned_for():
    """Each layout patch's row on docs/patches.md names exactly the layouts whose plan (``patches.layout_plan``)
    holds it: ``| `a`, `b` / `c` | B / C E F |`` pairs the name groups split by " / " with the layout groups."""
    from gptoss_patch import matrix, patches

    planned = {}
    for layout in matrix.LAYOUTS:
        for spec, _ in patches.layout_plan(layout):
            planned.setdefault(spec.name, set()).add(layout)
    text = (ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    checked = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("| `") or not re.fullmatch(r"[A-Z]( [A-Z])*( / [A-Z]( [A-Z])*)*", cells[1]):
            continue
        name_groups = [re.findall(r"`([a-z0-9_]+\.[a-z0-9_]+)`", g) for g in cells[0].split(" / ")]
        layout_groups = [set(g.split()) for g in cells[1].split(" / ")]
        assert len(name_groups) == len(layout_groups), line
        for names, layouts in zip(name_groups, layout_groups):
            for name in names:
                assert planned.get(name) == layouts, f"{name}: page says {sorted(layouts)}, plan {sorted(planned.get(name, ()))}"
                checked.add(name)
    assert checked == set(planned)
