"""gptoss_patch.tools.checkpoint on real tiny GPT-OSS checkpoints and broken copies of them.

Each malformed checkpoint is a copy of the tiny one with one thing edited (a tensor removed, a tensor
transposed, a header cut short, a shard deleted, an MXFP4 config). Needs: torch, transformers,
safetensors (and numpy, which safetensors' header reader uses).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env
from gptoss_patch.checkpoints import expected_tensors
from gptoss_patch.tools.checkpoint import check_checkpoint


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
def tiny(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from gptoss_patch.selftest.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "sharded", preset="tiny", seed=0, tokenizer=False,
                            max_shard_size="20MB")


def copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def rewrite(path, edit):
    """Load a (tiny) safetensors file, apply ``edit(dict)``, write it back with the same metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


def test_tiny_checkpoint_passes_at_every_valid_tp(tiny):
    for tp, per_rank in ((1, 360), (2, 180), (4, 90), (8, 45)):
        report = check_checkpoint(tiny, tp=tp)
        assert report.ok, report.problems
        assert report.warnings == []
        assert report.facts["intermediate_size_per_rank"] == per_rank
        assert report.facts["attention_heads_per_rank"] == 8 // tp
    facts = check_checkpoint(tiny, tp=8).facts
    assert facts["kv_heads_per_rank"].startswith("1 (each of the 1 KV heads replicated on 8 ranks")
    assert facts["intermediate_padded_to"] is None  # no vllm-ascend in the unit venv: nothing is padded here
    assert facts["intermediate_padding"].startswith("unknown: vllm-ascend is not installed here (gptoss-patch pads "
                                                    "it to 48 on vllm-ascend 0.11 - 0.14")
    assert facts["tensors"].startswith("71 in 1 file(s)")


def test_expected_tensors_match_transformers_layout(tiny):
    from gptoss_patch.selftest.tiny import parameter_shapes

    config = json.loads((tiny / "config.json").read_text())
    assert expected_tensors(config) == parameter_shapes("tiny")


def test_real_geometry_at_tp8_reports_the_360_split(monkeypatch):
    # gpt-oss-120b's config values (openai/gpt-oss-120b config.json): the per-rank fact the padding work is about
    from gptoss_patch.tools.checkpoint import CheckReport, _tp_facts

    monkeypatch.delenv("GPTOSS_PATCH_MOE_PAD", raising=False)
    config = {"num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 2880, "hidden_size": 2880,
              "num_local_experts": 128}
    report = CheckReport(directory="-", tp=8)
    _tp_facts(config, 8, report)
    assert report.ok
    assert report.facts == {"attention_heads_per_rank": 8, "kv_heads_per_rank": 1, "intermediate_size_per_rank": 360,
                            "intermediate_padded_to": None,
                            # the unit venv has no vllm-ascend: whether it pads is the installed release's question
                            # (tests/cell/test_padding.py asks it in every patched cell)
                            "intermediate_padding": "unknown: vllm-ascend is not installed here (gptoss-patch pads it "
                                                    "to 368 on vllm-ascend 0.11 - 0.14 where the release casts the "
                                                    "experts to FRACTAL_NZ)"}
    report = CheckReport(directory="-", tp=4)
    _tp_facts(config, 4, report)  # 720 per rank: nothing to pad
    assert (report.facts["intermediate_padded_to"], report.facts["intermediate_padding"]) == \
        (None, "no: already a multiple of 16")
    for name, value, message in (("VLLM_ASCEND_ENABLE_NZ", "abc", "VLLM_ASCEND_ENABLE_NZ='abc' is not an integer"),
                                 ("GPTOSS_PATCH_MOE_PAD", "bogus", "GPTOSS_PATCH_MOE_PAD")):
        monkeypatch.setenv(name, value)
        report = CheckReport(directory="-", tp=8)
        _tp_facts(config, 8, report)  # the variable is named; the other facts stay
        assert len(report.problems) == 1 and message in report.problems[0], report.problems
        assert report.facts["attention_heads_per_rank"] == 8
        monkeypatch.delenv(name)


def test_padding_answer_for_an_untested_build_is_the_runtimes_decision(monkeypatch):
    """Issue 32: for the seed's untested build ``0.11.0rc1.dev449+gc9b64052e`` (structurally compatible with 0.11.0,
    so the runtime applies 0.11.0's layout and its padding patch) the report said "gptoss-patch does not pad on this
    release", read from the version string. It now takes the runtime's decision (``pairing.judge``, here the real
    ``matrix.decide`` with the structural check passing) and says the padding is decided at start-up from the
    build's own NZ rule - and a forcing policy still decides outright."""
    from gptoss_patch import environment, matrix, pairing
    from gptoss_patch.tools.checkpoint import moe_padding_facts

    build = "0.11.0rc1.dev449+gc9b64052e"
    versions = environment.Versions(vllm="0.11.0", vllm_ascend=build, torch="2.7.1", torch_npu="2.7.1", cann="8.2",
                                    python="3.11")
    decision = matrix.decide(build, "0.11.0", structural_check=lambda row: [])
    assert decision.verdict == matrix.APPLY and decision.row.vllm_ascend == "0.11.0"
    monkeypatch.setattr(environment, "installed_versions", lambda: versions)
    monkeypatch.setattr(pairing, "judge", lambda force=None: (versions, decision))
    monkeypatch.delenv("GPTOSS_PATCH_MOE_PAD", raising=False)
    config = {"intermediate_size": 2880, "hidden_size": 2880, "num_local_experts": 128}
    facts = moe_padding_facts(config, 8)
    assert facts["intermediate_padded_to"] is None
    assert facts["intermediate_padding"].startswith(
        f"decided at start-up: vllm-ascend {build} is an untested build that gptoss-patch runs as 0.11.0; it pads to "
        "368 if this build casts bf16 MoE weights to FRACTAL_NZ"), facts
    monkeypatch.setenv("GPTOSS_PATCH_MOE_PAD", "always")
    assert moe_padding_facts(config, 8)["intermediate_padded_to"] == 368


@pytest.mark.parametrize("tp, message", [
    (3, "tensor-parallel size 3 does not divide num_attention_heads 8"),
    (16, "tensor-parallel size 16 does not divide num_attention_heads 8"),
])
def test_tp_that_does_not_divide_the_heads(tiny, tp, message):
    report = check_checkpoint(tiny, tp=tp)
    assert not report.ok and any(message in p for p in report.problems), report.problems


def test_tp_that_does_not_divide_the_intermediate_size(tiny, tmp_path):
    from gptoss_patch.selftest.tiny import write_checkpoint

    odd = write_checkpoint(tmp_path / "odd", preset="tiny", seed=0, tokenizer=False, intermediate_size=36,
                           num_hidden_layers=2)
    report = check_checkpoint(odd, tp=8)
    assert report.problems == ["tensor-parallel size 8 does not divide intermediate_size 36 (the expert "
                               "intermediate dimension is split across ranks)"]


def test_mxfp4_checkpoint_is_accepted_with_its_dequantized_rank_size(tmp_path):
    """Issue 18: the official MXFP4 layout is served (experts dequantized while loading); the report says so and
    gives the per-rank BF16 size and the 64 GB 910B3 fit."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    mx = write_checkpoint(tmp_path / "mx", preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
    report = check_checkpoint(mx, tp=2)
    assert report.ok, report.problems
    assert report.facts["quantization"].startswith("MXFP4 experts") and "dequantizes them to BF16" in \
        report.facts["quantization"]
    # vocabulary-split embeddings + lm_head: 2 x 100544 x 64, plus 4 layers at intermediate 192: ~14 M parameters
    assert report.facts["bf16_weights_per_rank"] == "0.03 GiB (after dequantizing the MXFP4 experts)"
    assert report.facts["fits_910b3_64gb"].startswith("yes: ")
    assert not any("do not use" in w for w in report.warnings), report.warnings


def test_mxfp4_checkpoint_with_missing_scales_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from gptoss_patch.selftest.tiny import write_checkpoint

    mx = write_checkpoint(tmp_path / "mx", preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
    tensors = load_file(str(mx / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.gate_up_proj_scales"]
    save_file(tensors, str(mx / "model.safetensors"), metadata={"format": "pt"})
    report = check_checkpoint(mx)
    assert report.problems == [f"{mx}: model.layers.3.mlp.experts.gate_up_proj_blocks has no "
                               "model.layers.3.mlp.experts.gate_up_proj_scales (expected shape [8, 768, 2] uint8)"]


def test_rank_bf16_bytes_of_the_released_geometries():
    """gpt-oss-120b: 116.8 B parameters (model card) = 217.6 GiB in BF16; at TP 8 each rank holds 27.2 GiB (the
    replicated norms/router/down-proj bias add little); gpt-oss-20b: 20.9 B = 39.0 GiB."""
    from gptoss_patch.tools.checkpoint import rank_bf16_bytes

    c120 = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
                num_key_value_heads=8, num_local_experts=128, vocab_size=201088, head_dim=64)
    assert round(rank_bf16_bytes(c120, 1) / 2**30, 1) == 217.6
    assert round(rank_bf16_bytes(c120, 8) / 2**30, 1) == 27.2
    assert round(rank_bf16_bytes(dict(c120, num_hidden_layers=24, num_local_experts=32), 1) / 2**30, 1) == 39.0


def test_bf16_hint_picks_the_release_by_layer_count():
    from gptoss_patch.tools.checkpoint import _bf16_hint

    config = {"num_hidden_layers": 36}
    assert "(unsloth/gpt-oss-120b-BF16;" in _bf16_hint(config)


def test_wrong_model_type(tiny, tmp_path):
    bad = copy(tiny, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(config))
    report = check_checkpoint(bad)
    assert report.problems[0] == (f"{bad / 'config.json'}: model_type is 'llama', expected 'gpt_oss' (a GPT-OSS "
                                  "checkpoint such as unsloth/gpt-oss-20b-BF16)")


def test_missing_tensor_named_with_file(tiny, tmp_path):
    bad = copy(tiny, tmp_path)
    rewrite(bad / "model.safetensors", lambda t: t.pop("model.layers.2.self_attn.sinks"))
    report = check_checkpoint(bad)
    assert report.problems == [f"{bad / 'model.safetensors'}: tensor model.layers.2.self_attn.sinks missing "
                               "(expected shape [8])"]


def test_wrong_shape_named_with_file(tiny, tmp_path):
    bad = copy(tiny, tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    rewrite(bad / "model.safetensors", lambda t: t.__setitem__(name, t[name].transpose(1, 2).contiguous()))
    report = check_checkpoint(bad)
    assert report.problems == [f"{bad / 'model.safetensors'}: tensor {name} has shape [8, 720, 64], expected "
                               "[8, 64, 720] (transposed: [E, 2I, H]; GPT-OSS stores gate_up_proj as [E, H, 2I])"]


def test_truncated_header_named(tiny, tmp_path):
    bad = copy(tiny, tmp_path)
    path = bad / "model.safetensors"
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    path.write_bytes(data[: 8 + header_len // 2])  # the download stopped inside the JSON header
    report = check_checkpoint(bad)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"{path}: unreadable safetensors header (")
    assert report.problems[0].endswith("the file is truncated or corrupt - download it again")
    path.write_bytes(data[:-100])  # header intact, data cut short: safetensors checks the sizes too
    report = check_checkpoint(bad)
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{path}: unreadable safetensors header (")


def test_sharded_checkpoint_and_missing_shard(sharded, tmp_path):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    report = check_checkpoint(sharded, tp=8)
    assert report.ok, report.problems
    bad = copy(sharded, tmp_path)
    (bad / shards[-1]).unlink()
    report = check_checkpoint(bad, tp=8)
    named = sum(1 for f in index["weight_map"].values() if f == shards[-1])
    assert report.problems == [
        f"{bad / shards[-1]}: missing (model.safetensors.index.json assigns {named} tensors to it)"]
    index["weight_map"]["model.norm.weight"] = shards[0]  # the index points at the wrong shard
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(sharded / shards[-1], bad / shards[-1])
    report = check_checkpoint(bad, tp=8)
    actual = [f for k, f in json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].items()
              if k == "model.norm.weight"][0]
    assert actual != shards[0]
    assert report.problems == [f"{bad / shards[0]}: index assigns tensor model.norm.weight to this file but it "
                               f"is in {actual}"]


def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"tp \(tensor-parallel size\) must be an int >= 1, got 0"):
        check_checkpoint(tiny, tp=0)
    with pytest.raises(FileNotFoundError, match="does not exist or is not a directory"):
        check_checkpoint(tmp_path / "nowhere")
    report = check_checkpoint(tmp_path)
    assert report.problems == [f"{tmp_path / 'config.json'}: missing (every Hugging Face checkpoint has one)"]


def test_cli(tiny):
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.tools.checkpoint", str(tiny), "-tp", "8", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["facts"]["intermediate_size_per_rank"] == 45
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.tools.checkpoint", str(tiny), "-tp", "3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "PROBLEM: tensor-parallel size 3" in proc.stdout


def test_verify_model_includes_the_checkpoint_report(tiny, tmp_path):
    bad = copy(tiny, tmp_path)
    rewrite(bad / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.router.bias"))
    # GPTOSS_PATCH_DISABLE keeps verify from importing vllm-ascend: only the checkpoint part matters here
    env = dict(clean_env(GPTOSS_PATCH_DISABLE="1"))
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--no-children", "--json", "--model", str(bad),
                           "--tensor-parallel-size", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["checkpoint"]["facts"]["intermediate_size_per_rank"] == 45
    problem = (f"checkpoint: {bad / 'model.safetensors'}: tensor model.layers.0.mlp.router.bias missing "
               "(expected shape [8])")
    assert problem in report["problems"] and not report["ok"]


def test_mismatched_shapes_reads_the_headers_only(tiny, tmp_path):
    """The function the guard calls before vLLM loads (issue 17): the same comparison as check_checkpoint."""
    from gptoss_patch.checkpoints import mismatched_shapes

    assert mismatched_shapes(tiny) == []
    bad = copy(tiny, tmp_path)
    name = "model.layers.0.self_attn.sinks"
    rewrite(bad / "model.safetensors", lambda t: t.__setitem__(name, t[name].reshape(8, 1).contiguous()))
    assert mismatched_shapes(str(bad)) == [(name, (8, 1), (8,))]
    assert check_checkpoint(bad).problems == [f"{bad / 'model.safetensors'}: tensor {name} has shape [8, 1], "
                                              "expected [8]"]
    rewrite(bad / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.router.bias"))  # missing: not a shape
    assert mismatched_shapes(bad) == [(name, (8, 1), (8,))]


def test_mismatched_shapes_sharded_and_errors(sharded, tmp_path):
    from gptoss_patch.checkpoints import mismatched_shapes

    assert mismatched_shapes(sharded) == []
    with pytest.raises(FileNotFoundError):
        mismatched_shapes(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: missing or non-positive intermediate_size"):
        mismatched_shapes(tmp_path)


_LAYOUTS = {
    "sound": ({"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}, 8),
    "sound, fp8 and fp4": ({"a": {"dtype": "F8_E4M3FNUZ", "shape": [8], "data_offsets": [0, 8]},
                            "b": {"dtype": "F4", "shape": [4, 2], "data_offsets": [8, 12]}}, 12),
    "bytes do not match the shape": ({"a": {"dtype": "BF16", "shape": [10, 10], "data_offsets": [0, 8]}}, 8),
    "unknown dtype": ({"a": {"dtype": "WAT", "shape": [4], "data_offsets": [0, 8]}}, 8),
    "overlapping tensors": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                             "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}, 12),
    "reversed offsets": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [8, 0]}}, 8),
    "trailing bytes": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 16),
    "negative dimension": ({"a": {"dtype": "U8", "shape": [-8], "data_offsets": [0, 8]}}, 8),
    "truncated data": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 4),
}


@pytest.mark.parametrize("case", sorted(_LAYOUTS))
def test_the_header_reader_judges_a_layout_as_safetensors_does(tmp_path, case):
    """The one stdlib header reader (gptoss_patch.checkpoints) accepts exactly the files the safetensors library
    opens - the oracle here - so the guard and the checkpoint report are no weaker than ``safe_open`` was."""
    import json
    import struct

    from safetensors import SafetensorError, safe_open

    from gptoss_patch.checkpoints import read_headers

    header, data = _LAYOUTS[case]
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data)
    problems: list[str] = []
    read_headers(tmp_path, problems)
    try:
        with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as handle:
            [handle.get_slice(k).get_shape() for k in handle.keys()]
        oracle_ok = True
    except (SafetensorError, ValueError, OSError):
        oracle_ok = False
    assert (problems == []) is oracle_ok is case.startswith("sound"), problems
    if problems:
        assert problems[0].startswith(f"{tmp_path / 'model.safetensors'}: unreadable safetensors header (")


def test_a_header_length_of_gigabytes_is_refused_without_reading_it(tmp_path):
    import struct

    from gptoss_patch.checkpoints import MAX_HEADER_BYTES, read_headers

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2 ** 31) + b"{}")
    os.truncate(path, 2 ** 31 + 16)  # sparse: no disk used
    problems: list[str] = []
    read_headers(tmp_path, problems)
    assert len(problems) == 1 and f"more than the {MAX_HEADER_BYTES}" in problems[0]
