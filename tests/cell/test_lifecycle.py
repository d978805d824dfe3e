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



def test_activation_while_another_thread_imports_a_target_module_patches_it_when_that_import_finishes():
    """Issue 32: two threads' first imports left the attention patches "failed: target not found". Thread A's import
    of the attention module is held after importlib put it in ``sys.modules`` and before its body ran, while the
    main thread activates (``gptoss_patch_testkit.concurrent_import``): wrapt runs the hook at once on the empty
    module. Its patches wait (pending, deferred), and once A's import finishes they are applied without any further
    import. With the hook of before the fix, the same interleaving leaves them failed."""
    from gptoss_patch_testkit import concurrent_import

    gated = matrix.LAYOUTS[ROW.layout]["attention_impl_init"].partition(":")[0]
    res = concurrent_import.run(gated)
    print(f"{gated}: {res}")
    assert res["errors"] == [] and res["decision"] == "apply" and set(res["deferred"]) == {gated}, res
    # keep_sinks and the layout's forward patch (attention.sink_window_forward, _impl from layout C)
    assert "attention.keep_sinks" in res["states"], res
    assert any(n.startswith("attention.sink_window_forward") for n in res["states"]), res
    assert set(res["while_held"].values()) == {"pending"}, res
    assert all(state == "applied" for state, _ in res["states"].values()), res
    if ROW.layout != "B":  # the negative control once per suite (an interpreter start each): layout B
        return
    concurrent_import.check_old_hook_fails(gated)
