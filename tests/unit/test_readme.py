"""The README shows the version matrix from the same data the runtime decision uses (issue 8)."""

from pathlib import Path

from gptoss_patch import matrix

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_matrix_is_the_decision_table():
    text = README.read_text(encoding="utf-8")
    assert matrix.markdown() in text, "README's version matrix is stale: paste `gptoss_patch.matrix.markdown()`"


def test_readme_has_exactly_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert text.count("python3 -m pip install -q nox uv && python3 -m nox -s ") == 2
