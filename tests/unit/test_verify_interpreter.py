"""``verify`` says when the ``vllm`` on PATH runs another interpreter than the one verify runs in."""

import os
import sys

from gptoss_patch.verify import serving_interpreter


def _script(directory, shebang):
    path = directory / "vllm"
    path.write_text(f"#!{shebang}\nimport sys\n")
    path.chmod(0o755)
    return path


def test_a_vllm_script_of_another_interpreter_is_named(tmp_path):
    other = "/opt/other-env/bin/python3.11"
    script = _script(tmp_path, other)
    out = serving_interpreter(path=str(tmp_path))
    assert out["script"] == str(script) and out["python"] == other
    assert out["other"] and other in out["other"] and sys.executable in out["other"]
    assert f"{other} -m gptoss_patch.verify" in out["other"]


def test_a_vllm_script_of_this_interpreter_is_fine(tmp_path):
    _script(tmp_path, sys.executable)
    assert serving_interpreter(path=str(tmp_path))["other"] is None
    _script(tmp_path, os.path.join(sys.prefix, "bin", "python"))
    assert serving_interpreter(path=str(tmp_path))["other"] is None


def test_no_vllm_on_path(tmp_path):
    assert serving_interpreter(path=str(tmp_path)) == {"script": None, "python": None, "other": None}
