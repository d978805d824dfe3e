"""Deterministic tiny GPT-OSS checkpoints in the layout of the public BF16 releases.

The public BF16 checkpoints (``unsloth/gpt-oss-20b-BF16``, ``unsloth/gpt-oss-120b-BF16``, produced by
transformers' ``convert_gpt_oss_weights_to_hf.py``) are ``save_pretrained`` output of
``transformers.GptOssForCausalLM``: ``config.json`` (``model_type: gpt_oss``, YaRN ``rope_scaling``,
``sliding_window: 128``, alternating ``layer_types``, ``torch_dtype: bfloat16``, no
``quantization_config``), ``generation_config.json``, bf16 safetensors and the tokenizer files.
:func:`write_checkpoint` builds the same thing with transformers' own classes, so the tensor names
and layouts are transformers', not ours. Per layer ``L`` (``E`` experts, hidden ``H``, expert
intermediate ``I``, ``Nq``/``Nkv`` heads of ``D = 64``)::

    model.embed_tokens.weight                         [V, H]        (and lm_head.weight [V, H], untied)
    model.layers.L.input_layernorm.weight             [H]
    model.layers.L.self_attn.{q,k,v}_proj.{weight,bias}  [Nq*D | Nkv*D, H], [Nq*D | Nkv*D]
    model.layers.L.self_attn.o_proj.{weight,bias}     [H, Nq*D], [H]
    model.layers.L.self_attn.sinks                    [Nq]
    model.layers.L.post_attention_layernorm.weight    [H]
    model.layers.L.mlp.router.{weight,bias}           [E, H], [E]
    model.layers.L.mlp.experts.gate_up_proj           [E, H, 2I]   (gate = [..., ::2], up = [..., 1::2])
    model.layers.L.mlp.experts.gate_up_proj_bias      [E, 2I]
    model.layers.L.mlp.experts.down_proj              [E, I, H]
    model.layers.L.mlp.experts.down_proj_bias         [E, H]
    model.norm.weight                                 [H]

The vocabulary is the real one (``V = 201088``) so the real o200k/harmony tokenizer fits; the
hidden size, layer count and expert count are what shrinks. Weights are drawn from
``torch.Generator`` streams seeded from ``(seed, tensor name)``, with magnitudes chosen so the model
is not degenerate (non-zero sinks, peaked attention, router biases spread over several experts,
greedy decoding that does not repeat one token). Same seed and torch version -> byte-identical files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from pathlib import Path

__all__ = ["PRESETS", "COMMON", "MXFP4_QUANTIZATION_CONFIG", "config_for", "parameter_shapes", "checkpoint_bytes",
           "write_checkpoint", "quantize_checkpoint_mxfp4"]

#: ``quantization_config`` of the official MXFP4 releases (``openai/gpt-oss-20b`` / ``-120b`` ``config.json``).
MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}

#: Configuration shared by every preset: the values of the public gpt-oss config.json files
#: (``openai/gpt-oss-20b`` / ``-120b``), minus ``quantization_config`` (the BF16 releases have none).
COMMON = {
    "vocab_size": 201088,
    "head_dim": 64,
    "sliding_window": 128,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "use_cache": True,
    "initializer_range": 0.02,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}

#: name -> {"config": GptOssConfig overrides, "max_shard_size": default sharding, "notes"}. Sizes are
#: of the safetensors alone (the tokenizer files add 27.9 MB).
PRESETS: dict[str, dict] = {
    # 120b per-rank view at TP=8: 8 q heads : 1 kv head, expert intermediate 360 (= 2880 / 8).
    "tiny": {
        "config": {
            "hidden_size": 64,
            "intermediate_size": 360,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "num_local_experts": 8,
        },
        "max_shard_size": None,  # one model.safetensors
        "notes": "56.6 MB bf16 (51.5 MB of it embed_tokens + lm_head at vocab 201088); "
        "written in ~2 s, loaded by transformers in < 0.1 s",
    },
    # The same per-rank view at TP=2: 16:2 heads, intermediate 720 -> 360 per rank.
    "tiny-tp2": {
        "config": {
            "hidden_size": 64,
            "intermediate_size": 720,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
        },
        "max_shard_size": None,
        "notes": "61.6 MB bf16; per rank at TP=2 it has the shapes of 'tiny'",
    },
    # For MC2 on a simulated Atlas A3: npu_moe_distribute_dispatch_v2 / combine_v2 take H in [1024, 7168] there
    # (docs/operators.md section 4.5), so the hidden size is 1024; per rank at TP=2 the heads are 'tiny''s 8 : 1, and
    # at EP=2 each rank holds 4 whole experts. Two layers: one sliding, one full.
    "tiny-h1024": {
        "config": {
            "hidden_size": 1024,
            "intermediate_size": 720,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
        },
        "max_shard_size": None,
        "notes": "~0.85 GB bf16 (0.82 GB of it embed_tokens + lm_head at vocab 201088)",
    },
    # 'tiny' for the MXFP4 layout: MXFP4 packs the intermediate dimension of down_proj in blocks of 32, so the
    # intermediate size is 384 (360 is not a multiple of 32; the official 2880 is 90 blocks).
    "tiny-mxfp4": {
        "config": {
            "hidden_size": 64,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "num_local_experts": 8,
        },
        "max_shard_size": None,
        "notes": "write with quantization='mxfp4': experts as *_blocks/*_scales, the rest bf16",
    },
    # gpt-oss-120b's own hidden / intermediate / head shapes, so that at TP=8 every rank holds the
    # real per-rank tensors (8 q heads, 1 kv head, intermediate 360, hidden 2880); few layers and
    # experts to fit in memory.
    "120b-rank": {
        "config": {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 2,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
        },
        "max_shard_size": "2GB",  # sharded with model.safetensors.index.json, like the releases
        "notes": "3.22 GB bf16 in 2 shards (2.32 GB embed_tokens + lm_head, 0.4 GB experts and "
        "53 MB attention per layer); written in ~70 s with ~3.7 GB peak RSS, loaded by transformers in ~2 s",
    },
}

# Magnitudes of the random weights, as (mean, std, scale) of a normal; scale "in" divides std by
# sqrt(fan_in). Chosen for non-degenerate outputs of a random model: attention logits with std ~2
# (peaked, not uniform), sinks around 1 (they take a visible share of the softmax), router logits
# with std ~2 plus biases with std 0.5 (input-dependent routing that spreads over all experts),
# gate/up pre-activations with std ~2.5 (the swiglu clamp at 7 is reached now and then), logits with
# std ~4 (greedy decoding wanders instead of repeating one token).
_INIT = {
    "embed_tokens.weight": (0.0, 1.0, None),
    "lm_head.weight": (0.0, 4.0, "in"),
    "norm.weight": (1.0, 0.05, None),
    "layernorm.weight": (1.0, 0.05, None),
    "q_proj.weight": (0.0, 1.5, "in"),
    "k_proj.weight": (0.0, 1.5, "in"),
    "v_proj.weight": (0.0, 1.0, "in"),
    "o_proj.weight": (0.0, 1.0, "in"),
    "q_proj.bias": (0.0, 0.5, None),
    "k_proj.bias": (0.0, 0.5, None),
    "v_proj.bias": (0.0, 0.1, None),
    "o_proj.bias": (0.0, 0.1, None),
    "sinks": (1.0, 1.0, None),
    "router.weight": (0.0, 2.0, "in"),
    "router.bias": (0.0, 0.5, None),
    "gate_up_proj": (0.0, 2.5, "in"),
    "gate_up_proj_bias": (0.0, 0.5, None),
    "down_proj": (0.0, 0.25, "in"),
    "down_proj_bias": (0.0, 0.1, None),
}

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_ROWS_PER_CHUNK = 8192  # rows of a 2-D tensor drawn per generator call (bounds fp32 scratch memory)


def _preset(preset: str) -> dict:
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}") from None


def config_for(preset: str = "tiny", **overrides):
    """The ``transformers.GptOssConfig`` of ``preset`` (see :data:`PRESETS`), optionally overridden.

    :data:`COMMON` + the preset's values + ``overrides`` (any ``GptOssConfig`` keyword). Sets
    ``layer_types`` to the released alternation (even index ``sliding_attention``, odd
    ``full_attention``) unless overridden, ``architectures = ["GptOssForCausalLM"]`` and
    ``torch_dtype = bfloat16``. Raises ``ValueError`` for an unknown preset, a layer count below 2,
    ``num_attention_heads`` not a multiple of ``num_key_value_heads``, or fewer experts than top-k.
    """
    from transformers import GptOssConfig

    values = copy.deepcopy(COMMON)
    values.update(copy.deepcopy(_preset(preset)["config"]))
    values.update(copy.deepcopy(overrides))
    layers = values["num_hidden_layers"]
    if layers < 2:
        raise ValueError("num_hidden_layers must be >= 2 (one sliding and one full attention layer)")
    if values["num_attention_heads"] % values["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if values["num_local_experts"] < values["num_experts_per_tok"]:
        raise ValueError("num_local_experts must be >= num_experts_per_tok")
    values["experts_per_token"] = values["num_experts_per_tok"]
    values.setdefault(
        "layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    )
    # transformers >= 4.56 turns the torch_dtype keyword into config.dtype (written back as
    # torch_dtype by write_checkpoint); older versions keep torch_dtype.
    config = GptOssConfig(torch_dtype="bfloat16", **values)
    config.architectures = ["GptOssForCausalLM"]
    return config


def _meta_model(config):
    import torch
    from transformers import GptOssForCausalLM

    with torch.device("meta"):
        return GptOssForCausalLM(config)


def parameter_shapes(preset: str = "tiny", **overrides) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a ``preset`` checkpoint holds (no memory allocated: meta device)."""
    model = _meta_model(config_for(preset, **overrides))
    return {name: tuple(param.shape) for name, param in model.state_dict().items()}


def checkpoint_bytes(preset: str = "tiny", **overrides) -> int:
    """Size in bytes of the bf16 tensors of a ``preset`` checkpoint (safetensors headers excluded)."""
    return sum(2 * math.prod(shape) for shape in parameter_shapes(preset, **overrides).values())


def _init_spec(name: str):
    for suffix, spec in _INIT.items():
        if name.endswith(suffix):
            return spec
    raise KeyError(f"no initialisation rule for {name}")  # a new tensor in a new transformers version


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"gptoss-patch/tiny/v1/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: valid for torch.Generator.manual_seed


def _draw(name: str, shape, seed: int):
    import torch

    mean, std, fan = _init_spec(name)
    if fan == "in":  # fan-in is the contracted dimension in the forward pass
        fan_in = shape[-2] if name.endswith("gate_up_proj") or name.endswith("down_proj") else shape[-1]
        std = std / math.sqrt(fan_in)
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1, shape[-1]) if len(shape) > 1 else out.view(1, -1)
    for start in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        rows = flat[start : start + _ROWS_PER_CHUNK]
        sample = torch.randn(rows.shape, generator=generator, dtype=torch.float32)
        rows.copy_(sample.mul_(std).add_(mean))
    return out


def _state_dict(config, seed: int):
    model = _meta_model(config)
    names = sorted(model.state_dict())
    shapes = dict(model.state_dict())
    return model, {name: _draw(name, tuple(shapes[name].shape), seed) for name in names}


def write_checkpoint(directory, preset: str = "tiny", seed: int = 0, tokenizer=True, max_shard_size=None,
                     quantization: str | None = None, **overrides) -> Path:
    """Write a deterministic GPT-OSS checkpoint directory in the public BF16 release layout.

    ``directory``: created if needed; existing checkpoint files in it are replaced.
    ``preset``: a key of :data:`PRESETS` ("tiny", "tiny-tp2", "120b-rank"). ``seed``: int >= 0; every
    tensor is drawn from its own ``torch.Generator`` seeded from ``(seed, name)``, so the same seed
    (and torch version) gives byte-identical safetensors and different seeds differ.
    ``tokenizer``: True writes the GPT-OSS tokenizer files (see
    :func:`gptoss_patch.tools.tokenizer.write_tokenizer_files`; needs quicktok-v1), a path uses that
    ``o200k_base.tiktoken``/quicktok ``.vocab`` instead, False writes none.
    ``max_shard_size``: e.g. ``"20MB"`` to shard (``model-0000k-of-0000n.safetensors`` +
    ``model.safetensors.index.json``); default per preset (tiny: one ``model.safetensors``).
    ``overrides``: ``GptOssConfig`` keywords on top of the preset (see :func:`config_for`).
    ``quantization``: ``"mxfp4"`` writes the official MXFP4 layout instead (:func:`quantize_checkpoint_mxfp4`:
    expert weights as ``*_blocks``/``*_scales``, ``quantization_config`` of the releases); None (default) BF16.

    Writes via ``GptOssForCausalLM.save_pretrained(safe_serialization=True)``: ``config.json``
    (with ``torch_dtype: "bfloat16"`` as in the releases; transformers >= 4.56 would write
    ``dtype``), ``generation_config.json`` (bos 199998, eos [200002, 199999, 200012], pad 199999,
    as published), all tensors bf16 (shapes in the module docstring). Returns the directory.
    Raises ``ValueError`` (unknown preset, bad seed or overrides, unknown ``quantization``, an MXFP4 checkpoint
    whose hidden or intermediate size is not a multiple of 32),
    :class:`gptoss_patch.tools.tokenizer.VocabularyError` (no/invalid vocabulary for the tokenizer).
    """
    from transformers import GenerationConfig

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if quantization not in (None, "mxfp4"):
        raise ValueError(f"quantization must be None (BF16) or 'mxfp4', got {quantization!r}")
    spec = _preset(preset)
    config = config_for(preset, **overrides)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is not False and tokenizer is not None:
        from gptoss_patch.tools.tokenizer import o200k_bytes

        o200k_bytes(None if tokenizer is True else tokenizer)  # fail before the expensive part
    model, state = _state_dict(config, seed)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.generation_config = GenerationConfig(
        bos_token_id=199998, do_sample=True, eos_token_id=[200002, 199999, 200012], pad_token_id=199999
    )
    shard = max_shard_size or spec["max_shard_size"] or "1TB"
    # save_pretrained only prunes stale shards of the same naming scheme; a stale model.safetensors
    # next to a new index (or the reverse) would shadow the new weights.
    for stale in directory.glob("model*.safetensors*"):
        if stale.name in ("model.safetensors", "model.safetensors.index.json") or _SHARD.fullmatch(stale.name):
            stale.unlink()
    model.save_pretrained(str(directory), safe_serialization=True, max_shard_size=shard)
    del model
    config_path = directory / "config.json"
    values = json.loads(config_path.read_text())
    values.pop("dtype", None)
    values["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    if quantization == "mxfp4":
        quantize_checkpoint_mxfp4(directory)
    for written in directory.glob("model*.safetensors*"):
        os.chmod(written, 0o644)  # safetensors writes 0600; a checkpoint is read by other users/processes
    if tokenizer is not False and tokenizer is not None:
        from gptoss_patch.tools.tokenizer import write_tokenizer_files

        write_tokenizer_files(directory, None if tokenizer is True else tokenizer)
    return directory


def quantize_checkpoint_mxfp4(directory) -> Path:
    """Turn a BF16 GPT-OSS checkpoint directory into the official MXFP4 layout, in place.

    Per layer ``L`` the expert weights become (shapes of ``openai/gpt-oss-*``; block layout = the BF16 tensor
    transposed, see :mod:`gptoss_patch.kernels.mxfp4`)::

        model.layers.L.mlp.experts.gate_up_proj_blocks   uint8 [E, 2I, H/32, 16]   (from gate_up_proj [E, H, 2I])
        model.layers.L.mlp.experts.gate_up_proj_scales   uint8 [E, 2I, H/32]
        model.layers.L.mlp.experts.down_proj_blocks      uint8 [E, H, I/32, 16]    (from down_proj [E, I, H])
        model.layers.L.mlp.experts.down_proj_scales      uint8 [E, H, I/32]

    quantized by :func:`gptoss_patch.kernels.mxfp4.quantize` (our writer; the tests check it against transformers'
    dequantizer); biases and every other tensor stay bf16. ``config.json`` gets :data:`MXFP4_QUANTIZATION_CONFIG`;
    a sharded checkpoint's ``model.safetensors.index.json`` is rewritten with the new names. Returns the directory.

    Raises:
        ValueError: a hidden or intermediate size that is not a multiple of 32.
    """
    from safetensors.torch import load_file, save_file

    from gptoss_patch.kernels.mxfp4 import quantize

    directory = Path(directory)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in sorted(directory.glob("model*.safetensors")):
        tensors = load_file(str(path))
        out = {}
        for name, tensor in tensors.items():
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                blocks, scales = quantize(tensor.transpose(1, 2))
                out[name + "_blocks"], out[name + "_scales"] = blocks, scales
                if index is not None:
                    shard = index["weight_map"].pop(name)
                    index["weight_map"][name + "_blocks"] = index["weight_map"][name + "_scales"] = shard
            else:
                out[name] = tensor
        save_file(out, str(path), metadata={"format": "pt"})
    if index is not None:
        index["metadata"]["total_size"] = sum(os.path.getsize(p) for p in directory.glob("model*.safetensors"))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_path = directory / "config.json"
    values = json.loads(config_path.read_text())
    values["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    config_path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return directory


if __name__ == "__main__":  # python -m gptoss_patch.selftest.tiny DIR [PRESET] [SEED]
    import sys

    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m gptoss_patch.selftest.tiny DIR [PRESET] [SEED]; presets:", ", ".join(PRESETS))
        sys.exit(0 if args else 2)
    out = write_checkpoint(args[0], *(args[1:2] or ["tiny"]), *(int(a) for a in args[2:3]))
    print(os.fspath(out))
