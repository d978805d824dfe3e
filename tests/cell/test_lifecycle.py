"""Every PatchSpec of this cell's layout (and the guard) on the real targets: import-then-activate and
activate-then-import, activate twice, deactivate restores the targets and the by-value names, the marker is on the
wrapper only (``gptoss_patch_testkit.lifecycle``)."""

import pytest

from conftest import ROW
from gptoss_patch import matrix
from gptoss_patch.patches import all_specs
from gptoss_patch_testkit import lifecycle


@pytest.mark.parametrize("order", lifecycle.ORDERS)
def test_patch_lifecycle(order):
    result = lifecycle.observe(order)
    assert result["decision"] == "apply" and result["layout"] == ROW.layout
    assert result["patches"] == [*matrix.LAYOUT_PATCHES[ROW.layout], "guard.gpt_oss_model"]
    assert result["sources"] == ["lifecycle"] * 3  # nothing else activated (the .pth finder was taken out)
    lifecycle.assert_lifecycle(result, order)
    # the by-value names really were there to rebind: every patch that declares rebind_keys found its importers
    rebinding = [n for n in matrix.LAYOUT_PATCHES[ROW.layout] if all_specs()[n].rebind_keys]
    assert rebinding, "every patched layout rebinds something (the MoE MLP entry and the graph update)"
    for name in rebinding:
        assert result["steps"]["activated"][name]["by_value"], name
