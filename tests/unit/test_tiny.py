"""Tiny GPT-OSS checkpoints: the public BF16 release layout, determinism, and a non-degenerate model.

Expected values here are written out from the public gpt-oss configs and transformers' tensor
layout, never taken from gptoss_patch.selftest.tiny itself.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gptoss_patch.selftest import tiny  # noqa: E402

# The public gpt-oss config values a tiny checkpoint must keep.
PUBLIC_ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
PUBLIC_VOCAB = 201088


def safetensors_header(path: Path) -> dict:
    """name -> {dtype, shape, data_offsets}, parsed by hand from the safetensors format (u64 LE length + JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module")
def one_thread():
    # The 2-core machine is shared; torch's intra-op threads make tiny CPU ops 10x slower under load.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("tiny-seed0"), "tiny", seed=0, tokenizer=False)


@pytest.fixture(scope="module")
def hf_model(tiny_dir, one_thread):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    return model, info


def test_config_is_the_public_layout(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss"
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["rope_scaling"] == PUBLIC_ROPE_SCALING
    assert config["rope_theta"] == 150000
    assert config["sliding_window"] == 128
    assert config["torch_dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert config["vocab_size"] == PUBLIC_VOCAB
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is False
    assert config["num_experts_per_tok"] == 4
    assert config["num_local_experts"] >= 8
    # GQA ratio of gpt-oss (64 q : 8 kv)
    assert config["num_attention_heads"] == 8 * config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    assert layers >= 4
    assert config["layer_types"] == [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [200002, 199999, 200012]
    assert generation["bos_token_id"] == 199998 and generation["pad_token_id"] == 199999


def expected_tensors(config: dict) -> dict:
    """name -> shape of a GPT-OSS checkpoint as transformers' GptOssForCausalLM names and lays it out."""
    h, i, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    q, kv = config["num_attention_heads"] * 64, config["num_key_value_heads"] * 64
    out = {
        "model.embed_tokens.weight": [PUBLIC_VOCAB, h],
        "lm_head.weight": [PUBLIC_VOCAB, h],
        "model.norm.weight": [h],
    }
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, h],
            p + "self_attn.q_proj.bias": [q],
            p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.k_proj.bias": [kv],
            p + "self_attn.v_proj.weight": [kv, h],
            p + "self_attn.v_proj.bias": [kv],
            p + "self_attn.o_proj.weight": [h, q],
            p + "self_attn.o_proj.bias": [h],
            p + "self_attn.sinks": [config["num_attention_heads"]],
            p + "mlp.router.weight": [e, h],
            p + "mlp.router.bias": [e],
            p + "mlp.experts.gate_up_proj": [e, h, 2 * i],
            p + "mlp.experts.gate_up_proj_bias": [e, 2 * i],
            p + "mlp.experts.down_proj": [e, i, h],
            p + "mlp.experts.down_proj_bias": [e, h],
        })
    return out


def test_tensor_names_shapes_and_dtype(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    header = safetensors_header(tiny_dir / "model.safetensors")
    assert {name: entry["shape"] for name, entry in header.items()} == expected_tensors(config)
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    size = (tiny_dir / "model.safetensors").stat().st_size
    assert size < 60e6, f"tiny preset is {size / 1e6:.1f} MB"


def test_transformers_loads_every_tensor(hf_model):
    _, info = hf_model
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []


def test_same_seed_is_byte_identical_and_seeds_differ(tiny_dir, tmp_path):
    again = tiny.write_checkpoint(tmp_path / "again", "tiny", seed=0, tokenizer=False)
    other = tiny.write_checkpoint(tmp_path / "other", "tiny", seed=1, tokenizer=False)
    first = (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == first
    assert (again / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    from safetensors.torch import load_file

    a, b = load_file(tiny_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    same = [name for name in a if torch.equal(a[name], b[name])]
    assert same == [], f"seed 1 reproduced seed 0 for {same}"


def test_sharded_write_has_index_and_same_tensors(tiny_dir, tmp_path):
    sharded = tiny.write_checkpoint(tmp_path / "sharded", "tiny", seed=0, tokenizer=False, max_shard_size="20MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    from safetensors.torch import load_file

    whole = load_file(tiny_dir / "model.safetensors")
    parts = {}
    for shard in shards:
        parts.update(load_file(sharded / shard))
    assert set(index["weight_map"]) == set(whole) == set(parts)
    assert all(torch.equal(whole[name], parts[name]) for name in whole)
    # rewriting the directory unsharded leaves no stale index or shard to shadow the new weights
    tiny.write_checkpoint(sharded, "tiny", seed=0, tokenizer=False)
    assert sorted(p.name for p in sharded.glob("model*")) == ["model.safetensors"]
    assert (sharded / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_sinks_and_router_biases_are_not_trivial(tiny_dir):
    from safetensors.torch import load_file

    tensors = load_file(tiny_dir / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith("self_attn.sinks"):
            assert bool((value != 0).all()) and float(value.float().std()) > 0.3, name
        if name.endswith("mlp.router.bias"):
            assert float(value.float().std()) > 0.3, name


PROMPTS = (  # o200k token ids, written out so this file needs no tokenizer
    [976, 9029, 328, 10128, 382],  # "The capital of France is"
    [1314, 165916, 2406, 3127],  # "def fibonacci(n):"
    [200006, 1428, 200008, 13225, 11, 1218, 553, 481, 30, 200007, 200006, 173781],  # "<|start|>user<|message|>Hello, who are you?<|end|><|start|>assistant"
)


def test_greedy_decoding_does_not_collapse(hf_model):
    model, _ = hf_model
    continuations = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        new = out[0, len(prompt):].tolist()
        assert len(new) == 12
        assert len(set(new)) >= 6, f"greedy decoding of {prompt} collapsed: {new}"
        continuations.append(tuple(new))
    assert len(set(continuations)) == len(PROMPTS)


def test_attention_is_peaked_and_sinks_take_mass(hf_model):
    model, _ = hf_model
    ids = torch.tensor([PROMPTS[2] + PROMPTS[0] + PROMPTS[1]])
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    keys = torch.arange(1, ids.shape[1] + 1, dtype=torch.float32)  # causal: row t sees t+1 keys
    for layer, probs in enumerate(out.attentions):  # [1, heads, T, T], the sink column dropped
        probs = probs[0].float()
        row_mass = probs.sum(-1)
        assert float(row_mass.max()) <= 1.0 + 1e-4
        # the sinks absorb a visible share of the softmax in some rows
        assert float((row_mass < 0.9).float().mean()) > 0.05, f"layer {layer}: sinks take no mass"
        # peaked: the largest weight (relative to the row's mass) well above uniform 1/keys
        peak = (probs.max(-1).values / row_mass.clamp_min(1e-9))[:, 4:]
        assert float(peak.mean()) > 2.0 * float((1.0 / keys[4:]).mean()), f"layer {layer}: attention ~ uniform"


def test_router_uses_several_experts(hf_model):
    model, _ = hf_model
    chosen = {}

    def record(layer):
        def hook(module, inputs, output):
            chosen.setdefault(layer, []).append(output[1].reshape(-1))  # (scores, indices)
        return hook

    handles = [blk.mlp.router.register_forward_hook(record(i)) for i, blk in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([PROMPTS[0] + PROMPTS[1] + PROMPTS[2]]))
    finally:
        for handle in handles:
            handle.remove()
    experts = model.config.num_local_experts
    for layer, picks in chosen.items():
        counts = torch.bincount(torch.cat(picks), minlength=experts)
        assert int((counts > 0).sum()) >= experts - 2, f"layer {layer} routes to {counts.tolist()}"
        assert int(counts.max()) < counts.sum() / 4 * 0.95 or experts == 4, f"layer {layer}: one expert always"


def test_presets_and_120b_rank_shapes():
    assert {"tiny", "120b-rank"} <= set(tiny.PRESETS)
    config = tiny.config_for("120b-rank")
    # gpt-oss-120b: hidden 2880, intermediate 2880, head_dim 64, 64 q / 8 kv heads
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (2880, 2880, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (64, 8)
    tp = 8
    assert config.intermediate_size // tp == 360
    assert (config.num_attention_heads // tp, config.num_key_value_heads // tp) == (8, 1)
    assert config.vocab_size == PUBLIC_VOCAB and config.num_experts_per_tok == 4
    shapes = tiny.parameter_shapes("120b-rank")
    e = config.num_local_experts
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (e, 2880, 5760)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (e, 2880, 2880)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2880)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2880)
    assert 2.5e9 < tiny.checkpoint_bytes("120b-rank") < 4e9
    assert tiny.checkpoint_bytes("tiny") < 60e6
    for name in tiny.PRESETS:
        c = tiny.config_for(name)
        assert c.layer_types[0] == "sliding_attention" and c.layer_types[1] == "full_attention"
        assert c.head_dim == 64 and c.num_attention_heads == 8 * c.num_key_value_heads


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        tiny.config_for("huge")
    with pytest.raises(ValueError, match="seed"):
        tiny.write_checkpoint(tmp_path, seed=-1, tokenizer=False)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        tiny.config_for("tiny", num_hidden_layers=1)
    with pytest.raises(ValueError, match="num_local_experts"):
        tiny.config_for("tiny", num_local_experts=2)
