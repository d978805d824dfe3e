"""gptoss_patch.config: one parser per kind, every GPTOSS_PATCH_* variable declared once, the README's table true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gptoss_patch import config
from gptoss_patch_testkit import config as testkit_config

ROOT = Path(__file__).resolve().parents[2]


def readme_rows() -> dict[str, str]:
    """``{variable: value shown}`` of the README's environment table (``GPTOSS_PATCH_X=1`` -> ``{X: "1"}``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(GPTOSS_PATCH_[A-Z_]+)(?:=([^`]*))?` \|", text, re.M)
    return {name: value.replace("\\|", "|") for name, value in rows}


def test_readme_table_is_the_user_facing_variables():
    rows = readme_rows()
    assert set(rows) == {v.name for v in config.VARIABLES.values() if v.readme}
    assert len(rows) == 5
    # the testkit's variables (simulator, caches) are not a user's: testkit/README.md lists them
    assert not set(rows) & {v.name for v in testkit_config.TESTKIT_VARIABLES}


def test_the_testkit_readme_lists_its_variables():
    text = (ROOT / "testkit" / "README.md").read_text(encoding="utf-8")
    assert {v.name for v in testkit_config.TESTKIT_VARIABLES} <= set(re.findall(r"`(GPTOSS_PATCH_[A-Z_]+)", text))


def _testkit_readme_rows() -> dict[str, str]:
    """``{variable: value shown}`` of testkit/README.md's variable table (rows that show a value)."""
    text = (ROOT / "testkit" / "README.md").read_text(encoding="utf-8")
    return {n: v.replace("\\|", "|") for n, v in re.findall(r"^\| `(GPTOSS_PATCH_[A-Z_]+)=([^`]*)` \|", text, re.M)}


@pytest.mark.parametrize("name", [testkit_config.SIMULATE_NPU, testkit_config.SIM_SOC_VERSION,
                                  testkit_config.SIM_NPU_MEMORY, testkit_config.SIM_FAULT,
                                  testkit_config.SIM_UNINITIALISED])
def test_testkit_readme_value_is_accepted(name):
    """What testkit/README.md shows for a simulator variable parses as that variable (the product README's rule,
    carried over when the variables moved to the testkit)."""
    shown = _testkit_readme_rows()[name]
    var = config.VARIABLES[name]
    env = {name: shown}
    if var.kind == "bool":
        assert shown == "1" and testkit_config.simulate_npu(env) is True
    elif var.kind == "soc":
        assert testkit_config.soc_version(env) == int(shown)
    elif var.kind == "bytes":
        assert config.size_bytes(name, env) == 8 << 30
    elif var.kind == "names":
        assert config.names(name, env) == frozenset(shown.split(",")) == frozenset(var.choices)
    else:
        assert var.kind == "choice" and tuple(shown.split("|")) == var.choices


@pytest.mark.parametrize("name", [v.name for v in config.VARIABLES.values() if v.readme])
def test_readme_value_is_accepted(name):
    """What the README shows for a variable parses, and a choice variable shows exactly its choices."""
    shown = readme_rows()[name]
    var = config.VARIABLES[name]
    if var.kind == "bool":
        assert shown == "1" and config.flag(name, {name: shown}) is True
    elif var.kind == "choice":
        assert tuple(shown.split("|")) == var.choices
        assert [config.choice(name, {name: c}) for c in var.choices] == list(var.choices)
    else:
        raise AssertionError(f"{name}: a {var.kind} variable in the README table")


@pytest.mark.parametrize("raw, expected", [("1", True), (" TRUE ", True), ("yes", True), ("on", True), ("", False),
                                           ("0", False), ("off", False), ("No", False)])
def test_flag(raw, expected):
    assert config.flag(config.DISABLE, {config.DISABLE: raw}) is expected
    assert config.flag(config.DISABLE, {}) is False


def test_malformed_values_name_the_variable():
    with pytest.raises(ValueError, match=r"GPTOSS_PATCH_FORCE='maybe' is not a boolean"):
        config.flag(config.FORCE, {config.FORCE: "maybe"})
    with pytest.raises(ValueError, match=r"GPTOSS_PATCH_MOE_PAD='sometimes' is not one of auto, always, never"):
        config.choice(config.MOE_PAD, {config.MOE_PAD: "sometimes"})
    with pytest.raises(ValueError, match=r"GPTOSS_PATCH_SIM_SOC_VERSION='210'"):
        testkit_config.soc_version({testkit_config.SIM_SOC_VERSION: "210"})
    with pytest.raises(KeyError):
        config.flag("GPTOSS_PATCH_NOT_A_THING", {})


def test_defaults():
    assert config.choice(config.MOE_PAD, {}) == "auto" and config.choice(config.MOE_PAD, {config.MOE_PAD: "ALWAYS"}) \
        == "always"
    assert config.choice(config.ATTENTION_PATH, {}) is None
    assert testkit_config.soc_version({}) is None
    assert testkit_config.soc_version({testkit_config.SIM_SOC_VERSION: "225"}) == 225
    assert config.path(config.CACHE_DIR, "/d", {}) == "/d" and config.path(config.CACHE_DIR, "/d",
                                                                             {config.CACHE_DIR: "/x"}) == "/x"
    assert testkit_config.simulate_npu({testkit_config.SIMULATE_NPU: "bogus"}) is False


def _environ_reads(path: Path) -> list[str]:
    """``GPTOSS_PATCH_*`` names read from ``os.environ`` (``.get(...)``, ``[...]`` loads, ``getenv``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "getenv", "pop") and "environ" in ast.unparse(node.func.value) + \
                node.func.attr:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and "environ" in ast.unparse(node.value):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("GPTOSS_PATCH_"):
            found.append(key.value)
    return found


def test_only_config_reads_the_variables():
    """Every other module asks gptoss_patch.config (writes, e.g. setting the simulator switch for children, are
    fine); the noxfile runs without the package and reads its cache directory itself (declared in VARIABLES)."""
    readers = {str(p.relative_to(ROOT)): _environ_reads(p) for p in sorted((ROOT / "gptoss_patch").rglob("*.py"))}
    readers = {p: names for p, names in readers.items() if names}
    assert readers == {"gptoss_patch/selftest/attention.py": ["GPTOSS_PATCH_ATTENTION_PATH"] * 3}, readers
    testkit = {str(p.relative_to(ROOT)): _environ_reads(p) for p in sorted((ROOT / "testkit").rglob("*.py"))}
    # the start-up finder is standard-library only: it reads the simulator switch itself (same spellings)
    assert {p: n for p, n in testkit.items() if n} == {
        "testkit/_gptoss_patch_testkit_startup.py": ["GPTOSS_PATCH_SIMULATE_NPU"]}


def test_every_variable_the_code_names_is_declared():
    names = set()
    for p in [*(ROOT / "gptoss_patch").rglob("*.py"), *(ROOT / "testkit").rglob("*.py"), ROOT / "noxfile.py",
              *(ROOT / "scripts").glob("*.py")]:
        names |= set(re.findall(r"GPTOSS_PATCH_[A-Z_]*[A-Z]", p.read_text(encoding="utf-8")))
    assert names - set(config.VARIABLES) == set()


def test_the_reader_scan_itself(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('import os\na = os.environ.get("GPTOSS_PATCH_X", "")\nb = os.environ["GPTOSS_PATCH_Y"]\n'
                 'os.environ["GPTOSS_PATCH_Z"] = "1"\nc = dict(os.environ, GPTOSS_PATCH_W="1")\n', encoding="utf-8")
    assert _environ_reads(f) == ["GPTOSS_PATCH_X", "GPTOSS_PATCH_Y"]
