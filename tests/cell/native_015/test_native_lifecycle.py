"""The lifecycle of the native rows' patches on the real targets: the guard everywhere, plus layout G's
``moe.activation_name`` (``gptoss_patch.testing.lifecycle``; the patched cells run tests/cell/test_lifecycle.py)."""

import pytest

from conftest import ROW
from gptoss_patch import matrix
from gptoss_patch.testing import lifecycle


@pytest.mark.parametrize("order", lifecycle.ORDERS)
def test_native_patch_lifecycle(order):
    result = lifecycle.observe(order)
    if ROW.verdict == matrix.APPLY:  # layout G
        assert result["decision"] == "apply" and result["layout"] == "G"
        assert result["patches"] == [*matrix.LAYOUT_PATCHES["G"], "guard.gpt_oss_model"]
    else:
        assert result["decision"] == "stand-down" and result["layout"] is None
        assert result["patches"] == ["guard.gpt_oss_model"]
    assert result["sources"] == ["lifecycle"] * 3  # nothing else activated (the .pth finder was taken out)
    lifecycle.assert_lifecycle(result, order)
