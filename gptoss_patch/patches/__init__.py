"""The patches, one module per capability.

Each module opens with a header: why, how, which upstream releases, when it can be removed; and
exports ``PATCHES``, a list of :class:`gptoss_patch.registry.PatchSpec`. Which patches a release
needs, and where their targets live, is data in :mod:`gptoss_patch.matrix`.
"""

from __future__ import annotations

from gptoss_patch.registry import PatchSpec


def all_specs() -> dict[str, PatchSpec]:
    """Every declared patch by name (imports the capability modules; they import nothing heavy)."""
    from gptoss_patch.patches import attention, moe, nz_padding, yarn
    from gptoss_patch.patches.attention_graph import update as attention_graph

    specs: dict[str, PatchSpec] = {}
    for module in (attention, moe, yarn, attention_graph, nz_padding):
        for spec in module.PATCHES:
            if spec.name in specs:
                raise RuntimeError(f"patch name {spec.name!r} declared twice")
            specs[spec.name] = spec
    return specs


def layout_plan(layout: str | None) -> list[tuple[PatchSpec, str]]:
    """The patches of a module-layout family with their targets: ``[(spec, "module:qualname"), ...]``.

    The one place that joins :data:`gptoss_patch.matrix.LAYOUT_PATCHES` (which patches), the specs (what each does)
    and :data:`gptoss_patch.matrix.LAYOUTS` (where its target lives in that layout). ``None`` (nothing patched)
    gives ``[]``.

    Raises:
        KeyError: the layout is unknown, names a patch nobody declares, or lacks a patch's target key (a defect of
            the tables: ``tests/unit/test_matrix.py`` checks every layout).
    """
    from gptoss_patch import matrix

    if layout is None:
        return []
    if layout not in matrix.LAYOUTS or layout not in matrix.LAYOUT_PATCHES:
        raise KeyError(f"layout {layout!r} is not in gptoss_patch.matrix.LAYOUTS / LAYOUT_PATCHES")
    specs = all_specs()
    plan = []
    for name in matrix.LAYOUT_PATCHES[layout]:
        if name not in specs:
            raise KeyError(f"layout {layout} names patch {name!r}, which no gptoss_patch.patches module declares")
        spec = specs[name]
        if spec.target_key not in matrix.LAYOUTS[layout]:
            raise KeyError(f"layout {layout} has no target {spec.target_key!r} for patch {name}")
        plan.append((spec, matrix.LAYOUTS[layout][spec.target_key]))
    return plan
