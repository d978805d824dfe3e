"""The .pth start-up hook: costs nothing, never breaks start-up, honours GPTOSS_PATCH_DISABLE, fires on vllm_ascend."""

import json
import subprocess

import pytest

from conftest import clean_env

HEAVY = ("wrapt", "importlib.metadata", "vllm", "vllm_ascend", "torch", "packaging")


def run(py, code, **env):
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=clean_env(**env), timeout=60)


def test_pth_imports_nothing_heavy_at_start_up(bare_site):
    py, _ = bare_site
    proc = subprocess.run([str(py), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                          env=clean_env(), timeout=60)
    names = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "_gptoss_patch_hook" in names  # the .pth is live
    imported_heavy = [n for n in names if n.split(".")[0] in {h.split(".")[0] for h in HEAVY} and
                      any(n == h or n.startswith(h + ".") for h in HEAVY)]
    assert imported_heavy == []


def test_configuration_module_is_read_only_when_a_variable_is_set(bare_site):
    """The start-up flags go through gptoss_patch.config, imported only for a non-empty value: the common start-up
    (nothing set) reads the environment and imports nothing of ours beyond the bootstrap."""
    py, _ = bare_site
    plain = _imported_at_start_up(py)
    assert "_gptoss_patch_hook" in plain and not any(n == "gptoss_patch" or n.startswith("gptoss_patch.")
                                                     for n in plain)  # not even the package
    set_ = subprocess.run([str(py), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                          env=clean_env(GPTOSS_PATCH_FORCE="0"), timeout=60)
    assert "gptoss_patch.config" in set_.stderr and set_.returncode == 0


def test_finder_installed_and_waiting(bare_site):
    py, _ = bare_site
    proc = run(py, "import sys; print([getattr(f, '__name__', type(f).__name__) for f in sys.meta_path])")
    assert proc.stdout.startswith("['_gptoss_patch_hook',") and proc.stderr == ""  # the hook module is the finder


def test_disable_patches_nothing_but_keeps_the_guard_armed(bare_site, tmp_path):
    py, _ = bare_site
    fake = tmp_path / "src" / "vllm_ascend"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = ("import gptoss_patch, json, vllm_ascend; s = gptoss_patch.status(); "
            "print(json.dumps([s.decision, s.patches, s.details.get('guard', '')]))")
    proc = run(py, code, GPTOSS_PATCH_DISABLE="1", PYTHONPATH=_deps_path(tmp_path))
    import json

    decision, patches, guard = json.loads(proc.stdout)
    assert decision == "disabled" and patches == [] and proc.returncode == 0, proc.stderr


def _deps_path(tmp_path):
    """PYTHONPATH with a fake vllm_ascend (tmp/src) and copies of the runtime dependencies only."""
    import os
    import shutil

    import packaging
    import wrapt

    deps = tmp_path / "deps"
    if not deps.exists():
        for m in (packaging, wrapt):
            shutil.copytree(os.path.dirname(m.__file__), deps / m.__name__)
    return os.pathsep.join([str(tmp_path / "src"), str(deps)])


def test_fault_inside_the_bootstrap_never_breaks_start_up(bare_site):
    py, site = bare_site
    boot = site / "_gptoss_patch_hook.py"
    src = boot.read_text()
    needle = '        sys.meta_path.insert(0, sys.modules[__name__])'
    assert needle in src
    boot.write_text(src.replace(needle, '        raise RuntimeError("injected fault")\n' + needle))
    proc = run(py, "print(1)")
    assert proc.returncode == 0 and proc.stdout == "1\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "injected fault" in lines[0] and lines[0].startswith("gptoss-patch:")


def _imported_at_start_up(py):
    proc = subprocess.run([str(py), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                          env=clean_env(), timeout=60)
    return {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("leftover", [False, True], ids=["package-gone", "stray-directory-left"])
def test_orphaned_pth_is_silent_and_imports_nothing(bare_site, leftover):
    """gptoss_patch.pth and its hook module left in site-packages without the package (issue 17): no traceback in
    every python run, and nothing is imported beyond the hook module (the package is looked for only when
    vllm_ascend is first imported)."""
    import shutil

    py, site = bare_site
    lines = (site / "gptoss_patch.pth").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ")  # site.py executes only lines starting with import
    shutil.rmtree(site / "gptoss_patch")
    if leftover:  # e.g. files pip did not record: the directory then imports as a namespace package
        (site / "gptoss_patch").mkdir()
        (site / "gptoss_patch" / "notes.txt").write_text("left behind\n")
    proc = run(py, "print(1)")
    assert proc.returncode == 0 and proc.stdout == "1\n" and proc.stderr == ""
    # silent with a start-up variable set too (the hook then looks for the package at once), and when vllm_ascend is
    # imported (the package is looked for then)
    proc = run(py, "print(1)", GPTOSS_PATCH_DISABLE="1")
    assert proc.returncode == 0 and proc.stdout == "1\n" and proc.stderr == ""
    fake = site.parent / "src" / "vllm_ascend"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("VALUE = 7\n")
    proc = run(py, "import vllm_ascend; print(vllm_ascend.VALUE)", PYTHONPATH=str(fake.parent))
    assert proc.returncode == 0 and proc.stdout == "7\n" and proc.stderr == ""
    with_pth = _imported_at_start_up(py)
    (site / "gptoss_patch.pth").unlink()
    assert with_pth - _imported_at_start_up(py) == {"_gptoss_patch_hook"}


def test_an_image_that_ships_bytecode_only_still_activates(bare_site, tmp_path):
    """``compileall -b`` then the sources removed (some container images do): the first lookup of vllm_ascend runs the
    hook's loader from its .pyc, and activation happens as with sources."""
    import compileall

    py, site = bare_site
    compileall.compile_dir(str(site), quiet=1, legacy=True)
    for src in [site / "_gptoss_patch_hook.py", site / "_gptoss_patch_hook_loader.py",
                *(site / "gptoss_patch").rglob("*.py")]:
        src.unlink()
    path = _fake_stack(tmp_path)
    proc = run(py, "import vllm_ascend, gptoss_patch; print(vllm_ascend.ACTIVE, gptoss_patch.status().sources)",
               PYTHONPATH=path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split(None, 1) == ["True", "['import-hook']\n"]


def test_a_gptoss_patch_folder_in_the_working_directory_does_not_shadow_the_installed_one(bare_site, tmp_path):
    """The package is first imported at the first vllm_ascend lookup, when sys.path starts with the working directory:
    a ``gptoss_patch/`` there (a checkout, a copy) must not be the one that activates."""
    py, site = bare_site
    path = _fake_stack(tmp_path)
    work = tmp_path / "work"
    (work / "gptoss_patch").mkdir(parents=True)
    (work / "gptoss_patch" / "__init__.py").write_text("raise RuntimeError('the shadowing copy was imported')\n")
    (work / "_gptoss_patch_hook_loader.py").write_text("raise RuntimeError('the shadowing loader was imported')\n")
    proc = subprocess.run([str(py), "-c", "import vllm_ascend, sys; m = sys.modules['gptoss_patch']; "
                           "print(vllm_ascend.ACTIVE, m.__file__.startswith(sys.argv[1]))", str(site)],
                          capture_output=True, text=True, cwd=work, env=clean_env(PYTHONPATH=path), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_bad_environment_value_is_one_line_naming_the_variable(bare_site):
    py, _ = bare_site
    proc = run(py, "print(1)", GPTOSS_PATCH_DISABLE="maybe")
    assert proc.returncode == 0 and proc.stdout == "1\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "GPTOSS_PATCH_DISABLE='maybe'" in lines[0]


def test_first_import_of_vllm_ascend_activates(bare_site, tmp_path):
    py, _ = bare_site
    fake = tmp_path / "src" / "vllm_ascend"  # a package named vllm_ascend, without any distribution metadata
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = ("import gptoss_patch, json; assert not gptoss_patch.status().activated; import vllm_ascend; "
            "s = gptoss_patch.status(); print(json.dumps([s.activated, s.sources, s.decision, s.reason]))")
    import json
    import os

    import packaging
    import wrapt

    import shutil

    deps = tmp_path / "deps"  # only the two runtime dependencies, not the test environment's site-packages
    for m in (packaging, wrapt):
        shutil.copytree(os.path.dirname(m.__file__), deps / m.__name__)
    path = os.pathsep.join([str(tmp_path / "src"), str(deps)])
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=clean_env(PYTHONPATH=path),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr

    activated, sources, decision, reason = json.loads(proc.stdout)
    assert activated and sources == ["import-hook"] and decision == "refuse"
    assert "vllm-ascend is not installed" in reason


def test_activation_failure_inside_the_hook_does_not_break_the_import(bare_site, tmp_path):
    py, site = bare_site
    (site / "gptoss_patch" / "_activation.py").write_text("raise ImportError('activation module broken')\n")
    fake = tmp_path / "src" / "vllm_ascend"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("VALUE = 7\n")
    proc = subprocess.run([str(py), "-c", "import vllm_ascend; print(vllm_ascend.VALUE)"], capture_output=True,
                          text=True, env=clean_env(PYTHONPATH=str(tmp_path / "src")), timeout=60)
    assert proc.returncode == 0 and proc.stdout == "7\n"
    assert len(proc.stderr.splitlines()) == 1 and "activation module broken" in proc.stderr


# --- start-up deadlock (issue 17): the first `import vllm_ascend` racing the first activate()/status() --------------

_RACE = """
import json, sys, threading
{preamble}
import gptoss_patch
barrier = threading.Barrier(3)
errors = []
def run(fn):
    def target():
        barrier.wait()
        try:
            fn()
        except BaseException as exc:
            errors.append(repr(exc))
    return threading.Thread(target=target, daemon=True)
def importer():
    import vllm_ascend
threads = [run(importer), run(lambda: gptoss_patch.activate(source="thread")), run(gptoss_patch.status)]
for t in threads:
    t.start()
for t in threads:
    t.join()
s = gptoss_patch.status()
print(json.dumps([s.activated, sorted(s.sources), s.decision, errors]))
"""


def _fake_stack(tmp_path, version="0.11.0"):
    """A real vllm_ascend package dir plus vllm / vllm-ascend dist-info METADATA (as pip writes it), on PYTHONPATH."""
    src = tmp_path / "src"
    (src / "vllm_ascend").mkdir(parents=True)
    (src / "vllm_ascend" / "__init__.py").write_text("import gptoss_patch\nACTIVE = gptoss_patch.status().activated\n")
    for name in ("vllm", "vllm-ascend"):
        info = src / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return _deps_path(tmp_path)


@pytest.mark.parametrize("preamble", ["", "import gptoss_patch._activation"],
                         ids=["activation-module-not-imported", "activation-module-imported"])
def test_first_import_racing_first_activate_never_hangs(bare_site, tmp_path, preamble):
    """20 fresh interpreters, each: one thread imports vllm_ascend (the .pth finder activates), one calls
    gptoss_patch.activate(), one status(), released together. Before the fix every round hung: the finder ran
    activate() inside importlib's find_spec (under the global import lock) while the other thread, importing
    gptoss_patch._activation (or, with it imported, holding our lock and importing lazily), waited for that lock."""
    py, _ = bare_site
    path = _fake_stack(tmp_path)
    code = _RACE.format(preamble=preamble)
    for round_ in range(20):
        try:
            proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=30,
                                  env=clean_env(PYTHONPATH=path))
        except subprocess.TimeoutExpired:
            pytest.fail(f"round {round_}: deadlock - the interpreter hung for 30 s")
        assert proc.returncode == 0, proc.stderr
        activated, sources, decision, errors = json.loads(proc.stdout)
        assert activated and sources == ["import-hook", "thread"] and decision == "apply" and errors == [], proc.stdout


def test_activation_imports_nothing_while_holding_its_lock(bare_site, tmp_path):
    """Deterministic form of the rule behind the race above: a meta-path finder placed first records every import
    (importlib asks finders under its global lock) made while gptoss_patch._activation._lock is held."""
    py, _ = bare_site
    path = _fake_stack(tmp_path, version="0.11.0rc1")  # an untested row: the structural check runs as well
    code = """
import json, sys
class Recorder:
    seen = []
    def find_spec(self, name, path=None, target=None):
        act = sys.modules.get("gptoss_patch._activation")
        lock = getattr(act, "_lock", None)
        if lock is not None and lock._is_owned():
            self.seen.append(name)
        return None
sys.meta_path.insert(0, Recorder())
import gptoss_patch
gptoss_patch.status()
gptoss_patch.activate(source="test")
import vllm_ascend
gptoss_patch.status()
print(json.dumps([Recorder.seen, vllm_ascend.ACTIVE, gptoss_patch.status().decision]))
"""
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60,
                          env=clean_env(PYTHONPATH=path))
    assert proc.returncode == 0, proc.stderr
    seen, active, decision = json.loads(proc.stdout)
    assert seen == [] and active and decision in ("apply", "refuse"), proc.stdout


def test_vllm_ascend_keeps_its_own_loader_and_activates_before_its_code_runs(bare_site, tmp_path):
    py, _ = bare_site
    path = _fake_stack(tmp_path)
    code = ("import json, vllm_ascend, importlib.util; "
            "print(json.dumps([vllm_ascend.ACTIVE, type(vllm_ascend.__loader__).__name__, "
            "type(vllm_ascend.__spec__.loader).__name__]))")
    proc = run(py, code, PYTHONPATH=path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, "SourceFileLoader", "SourceFileLoader"]


@pytest.mark.parametrize("name", ["GPTOSS_PATCH_FORCE", "GPTOSS_PATCH_DISABLE"])
def test_a_malformed_setting_is_named_as_the_users_setting_once_and_start_up_goes_on(bare_site, name):
    """A malformed value is the user's setting, not a broken hook: one line naming the variable and the value (a venv
    runs the .pth line twice), the interpreter runs on, and GPT-OSS is refused until it is fixed."""
    py, _ = bare_site
    proc = run(py, "print(1)", **{name: "maybe"})
    assert proc.returncode == 0 and proc.stdout == "1\n"
    assert proc.stderr.splitlines() == [
        f"gptoss-patch: a setting is malformed: {name}='maybe' is not a boolean; use 1 or 0; "
        "GPT-OSS models will be refused on vllm-ascend until this is fixed."]
