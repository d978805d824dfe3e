"""Patch registry: apply / remove through wrapt, no double wrapping, by-value rebinding, structural checks.

The targets are small real modules written to a temporary package (the registry is our mechanism;
upstream classes are exercised in the matrix cells)."""

import importlib
import sys
import textwrap

import pytest

from gptoss_patch.fingerprint import fingerprint, split_target
from gptoss_patch.registry import APPLIED, FAILED, PENDING, SKIPPED, PatchSpec, Registry, static_check

TARGET_SRC = textwrap.dedent('''
    class Impl:
        def __init__(self, num_heads, sliding_window, **kwargs):
            self.num_heads = num_heads
            self.dropped = kwargs

    def helper(x, y=1):
        return x + y
''')
USER_SRC = "from regpkg.target import helper\n\ndef use(x):\n    return helper(x)\n"


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "regpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "target.py").write_text(TARGET_SRC)
    (root / "user.py").write_text(USER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m.startswith("regpkg")]:
        del sys.modules[m]
    yield root
    for m in [m for m in sys.modules if m.startswith("regpkg")]:
        del sys.modules[m]


def keep_extra(wrapped, instance, args, kwargs):
    extra = kwargs.pop("extra", None)
    wrapped(*args, **kwargs)
    instance.extra = extra


def plus_ten(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 10


LAYOUT = {"init": "regpkg.target:Impl.__init__", "helper": "regpkg.target:helper", "user": "regpkg.user"}
INIT = PatchSpec("t.keep_extra", "init", keep_extra, params=("num_heads", "sliding_window", "**"),
                 absent_params=("extra",))
HELPER = PatchSpec("t.plus_ten", "helper", plus_ten, params=("x",), rebind_keys=("user",))


def test_apply_then_remove_restores_the_original(pkg):
    target = importlib.import_module("regpkg.target")
    original = target.Impl.__dict__["__init__"]
    reg = Registry([INIT], LAYOUT)
    assert reg.states["t.keep_extra"].state == PENDING
    reg.on_import(target)
    assert reg.states["t.keep_extra"].state == APPLIED
    obj = target.Impl(4, 128, extra="kept", other=1)
    assert obj.extra == "kept" and obj.dropped == {"other": 1}
    reg.remove_all()
    assert target.Impl.__dict__["__init__"] is original
    assert reg.states["t.keep_extra"].state == SKIPPED
    assert not hasattr(target.Impl(4, None, extra=1), "extra")


def test_never_double_wraps(pkg):
    target = importlib.import_module("regpkg.target")
    reg = Registry([HELPER], LAYOUT)
    reg.on_import(target)
    first = target.helper
    reg.states["t.plus_ten"].state = PENDING  # as if a second activation asked again
    reg.on_import(target)
    assert target.helper is first and target.helper(1) == 12
    reg2 = Registry([HELPER], LAYOUT)  # a second registry sees our marker
    reg2.on_import(target)
    assert reg2.states["t.plus_ten"].reason == "already wrapped" and target.helper(1) == 12


def test_names_imported_by_value_are_rebound_and_restored(pkg):
    target = importlib.import_module("regpkg.target")
    user = importlib.import_module("regpkg.user")
    reg = Registry([HELPER], LAYOUT)
    assert set(reg.target_modules()) == {"regpkg.target", "regpkg.user"}
    reg.on_import(target)
    assert user.use(1) == 12  # the importer was already imported: rebound when the target is wrapped
    reg.on_import(user)
    assert user.use(1) == 12 and user.helper is target.helper
    reg.remove_all()
    assert user.use(1) == 2 and target.helper(1) == 2


def test_importer_hook_running_first_still_gets_rebound(pkg):
    """Both modules imported before activation: wrapt runs each hook at registration, in the order of
    ``target_modules()`` - the importer's may run before the target is wrapped (0.11's ``moe_comm_method`` is also
    the target of ``moe.fused_experts``, so it comes first). Found by tests/cell/test_lifecycle.py."""
    target = importlib.import_module("regpkg.target")
    user = importlib.import_module("regpkg.user")
    reg = Registry([HELPER], LAYOUT)
    reg.on_import(user)  # nothing applied yet: nothing to rebind
    assert user.use(1) == 2
    reg.on_import(target)
    assert user.use(1) == 12
    reg.remove_all()
    assert user.use(1) == 2 and user.helper is target.helper


def test_an_importer_still_executing_is_left_to_its_own_hook(pkg):
    """The importer is in sys.modules but has not bound the name yet (it is importing the target): nothing is set
    on it early; its own hook rebinds it once it has run."""
    import types

    target = importlib.import_module("regpkg.target")
    half = types.ModuleType("regpkg.user")
    sys.modules["regpkg.user"] = half
    reg = Registry([HELPER], LAYOUT)
    reg.on_import(target)
    assert "helper" not in half.__dict__
    half.helper = reg._applied["t.plus_ten"].original  # its `from regpkg.target import helper` ran meanwhile
    reg.on_import(half)
    assert half.helper is target.helper and half.helper(1) == 12


def test_a_target_module_another_thread_is_still_importing_is_patched_when_its_import_finishes(pkg):
    """Issue 32: thread A is executing ``regpkg.target`` (in ``sys.modules``, ``Impl`` not yet defined) when thread
    B registers the hooks; wrapt runs B's hook at once. The patch is deferred - pending, named "still being
    imported" - not failed, and applied by the waiter once A's import finishes, without any further import. The
    same hook outside :func:`registering` (wrapt's post-exec path) is not deferred; one without deferral (the old
    behaviour, shown with ``on_import``) records "target not found" for good."""
    import threading

    import wrapt

    from gptoss_patch.registry import registering

    (pkg / "target.py").write_text("import regpkg.gate\nregpkg.gate.wait()\n" + TARGET_SRC)
    (pkg / "gate.py").write_text("import threading\nentered, release = threading.Event(), threading.Event()\n"
                                 "def wait():\n    entered.set()\n    assert release.wait(30)\n")
    gate = importlib.import_module("regpkg.gate")
    importer = threading.Thread(target=importlib.import_module, args=("regpkg.target",))
    importer.start()
    assert gate.entered.wait(30)
    half = sys.modules["regpkg.target"]
    assert not hasattr(half, "Impl")
    old_way = Registry([INIT], LAYOUT)
    old_way.on_import(half)
    assert old_way.states["t.keep_extra"].state == FAILED and "target not found" in old_way.states["t.keep_extra"].reason

    reg = Registry([INIT], LAYOUT)
    with registering():
        wrapt.register_post_import_hook(reg.hook, "regpkg.target")  # in sys.modules: runs at once
    st = reg.states["t.keep_extra"]
    assert st.state == PENDING and "regpkg.target was still being imported" in st.reason
    assert reg.deferred_history == ["regpkg.target"]
    waiter = reg._waiter
    gate.release.set()
    importer.join(30)
    waiter.join(30)
    assert st.state == APPLIED and reg._waiter is None, st
    target = sys.modules["regpkg.target"]
    impl = target.Impl(num_heads=2, sliding_window=128, extra="sinks")
    assert impl.extra == "sinks" and impl.dropped == {}
    reg.remove_all()


def test_a_hook_registered_before_the_import_applies_as_the_import_finishes(pkg):
    """wrapt's post-exec path runs the hook while importlib still marks the module as initializing: the registry must
    apply there and then (not defer it to a waiter thread), before the importer gets the module back."""
    import wrapt

    reg = Registry([INIT], LAYOUT)
    wrapt.register_post_import_hook(reg.hook, "regpkg.target")
    target = importlib.import_module("regpkg.target")
    assert reg.states["t.keep_extra"].state == APPLIED and reg.deferred_history == [] and reg._waiter is None
    assert target.Impl(num_heads=2, sliding_window=128, extra=1).extra == 1
    reg.remove_all()


def test_runtime_structural_check_fails_without_half_applying(pkg):
    target = importlib.import_module("regpkg.target")
    spec = PatchSpec("t.bad", "init", keep_extra, params=("num_heads", "block_size"))
    reg = Registry([spec], LAYOUT)
    reg.on_import(target)
    st = reg.states["t.bad"]
    assert st.state == FAILED and "block_size" in st.reason
    assert not hasattr(target.Impl.__dict__["__init__"], "_self_gptoss_patch_name")


def test_absent_parameter_check_detects_native_support(pkg):
    (pkg / "target.py").write_text(TARGET_SRC.replace("sliding_window, **kwargs", "sliding_window, extra=None, **kwargs"))
    target = importlib.import_module("regpkg.target")
    reg = Registry([INIT], LAYOUT)
    reg.on_import(target)
    assert reg.states["t.keep_extra"].state == FAILED
    assert "already has parameter 'extra'" in reg.states["t.keep_extra"].reason


def test_missing_target_key_is_skipped_with_reason():
    reg = Registry([INIT], {})
    st = reg.states["t.keep_extra"]
    assert st.state == SKIPPED and "no target 'init'" in st.reason


def test_static_check_reads_source_without_importing(pkg):
    assert static_check(INIT, LAYOUT["init"]) == []
    assert "regpkg.target" not in sys.modules
    bad = PatchSpec("t.bad", "init", keep_extra, params=("block_size",))
    assert static_check(bad, LAYOUT["init"]) == ["regpkg.target:Impl.__init__ has no parameter 'block_size'"]
    assert static_check(INIT, "regpkg.target:Nope.__init__")[0].endswith("not defined in " + str(pkg / "target.py"))
    assert "module regpkg.missing not found" in static_check(INIT, "regpkg.missing:X")[0]


def test_fingerprint_is_the_sha256_of_the_source_segment(pkg):
    import hashlib

    segment = "def helper(x, y=1):\n    return x + y"
    assert fingerprint("regpkg.target:helper") == hashlib.sha256(segment.encode()).hexdigest()
    assert fingerprint("regpkg.target:absent") is None


def test_split_target_rejects_malformed():
    assert split_target("a.b:C.d") == ("a.b", "C.d")
    with pytest.raises(ValueError, match="not of the form"):
        split_target("a.b.C.d")
