"""The lifecycle of the native rows' patches on the real targets: the guard everywhere, plus layout H's
``attention.sink_window_forward_impl``, layout G's with ``moe.activation_name`` and layout I's ``attention.band_128_keys``
(``gptoss_patch_testkit.lifecycle``;
the 0.11-0.14 cells run tests/cell/test_lifecycle.py)."""

import pytest

from conftest import ROW
from gptoss_patch import matrix
from gptoss_patch_testkit import lifecycle


@pytest.mark.parametrize("order", lifecycle.ORDERS)
def test_native_patch_lifecycle(order):
    result = lifecycle.observe(order)
    if ROW.verdict == matrix.APPLY:  # layouts H, G and I
        assert result["decision"] == "apply" and result["layout"] == ROW.layout in ("H", "G", "I")
        assert result["patches"] == [*matrix.LAYOUT_PATCHES[ROW.layout], "guard.gpt_oss_model"]
    else:
        assert result["decision"] == "stand-down" and result["layout"] is None
        assert result["patches"] == ["guard.gpt_oss_model"]
    assert result["sources"] == ["lifecycle"] * 3  # nothing else activated (the .pth finder was taken out)
    lifecycle.assert_lifecycle(result, order)


def test_activation_while_another_thread_imports_a_target_module_patches_it_when_that_import_finishes():
    """As in the patched cells (tests/cell/test_lifecycle.py, issue 32): the row's attention module (layouts H, G, I)
    or, on stand-down rows, vLLM's GPT-OSS model module (the guard's and the MXFP4 loader's target) is held mid-import
    in another thread while gptoss-patch activates; its patches wait and are applied when that import finishes - with
    the hook of before the fix they stay failed."""
    from gptoss_patch.patches import guard
    from gptoss_patch_testkit import concurrent_import

    if ROW.layout:
        gated = next(iter(matrix.LAYOUTS[ROW.layout].values())).partition(":")[0]  # the attention module
    else:
        gated = guard.TARGET_MODULE
    res = concurrent_import.run(gated)
    print(f"{gated}: {res}")
    assert res["errors"] == [] and res["decision"] == ROW.verdict and set(res["deferred"]) == {gated}, res
    assert res["states"] and set(res["while_held"].values()) == {"pending"}, res
    assert all(state == "applied" for state, _ in res["states"].values()), res
    if ROW.layout != "H":  # the negative control once per suite (an interpreter start each): layout H
        return
    concurrent_import.check_old_hook_fails(gated)
