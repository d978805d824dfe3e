"""The serve recipes (gptoss_patch.tools.serve, console script gptoss-patch-serve): --dry-run output, overrides, refusals.

Everything runs the real CLI in a subprocess. The verify gate is exercised for real: in a fresh venv
holding gptoss_patch and its runtime dependencies but no vllm-ascend, ``python -m gptoss_patch.verify``
exits 1 and the recipe must refuse to start. Needs: safetensors, transformers + torch (tiny checkpoint),
quicktok-v1 (tokenizer directory).
"""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, clean_env

SEED_SIZES = "[1024,512,256,128,64,16,4,2,1]"


def shared_tiny(tmp_path_factory):
    """The tiny checkpoint (with tokenizer files), written once per session under pytest's base temp
    and shared by test_serve, test_checkpoint and test_server_probe (tests copy it before editing)."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    path = tmp_path_factory.getbasetemp() / "ops-kit-tiny"
    if not (path / ".complete").is_file():
        write_checkpoint(path, preset="tiny", seed=0, tokenizer=True)
        (path / ".complete").write_text("")
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tiny checkpoint dir, prepared tokenizer dir), shared by the module."""
    from gptoss_patch.tools.tokenizer import prepare

    base = tmp_path_factory.mktemp("serve")
    ckpt = shared_tiny(tmp_path_factory)
    tok = prepare(base / "tok").directory
    return ckpt, tok


def env_without(*names, **extra):
    env = clean_env()
    for n in names:
        env.pop(n, None)
    env = {k: v for k, v in env.items() if not k.startswith("GPTOSS_SERVE_")}
    env.update(extra)
    return env


BASE_ENV = ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR", "TIKTOKEN_CACHE_DIR", "VLLM_PLUGINS",
            "HCCL_INTRA_ROCE_ENABLE")


def dry(args, **env):
    args = list(args)
    args.insert(args.index("--") if "--" in args else len(args), "--dry-run")  # before the vllm pass-through
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=env_without(*BASE_ENV, **env), timeout=120, cwd=ROOT)
    return proc


def parse(stdout):
    """(exports dict, argv list) of a --dry-run output."""
    lines = stdout.strip().splitlines()
    exports = {}
    for line in lines[:-1]:
        assert line.startswith("export "), line
        name, value = line[len("export "):].split("=", 1)
        exports[name] = shlex.split(value)[0]
    return exports, shlex.split(lines[-1])


def flag(argv, name):
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_120b_tp8_dry_run_is_the_seed_recipe(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tok)])
    assert proc.returncode == 0, proc.stderr
    exports, argv = parse(proc.stdout)
    assert exports == {"TIKTOKEN_ENCODINGS_BASE": str(tok), "TIKTOKEN_RS_CACHE_DIR": str(tok),
                       "TIKTOKEN_CACHE_DIR": str(tok), "HCCL_INTRA_ROCE_ENABLE": "1"}
    assert Path(argv[0]).name in ("vllm", "python", Path(sys.executable).name)
    serve_at = argv.index("serve")
    assert argv[serve_at + 1] == str(ckpt)
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert flag(argv, "--gpu-memory-utilization") == "0.95"
    assert flag(argv, "--max-model-len") == "16384"
    assert flag(argv, "--served-model-name") == "gpt-oss-120b"
    assert json.loads(flag(argv, "--compilation-config")) == {
        "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": json.loads(SEED_SIZES)}
    assert flag(argv, "--reasoning-parser") == "openai_gptoss"
    assert flag(argv, "--tool-call-parser") == "openai"
    assert "--enable-auto-tool-choice" in argv and "--enforce-eager" not in argv
    assert "IGNORE_GRAPH_UPDATE_EXCEPTIONS" not in proc.stdout


def test_20b_tp1_dry_run(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(ckpt), "--tokenizer-dir", str(tok)])
    assert proc.returncode == 0, proc.stderr
    exports, argv = parse(proc.stdout)
    assert "HCCL_INTRA_ROCE_ENABLE" not in exports  # single card: no inter-card link to configure
    assert exports["TIKTOKEN_RS_CACHE_DIR"] == str(tok)
    assert flag(argv, "--tensor-parallel-size") == "1"
    assert flag(argv, "--served-model-name") == "gpt-oss-20b"
    assert flag(argv, "--reasoning-parser") == "openai_gptoss"
    assert json.loads(flag(argv, "--compilation-config"))["cudagraph_mode"] == "PIECEWISE"


def test_flags_beat_environment_beat_preset(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--max-model-len", "8192", "--port", "9001",
                "--cudagraph-capture-sizes", "1,2,4", "--served-model-name", "mine", "--", "--seed", "7"],
               GPTOSS_SERVE_MODEL=str(ckpt), GPTOSS_SERVE_TOKENIZER_DIR=str(tok),
               GPTOSS_SERVE_MAX_MODEL_LEN="4096", GPTOSS_SERVE_GPU_MEMORY_UTILIZATION="0.9",
               GPTOSS_SERVE_TENSOR_PARALLEL_SIZE="2", HCCL_INTRA_ROCE_ENABLE="0")
    assert proc.returncode == 0, proc.stderr
    exports, argv = parse(proc.stdout)
    assert argv[argv.index("serve") + 1] == str(ckpt)  # from GPTOSS_SERVE_MODEL
    assert flag(argv, "--max-model-len") == "8192"  # flag beats env
    assert flag(argv, "--gpu-memory-utilization") == "0.9"  # env beats preset
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--port") == "9001" and flag(argv, "--served-model-name") == "mine"
    assert json.loads(flag(argv, "--compilation-config"))["cudagraph_capture_sizes"] == [1, 2, 4]
    assert argv[-2:] == ["--seed", "7"]  # extra vllm arguments go last
    assert "HCCL_INTRA_ROCE_ENABLE" not in exports  # the user's own value is kept, not overwritten


def test_eager_and_no_tool_calls(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(ckpt), "--tokenizer-dir", str(tok),
                "--no-tool-calls"], GPTOSS_SERVE_EAGER="1")
    assert proc.returncode == 0, proc.stderr
    _, argv = parse(proc.stdout)
    assert "--enforce-eager" in argv and "--compilation-config" not in argv
    assert "--tool-call-parser" not in argv and "--enable-auto-tool-choice" not in argv


def test_existing_tiktoken_environment_is_used(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(ckpt)], TIKTOKEN_ENCODINGS_BASE=str(tok))
    assert proc.returncode == 0, proc.stderr
    exports, _ = parse(proc.stdout)
    assert exports == {"TIKTOKEN_RS_CACHE_DIR": str(tok), "TIKTOKEN_CACHE_DIR": str(tok)}


@pytest.mark.parametrize("args, message", [
    (["--max-model-len", "0"], "--max-model-len must be a positive integer, got '0'"),
    (["--gpu-memory-utilization", "95"], "--gpu-memory-utilization must be a number in (0, 1], got '95'"),
    (["--cudagraph-capture-sizes", "1,x"], "--cudagraph-capture-sizes entry must be a positive integer, got 'x'"),
    (["--cudagraph-mode", "piecewize"], "--cudagraph-mode must be one of NONE, PIECEWISE"),
    (["--port", "70000"], "--port must be in 1..65535"),
])
def test_bad_values_are_named(assets, args, message):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tok), *args])
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr


def test_refuses_without_vocabulary(assets, tmp_path):
    ckpt, _ = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt)])
    assert proc.returncode == 2 and "gptoss-patch-tokenizer prepare DIR" in proc.stderr
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tmp_path)])
    assert proc.returncode == 2 and f"{tmp_path}/o200k_base.tiktoken" in proc.stderr


def test_unknown_preset_and_missing_model(assets):
    _, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "70b"])
    assert proc.returncode == 2 and "unknown preset '70b'; known: 120b-tp8, 20b-tp1" in proc.stderr
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--tokenizer-dir", str(tok)])
    assert proc.returncode == 2 and "unsloth/gpt-oss-20b-BF16" in proc.stderr


def test_checkpoint_problems_block_the_start(assets, tmp_path):
    ckpt, tok = assets
    bad = tmp_path / "mxfp4"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (bad / "config.json").write_text(json.dumps(config))
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(bad), "--tokenizer-dir", str(tok)])
    assert proc.returncode == 1 and proc.stdout == ""
    assert "MXFP4" in proc.stderr and "--no-model-check" in proc.stderr
    # the TP size is checked against the heads: the tiny model has 8 query heads
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tok),
                "--tensor-parallel-size", "3"])
    assert proc.returncode == 1 and "does not divide num_attention_heads 8" in proc.stderr
    proc = dry(["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(bad), "--tokenizer-dir", str(tok),
                "--no-model-check"])
    assert proc.returncode == 0


@pytest.fixture
def no_ascend_env(bare_site, tmp_path):
    """A venv with gptoss_patch (+ .pth) and its runtime dependencies (wrapt, packaging) but no vllm-ascend."""
    import packaging
    import wrapt

    py, site = bare_site
    for mod in (wrapt, packaging):
        shutil.copytree(Path(mod.__file__).parent, site / mod.__name__, ignore=shutil.ignore_patterns("__pycache__"))
    return py


def test_refuses_to_start_when_verify_fails(assets, no_ascend_env, tmp_path):
    ckpt, tok = assets
    marker = tmp_path / "started"
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake_vllm.chmod(0o755)
    args = ["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tok),
            "--no-model-check", "--vllm-bin", str(fake_vllm)]  # the bare venv has no safetensors
    proc = subprocess.run([str(no_ascend_env), *args], capture_output=True, text=True, timeout=300,
                          env=env_without(*BASE_ENV))
    assert proc.returncode == 1, proc.stderr
    assert "vllm-ascend is not installed" in proc.stderr  # verify's own finding, passed through
    assert "exited 1; refusing to start vLLM" in proc.stderr
    assert not marker.exists()


def test_no_verify_execs_vllm_with_recipe_environment(assets, no_ascend_env, tmp_path):
    ckpt, tok = assets
    record = tmp_path / "record.json"
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': {{k: os.environ.get(k) for k in "
        f"('TIKTOKEN_RS_CACHE_DIR', 'HCCL_INTRA_ROCE_ENABLE')}}}}, open({str(record)!r}, 'w'))\n")
    fake_vllm.chmod(0o755)
    args = ["-m", "gptoss_patch.tools.serve", "120b-tp8", "--model", str(ckpt), "--tokenizer-dir", str(tok),
            "--no-model-check", "--no-verify", "--vllm-bin", str(fake_vllm)]
    proc = subprocess.run([str(no_ascend_env), *args], capture_output=True, text=True, timeout=120,
                          env=env_without(*BASE_ENV))
    assert proc.returncode == 0, proc.stderr
    assert "--no-verify" in proc.stderr
    got = json.loads(record.read_text())
    assert got["argv"][:2] == ["serve", str(ckpt)] and "--enable-auto-tool-choice" in got["argv"]
    assert got["env"] == {"TIKTOKEN_RS_CACHE_DIR": str(tok), "HCCL_INTRA_ROCE_ENABLE": "1"}


def test_vllm_plugins_filter_is_warned(assets):
    ckpt, tok = assets
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(ckpt), "--tokenizer-dir", str(tok)],
               VLLM_PLUGINS="ascend")
    assert proc.returncode == 0
    assert "VLLM_PLUGINS='ascend' filters out the 'gptoss_patch' vllm.general_plugins entry point" in proc.stderr
    proc = dry(["-m", "gptoss_patch.tools.serve", "20b-tp1", "--model", str(ckpt), "--tokenizer-dir", str(tok)],
               VLLM_PLUGINS="ascend,gptoss_patch")
    assert "VLLM_PLUGINS" not in proc.stderr
