"""Every path the code, the docs and the README cite exists in the repository, and nothing outside it is cited.

Checked in every tracked ``.py`` / ``.md`` / ``.toml`` file:

* a repository path (``docs/…``, ``scripts/…``, ``gptoss_patch/…``, ``tests/…``) names a tracked file or directory;
* a section of a docs page (``docs/upstream.md §4.3``) is one of that page's numbered headings;
* no file cites the notes that live outside the repository (the shared reference folder or its three notes).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Paths the repository may cite; ``<placeholder>`` parts and globs end the path (the rest is checked as a directory).
PATH = re.compile(r"(?<![\w/.~-])((?:docs|scripts|gptoss_patch|tests)/[\w./-]*[\w/])")
#: ``docs/page.md`` followed by sections: ``§4.3``, ``§4.3, §6``, ``§3-§4``.
SECTION = re.compile(r"docs/(\w[\w-]*\.md)`{0,2}((?:(?:,|, | |-|–)§ ?\d+(?:\.\d+)?)+)")
#: Names built from parts, so that this file does not cite them itself.
#: Paths inside *upstream* repositories that the text names together with their repository (vllm-ascend's
#: ``docs/source/…`` and ``tests/e2e/…``, op-plugin's ``docs/context/…``): not ours to check.
UPSTREAM = ("docs/source/", "docs/context/", "tests/e2e/")
FORBIDDEN = ["shared" + "/reference", "upstream_" + "targets.md", "npu_" + "ops.md", "simulator_" + "notes.md",
             "DEVELOPERS" + ".md"]


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "noxfile.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    me = Path(__file__).resolve()  # its examples of wrong citations are checked by test_the_check_itself
    return [ROOT / p for p in sorted(set(out)) if (ROOT / p).is_file() and (ROOT / p).resolve() != me]


def _headings(page: Path) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", page.read_text(encoding="utf-8"), re.M)}


def cited_problems(files: list[Path], root: Path = ROOT) -> list[str]:
    """``file:line: problem`` for every missing path, missing docs section or forbidden citation in ``files``."""
    problems = []
    for path in files:
        rel = path.relative_to(root)
        for no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name in FORBIDDEN:
                if name in line:
                    problems.append(f"{rel}:{no}: cites {name}, which is not in the repository")
            for m in PATH.finditer(line):
                cited = m.group(1).rstrip("./")
                if cited.startswith(UPSTREAM):
                    continue
                glob = line[m.end():m.end() + 1] == "*"
                if not (any(root.glob(cited + "*")) if glob else (root / cited).exists()):
                    problems.append(f"{rel}:{no}: cites {cited}, which does not exist")
            for m in SECTION.finditer(line):
                page = root / "docs" / m.group(1)
                if not page.is_file():
                    continue  # reported above
                have = _headings(page)
                for sec in re.findall(r"§ ?(\d+(?:\.\d+)?)", m.group(2)):
                    if sec not in have:
                        problems.append(f"{rel}:{no}: cites docs/{m.group(1)} §{sec}, which has no such section")
    return problems


def test_every_cited_path_and_section_exists():
    files = _tracked()
    assert len(files) > 50 and ROOT / "README.md" in files and ROOT / "docs" / "upstream.md" in files
    assert cited_problems(files) == []


def test_docs_are_tracked():
    files = {p.relative_to(ROOT).as_posix() for p in _tracked()}
    for page in ("docs/README.md", "docs/upstream.md", "docs/operators.md", "docs/simulator.md",
                 "docs/adding-a-release.md", "docs/version-matrix.md", "docs/patches.md", "docs/operations.md",
                 "docs/contributing.md", "docs/architecture.md", "testkit/README.md"):
        assert page in files


@pytest.mark.parametrize("text, expected", [
    ("see ``docs/upstream.md`` §4.3, §99", ["x.py:1: cites docs/upstream.md §99, which has no such section"]),
    ("see docs/nowhere.md", ["x.py:1: cites docs/nowhere.md, which does not exist"]),
    ("run scripts/bench_startup.py, then gptoss_patch/gone.py.", ["x.py:1: cites gptoss_patch/gone.py, which does not exist"]),
    ("notes in " + FORBIDDEN[0] + "/x", [f"x.py:1: cites {FORBIDDEN[0]}, which is not in the repository"]),
    ("(" + FORBIDDEN[2] + " §2.4)", [f"x.py:1: cites {FORBIDDEN[2]}, which is not in the repository"]),
    ("docs/operators.md §3.4 and docs/simulator.md §2.1 and tests/unit/ and scripts/bench_*", []),
    ("scripts/serve_* recipes", ["x.py:1: cites scripts/serve_, which does not exist"]),
    ("vllm_ascend/ops/fused_moe/moe_mlp.py is upstream's, not ours", []),
])
def test_the_check_itself(tmp_path, text, expected):
    """The checker finds what it must (and only that) in a small fake repository."""
    (tmp_path / "docs").mkdir()
    for page in ("upstream.md", "operators.md", "simulator.md"):
        (tmp_path / "docs" / page).write_text((ROOT / "docs" / page).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_startup.py").write_text("", encoding="utf-8")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "gptoss_patch").mkdir()
    f = tmp_path / "x.py"
    f.write_text(text + "\n", encoding="utf-8")
    assert cited_problems([f], root=tmp_path) == expected


def test_architecture_page_has_one_line_per_module():
    """Every module of both distributions has its own row in docs/architecture.md's module table, and every row
    names a real path."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = text[text.index("## Modules"):]
    rows = re.findall(r"^\| `([^`]+)` \|", layout, re.M)
    for top in ("gptoss_patch", "testkit"):
        modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*.py"))
        assert sorted(r for r in rows if r.startswith(f"{top}/") and r.endswith(".py")) == modules
    assert len(rows) == len(set(rows)) and all((ROOT / r).exists() for r in rows)
