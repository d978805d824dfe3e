"""The lifecycle of the native rows' patches on the real targets: the guard everywhere, plus layout H's
``attention.sink_window_forward_impl`` and layout G's with ``moe.activation_name`` (``gptoss_patch_testkit.lifecycle``;
the 0.11-0.14 cells run tests/cell/test_lifecycle.py)."""

import pytest

from conftest import ROW
from gptoss_patch import matrix
from gptoss_patch_testkit import lifecycle


@pytest.mark.parametrize("order", lifecycle.ORDERS)
def test_native_patch_lifecycle(order):
    result = lifecycle.observe(order)
    if ROW.verdict == matrix.APPLY:  # layouts H and G
        assert result["decision"] == "apply" and result["layout"] == ROW.layout in ("H", "G")
        assert result["patches"] == [*matrix.LAYOUT_PATCHES[ROW.layout], "guard.gpt_oss_model"]
    else:
        assert result["decision"] == "stand-down" and result["layout"] is None
        assert result["patches"] == ["guard.gpt_oss_model"]
    assert result["sources"] == ["lifecycle"] * 3  # nothing else activated (the .pth finder was taken out)
    lifecycle.assert_lifecycle(result, order)
