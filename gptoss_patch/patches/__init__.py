"""The patches, one module per capability.

Each module opens with a header: why, how, which upstream releases, when it can be removed; and
exports ``PATCHES``, a list of :class:`gptoss_patch.registry.PatchSpec`. Which patches a release
needs, and where their targets live, is data in :mod:`gptoss_patch.matrix`.
"""

from __future__ import annotations

from gptoss_patch.registry import PatchSpec


def all_specs() -> dict[str, PatchSpec]:
    """Every declared patch by name (imports the capability modules; they import nothing heavy)."""
    from gptoss_patch.patches import aclgraph, attention, moe, rope, weights

    specs: dict[str, PatchSpec] = {}
    for module in (attention, moe, rope, aclgraph, weights):
        for spec in module.PATCHES:
            if spec.name in specs:
                raise RuntimeError(f"patch name {spec.name!r} declared twice")
            specs[spec.name] = spec
    return specs
