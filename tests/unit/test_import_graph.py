"""No import circles inside ``gptoss_patch`` or ``gptoss_patch_testkit``, and the product never imports the testkit.

The graph is read statically (``ast``) from the package's source files, nothing is imported. Two graphs are checked:

* **module level**: the imports a module runs when it is imported (top-level statements, including those inside a
  top-level ``if`` / ``try`` / class body); importing ``a.b.c`` counts as importing ``a`` and ``a.b`` too. A cycle here
  is a real circle: which half is initialised first depends on who imports first. None is allowed. (A module's own
  ancestor packages are not an edge unless it takes a name from them: they are always initialised before it, and a
  package ``__init__`` importing its submodules is normal.)
* **all imports**: the module-level ones plus those inside functions and methods (deferred imports), and the calls
  that import a constant module name (``importlib.import_module("gptoss_patch.x")``, ``__import__``, ``find_spec``,
  ``pkgutil.resolve_name``, ``runpy.run_module``; positional or ``name=``). A cycle here is
  a layering defect (a lower layer reaching back up), even if it cannot fail at import time. None is allowed, in
  either package, except through the entry points that only forward to the layer below (the package ``__init__`` and
  ``plugin``, which lazily import ``_activation``).
* **product -> testkit**: no module of ``gptoss_patch`` names ``gptoss_patch_testkit`` in an import statement or an
  ``importlib.import_module`` / ``__import__`` call, at module level or deferred: the simulator and the test jobs are
  another distribution that a production server never has.

``TYPE_CHECKING`` blocks are ignored (they never run).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "gptoss_patch"
TESTKIT = Path(__file__).resolve().parents[2] / "testkit" / "gptoss_patch_testkit"
#: Callers at the top of the stack: they may import anything lazily, and nothing below may import them.
ENTRY = {"gptoss_patch", "gptoss_patch.plugin"}


def module_name(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, current: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, modules: set[str], root: Path = PKG) -> tuple[set[str], set[str], set[str]]:
    """``(module-level, deferred, named)`` imports of package modules by the module in ``path``: ``named`` are the
    modules an import statement names or takes a name from (``from a.b import f`` names ``a.b``, not ``a``)."""
    name = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top: set[str] = set()
    deferred: set[str] = set()
    named: set[str] = set()
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}

    def targets(node) -> set[str]:
        out = set()
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        else:
            base = _resolve(node, name, is_pkg)
            out.add(base)
            subs = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
            out |= subs  # ``from pkg import submodule``
            if len(subs) == len(node.names):
                named.update(subs)
            else:
                named.update(subs | {base})
        if isinstance(node, ast.Import):
            named.update(out)
            here = set(out)
        else:
            here = subs if len(subs) == len(node.names) else subs | {base}
        found = set()
        for target in out:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c imports a and a.b first
                prefix = ".".join(parts[:i])
                # ... except this module's own ancestors, always initialised before it - unless a name is taken
                # from one of them (``from gptoss_patch.patches import layout_plan`` in a patch module)
                if prefix in modules and (prefix not in ancestors or prefix in here):
                    found.add(prefix)
        found.discard(name)
        return found

    def walk(node, level: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    walk(ast.Module(body=[sub], type_ignores=[]), level)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (top if level else deferred).update(targets(child))
            elif isinstance(child, ast.Call) and import_call_target(child):  # importlib.import_module("a.b") ...
                target = import_call_target(child)
                parts = target.split(".")
                edges = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules - {name}
                (top if level else deferred).update(edges)
                named.update(edges & {target})
                walk(child, level)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(child, False)
            else:
                walk(child, level)  # if/try/with/class bodies run at import time when the parent does

    walk(tree, True)
    named.discard(name)
    return top, deferred - top, {n for n in named if n in modules}


def graphs(root: Path = PKG) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    level, every, named = {}, {}, {}
    for p in paths:
        top, deferred, names = imports(p, modules, root)
        level[module_name(p, root)] = top
        every[module_name(p, root)] = top | deferred
        named[module_name(p, root)] = names
    return level, every, named


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_no_module_level_cycle():
    level, _, _ = graphs()
    assert len(level) > 40 and "gptoss_patch._activation" in level
    assert cycles(level) == []


def test_no_module_level_cycle_in_the_testkit():
    level, _, _ = graphs(TESTKIT)
    assert len(level) > 20 and "gptoss_patch_testkit.npu_sim.graph" in level
    assert cycles(level) == []


def test_no_cycle_through_deferred_imports_below_the_entry_points():
    _, every, _ = graphs()
    product = {m: {d for d in deps if d not in ENTRY} for m, deps in every.items() if m not in ENTRY}
    assert cycles(product) == []


def test_no_cycle_through_deferred_imports_in_the_testkit():
    """The simulator's compatibility shims no longer write into a harness that imports the simulator back (the one
    circle before the house step: ``npu_sim.torch_compat`` <-> ``testing.vllm_setup``)."""
    _, every, _ = graphs(TESTKIT)
    assert cycles(every) == []


#: Calls that import (or locate for import) the module their first argument (or ``name=``) names.
IMPORT_CALLS = ("import_module", "__import__", "find_spec", "resolve_name", "run_module")
#: A string that names the testkit as code would use it: a module path, or an import statement (for ``exec``).
_TESTKIT_NAME = re.compile(r"^gptoss_patch_testkit(\.\w+)*(:\w+)?$|\b(import|from)\s+gptoss_patch_testkit\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """``id()`` of the docstring constants of ``tree`` (module, classes, functions): prose, not names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _testkit_references(path: Path) -> list[str]:
    """``file:line name`` of every place in ``path`` that names ``gptoss_patch_testkit`` for code: an import statement,
    an import call (:data:`IMPORT_CALLS`, positional or ``name=``), or any other string that is a testkit module path
    or an import statement (a module constant handed to ``import_module`` later, a string for ``exec``). Prose that
    mentions the testkit (docstrings, messages with other words around the name) is not a reference. Not seen: a name
    assembled at run time from pieces (``"gptoss_patch_" + "testkit"``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose \
                and _TESTKIT_NAME.search(node.value.strip()):
            names = ["gptoss_patch_testkit"]
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "gptoss_patch_testkit"]
    return found


def import_call_target(node: ast.Call) -> str | None:
    """The constant module name an import call (:data:`IMPORT_CALLS`) is given, positional or ``name=``; else None."""
    fn = node.func
    called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
    if called not in IMPORT_CALLS:
        return None
    args = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "name"]
    for a in args:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            return a.value.split(":")[0]
    return None


#: What the wheel installs besides the package, and what a user copies from this repository: scanned too.
PRODUCT_FILES = [PKG.parent / "_gptoss_patch_hook.py", PKG.parent / "_gptoss_patch_hook_loader.py",
                 *sorted((PKG.parent / "sitecustomize").rglob("*.py"))]


def test_the_product_never_imports_the_testkit_not_even_lazily():
    files = [*sorted(PKG.rglob("*.py")), *PRODUCT_FILES]
    assert all(f.is_file() for f in PRODUCT_FILES) and len(PRODUCT_FILES) >= 3
    every = [ref for p in files for ref in _testkit_references(p)]
    assert every == []


@pytest.mark.parametrize("code", [
    "import gptoss_patch_testkit",
    "def f():\n    from gptoss_patch_testkit.npu_sim import placement",
    "import importlib\ndef f():\n    importlib.import_module('gptoss_patch_testkit.npu_sim')",
    "import importlib\ndef f():\n    importlib.import_module(name='gptoss_patch_testkit')",
    "import importlib.util\nimportlib.util.find_spec('gptoss_patch_testkit')",
    "_TK = 'gptoss_patch_testkit'\ndef f():\n    import importlib; importlib.import_module(_TK)",
    "def f():\n    exec('import gptoss_patch_testkit')",
    "import pkgutil\npkgutil.resolve_name('gptoss_patch_testkit.verify:main')",
    "import runpy\nrunpy.run_module('gptoss_patch_testkit.verify')",
])
def test_the_testkit_scan_sees_each_form(tmp_path, code):
    probe = tmp_path / "probe.py"
    probe.write_text(code + "\n", encoding="utf-8")
    assert _testkit_references(probe), code


def test_the_testkit_scan_lets_prose_mention_it(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""Uses gptoss_patch_testkit.npu_sim."""\n'
                     'MSG = "install gptoss-patch-testkit, then run python -m gptoss_patch_testkit.verify --selftest"\n',
                     encoding="utf-8")
    assert _testkit_references(probe) == []


def test_the_testkit_sits_above_the_product():
    """The testkit imports the product (config parsers, the self-test harnesses it drives); nothing else links
    them. Every testkit module that imports ``gptoss_patch`` names modules that exist there."""
    modules = {module_name(p) for p in PKG.rglob("*.py")}
    missing = []
    for p in sorted(TESTKIT.rglob("*.py")):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("gptoss_patch."):
                if node.module not in modules:
                    missing.append(f"{p.name}:{node.lineno} {node.module}")
    assert missing == []


def test_nothing_below_imports_the_entry_points():
    """The patches, the registry and the rest never reach back up to ``gptoss_patch.activate()`` / ``status()``; the
    tools at the top (``verify``, the self-test's harnesses) may, and so may the start-up hook."""
    _, _, named = graphs()
    up = {m: sorted(deps & ENTRY) for m, deps in named.items()
          if deps & ENTRY and m not in ENTRY and m not in ("gptoss_patch._bootstrap", "gptoss_patch.verify")
          and not m.startswith("gptoss_patch.selftest.")}  # the self-test is a tool at the top, like verify
    assert up == {}


def test_the_runtime_patch_never_imports_the_tools_or_the_self_test():
    """What every vLLM process runs (activation, matrix, registry, patches, kernels) reaches neither the operations
    kit (``gptoss_patch.tools``: console tools around ``vllm serve``) nor the self-test's harnesses
    (``gptoss_patch.selftest``), even lazily: the guard reads checkpoint headers through
    ``gptoss_patch.checkpoints``, not through the operations kit. No exemption: the start-up hook has no simulator
    branch any more (the testkit's own ``.pth`` serves the simulator)."""
    _, every, _ = graphs()
    runtime = ["gptoss_patch._activation", "gptoss_patch.plugin", "gptoss_patch._bootstrap"]
    seen, todo = set(), list(runtime)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += sorted(every.get(m, ()))
    assert "gptoss_patch.patches.guard" in seen and "gptoss_patch.checkpoints" in seen
    assert sorted(m for m in seen if m.startswith(("gptoss_patch.tools", "gptoss_patch.selftest"))) == []


@pytest.mark.parametrize("files, expected", [
    ({"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"}, [["pkg.a", "pkg.b"]]),
    ({"a.py": "from . import b\n", "b.py": "def f():\n    from . import a\n"}, []),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n", "b.py": "import pkg.a\n"},
     []),
    ({"a.py": "try:\n    from pkg.b import x\nexcept ImportError:\n    pass\n", "b.py": "from pkg import a\n"},
     [["pkg.a", "pkg.b"]]),
    ({"sub/__init__.py": "from pkg import a\n", "sub/c.py": "", "a.py": "from pkg.sub import c\n"},
     [["pkg.a", "pkg.sub"]]),
    ({"sub/__init__.py": "def f():\n    from pkg.sub import c\n", "sub/c.py": "from pkg.sub.d import x\n",
      "sub/d.py": ""}, []),
    ({"sub/__init__.py": "from pkg.sub import c\ny = 1\n", "sub/c.py": "from pkg.sub import y\n"},
     [["pkg.sub", "pkg.sub.c"]]),
])
def test_the_walker_itself(tmp_path, files, expected):
    """Module-level cycles are found (relative, try-wrapped, through a parent package); deferred and
    TYPE_CHECKING imports are not module-level."""
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    level, every, _ = graphs(root)
    assert cycles(level) == expected
    if "def f" in files.get("b.py", ""):
        assert cycles(every) == [["pkg.a", "pkg.b"]]
