"""What a pip user gets (issue 19): in a fresh venv holding only the built wheel (and its two dependencies, wrapt and
packaging; no torch, no vLLM), every command the README gives a user runs - ``--help`` at least - and every console
script of the wheel is one the README shows.

The wheel is built from this checkout by ``uv pip install`` (hatchling, as ``noxfile.overlay_venv`` builds it);
``GPTOSS_UV`` names the uv binary (the unit session sets it).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"


def readme_commands(text: str) -> list[list[str]]:
    """The commands the README gives a user: lines of its code blocks and inline code spans that start with a console
    script of the wheel (``gptoss-patch-*``) or ``python -m gptoss_patch...``, cut to the part that names the tool
    (the script, then a subcommand or preset word; for ``python -m`` the module), as argv lists, in order, unique."""
    spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [line for block in spans for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    out: list[list[str]] = []
    for line in lines:
        line = line.split("#")[0].strip()
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if words[:2] == ["python", "-m"] and len(words) > 2 and re.fullmatch(r"gptoss_patch[a-z_.]*", words[2]):
            cmd = words[:3]
        elif words and re.fullmatch(r"gptoss-patch-[a-z]+", words[0]):
            cmd = words[:1]
            if len(words) > 1 and re.fullmatch(r"[a-z0-9][a-z0-9-]*", words[1]):  # subcommand or preset
                cmd.append(words[1])
        else:
            continue
        if cmd not in out:
            out.append(cmd)
    return out


def test_the_parser_finds_the_user_commands():
    cmds = readme_commands("```bash\ngptoss-patch-serve 120b-tp8 --model DIR  # x\n"
                           "gptoss-patch-probe http://h:1\n```\nand `python -m gptoss_patch.verify --model D`, "
                           "`pip install x`, `gptoss-patch-tokenizer prepare /d`, `gptoss-patch-*`")
    assert cmds == [["gptoss-patch-serve", "120b-tp8"], ["gptoss-patch-probe"],
                    ["python", "-m", "gptoss_patch.verify"], ["gptoss-patch-tokenizer", "prepare"]]


def _uv_and_env() -> tuple[str, dict]:
    """The uv binary the nox sessions use (``GPTOSS_UV``) and its environment (local indexes, cache)."""
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    try:
        return noxfile._uv(), noxfile.uv_env()
    except SystemExit:
        pytest.fail("no uv binary: run through `nox -s unit` (it sets GPTOSS_UV) or pip install uv")


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    uv, env = _uv_and_env()
    venv = tmp_path_factory.mktemp("wheel-only") / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(ROOT)], check=True,
                   env=env)
    return venv


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPTOSS_PATCH_", "VIRTUAL_ENV"))
           and k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_venv_holds_the_wheel_only(wheel_venv):
    py = wheel_venv / "bin" / "python"
    listed = subprocess.run([str(py), "-c", "import importlib.metadata as m; "
                             "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"],
                            capture_output=True, text=True, env=_env(wheel_venv), check=True).stdout
    assert eval(listed) == ["gptoss-patch", "packaging", "wrapt"], listed  # noqa: S307 - our own printed list
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True, env=_env(wheel_venv))
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr


def test_the_runtime_wheel_holds_no_simulator_no_test_job_and_no_downloader(wheel_venv):
    """The house step (issue 28): the wheel a production server installs is the runtime, the self-test and the
    operations kit only; the simulator, the test jobs and the release downloader are gptoss-patch-testkit's."""
    py = wheel_venv / "bin" / "python"
    code = ("import importlib.metadata as m; d = m.distribution('gptoss-patch'); "
            "print('\\n'.join(str(f) for f in d.files))")
    files = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=_env(wheel_venv),
                           check=True).stdout.split()
    assert "gptoss_patch/selftest/device.py" in files and "gptoss_patch.pth" in files
    shipped = [f for f in files if f.endswith((".py", ".pth"))]
    assert [f for f in shipped if "npu_sim" in f or "testkit" in f or "testing" in f
            or f.rsplit("/", 1)[-1] in ("serve_job.py", "main_job.py", "runner.py", "lifecycle.py",
                                        "release_source.py", "mxfp4_case.py")] == []
    probe = subprocess.run([str(py), "-c", "import gptoss_patch_testkit"], capture_output=True, text=True,
                           env=_env(wheel_venv))
    assert probe.returncode != 0 and "No module named 'gptoss_patch_testkit'" in probe.stderr


def test_every_console_script_is_in_the_readme():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    shown = {cmd[0] for cmd in readme_commands(README.read_text(encoding="utf-8"))}
    assert len(scripts) >= 7 and sorted(set(scripts) - shown) == []


def test_every_readme_command_runs_from_the_wheel(wheel_venv):
    cmds = readme_commands(README.read_text(encoding="utf-8"))
    assert ["gptoss-patch-serve", "120b-tp8"] in cmds and ["python", "-m", "gptoss_patch.verify"] in cmds
    print("README commands run with --help:", *(" ".join(c) for c in cmds), sep="\n  ")
    failures = []
    for cmd in cmds:
        argv = [str(wheel_venv / "bin" / "python"), *cmd[1:]] if cmd[0] == "python" else \
            [str(wheel_venv / "bin" / cmd[0]), *cmd[1:]]
        proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=_env(wheel_venv), timeout=120,
                              cwd=wheel_venv)
        # the usage line repeats what the user typed (``python -m gptoss_patch.x`` or the console script)
        typed = "python -m " + cmd[2] if cmd[0] == "python" else cmd[0]
        if proc.returncode != 0 or not proc.stdout.startswith(f"usage: {typed}"):
            failures.append(f"{' '.join(cmd)} --help: exit {proc.returncode}: {(proc.stderr or proc.stdout)[:400]}")
    assert failures == []


def test_the_runners_name_the_missing_tool_instead_of_a_traceback(wheel_venv, tmp_path):
    """Without lm-eval / evalscope (the wheel does not pull them in) a real run stops with the pip command (exit 2)."""
    gsm8k = ROOT / "tests" / "data" / "gsm8k" / "test.jsonl"
    runs = {"lm-eval[api]": ["gptoss-patch-eval", "--server", "http://127.0.0.1:9", "--model", "m", "--gsm8k",
                             str(gsm8k), "--limit", "1", "--workdir", str(tmp_path / "eval")],
            "evalscope[perf]": ["gptoss-patch-bench", "--server", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
                                str(tmp_path), "--output-dir", str(tmp_path / "bench")]}
    for extra, argv in runs.items():
        proc = subprocess.run([str(wheel_venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                              env=_env(wheel_venv), timeout=120, cwd=tmp_path)
        assert proc.returncode == 2 and f'pip install "{extra}"' in proc.stderr, (argv[0], proc.stderr[-600:])
        assert "Traceback" not in proc.stderr


def test_the_bug_report_is_written_without_torch(wheel_venv, tmp_path):
    """``verify --report FILE`` on a host with the wheel only: the self-test cannot run (no torch) and says so as a
    problem; the report file is still written (the bug-report path must not die on what it reports)."""
    report = tmp_path / "report.md"
    proc = subprocess.run([str(wheel_venv / "bin" / "gptoss-patch-verify"), "--report", str(report), "--no-children"],
                          capture_output=True, text=True, env=_env(wheel_venv), timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "self-test not run: No module named 'torch'" in proc.stdout
    assert report.is_file() and "self-test not run" in report.read_text()


def test_the_checkpoint_report_needs_no_torch(wheel_venv, tmp_path):
    """``gptoss-patch-checkpoint`` reads headers through safetensors (numpy framework): on a host with the wheel,
    safetensors and numpy but no torch it reports the split and the padding question."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", preset="tiny", seed=0, tokenizer=False)  # written here, with torch
    ops = tmp_path / "ops-venv"
    uv, env = _uv_and_env()
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(ops)], check=True, env=env)
    subprocess.run([uv, "pip", "install", "-q", "--python", str(ops / "bin" / "python"), str(ROOT), "safetensors",
                    "numpy"], check=True, env=env)
    proc = subprocess.run([str(ops / "bin" / "gptoss-patch-checkpoint"), str(ckpt), "--tensor-parallel-size", "8"],
                          capture_output=True, text=True, env=_env(ops), timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "intermediate size per rank: 45" in proc.stdout and "intermediate padding: unknown" in proc.stdout
    probe = subprocess.run([str(ops / "bin" / "python"), "-c", "import torch"], capture_output=True, env=_env(ops))
    assert probe.returncode != 0
