"""OpenAI's own GPT-OSS reference implementation as a second oracle: ``gpt_oss/torch/model.py`` of the ``gpt-oss``
distribution on PyPI (0.0.9), in float32, on a checkpoint in Hugging Face's layout (issue 29).

Nobody here wrote that code: its attention (``sdpa``: the sinks concatenated to the logits, the band
``tril(-inf, diagonal=-sliding_window)`` - 128 keys), its ``swiglu`` (clamp 7, ``alpha`` 1.702, ``x_linear + 1``), its
MoE (top-k softmax, both biases) and its YaRN (``_compute_concentration_and_inv_freq``, no rounding of the ramp) are
OpenAI's. transformers' GPT-OSS (``modeling_gpt_oss.py``) is the first oracle; the two agree here on every task item.

What this module adds, and nothing else:

* :func:`load`: the reference's ``ModelConfig`` from the checkpoint's ``config.json`` (:data:`CONFIG_MAP`), its
  ``Transformer`` built on the CPU, every parameter filled from the Hugging Face tensors by :func:`reference_tensors`
  (the names of ``gpt_oss/torch/weights.py``'s ``original/`` layout; ``qkv`` is ``q|k|v`` stacked, the experts'
  matrices transposed), then ``.float()``. OpenAI's ``Checkpoint`` loader reads only its own ``original/`` layout with
  MXFP4 experts, which a BF16 checkpoint does not have: the weights are copied into the parameters as its
  ``from_checkpoint`` does (``param.data.copy_``).
* :class:`OpenAIReference`: greedy decoding with the reference's modules (``embedding``, ``block``, ``norm``,
  ``unembedding``: ``Transformer.forward`` step by step, unembedding only the rows asked for - a row-wise linear map,
  so the logits are the same, at a fraction of the cost), in the interface of :mod:`gptoss_patch_testkit.ablations`
  (``argmax_at``, ``greedy``), so :func:`gptoss_patch_testkit.ablations.accuracy` scores it on the task.

The ``gpt-oss`` wheel declares ``Requires-Python >= 3.12`` for its tools (``chz``, ``docker``, ...); its torch code runs
on 3.11. The unit venv and the 0.11.0 cell (the demo) install it with ``--no-deps --python-version 3.12``
(``noxfile.py`` :data:`OPENAI_REFERENCE_STEP`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

__all__ = ["CONFIG_MAP", "available", "reference_tensors", "load", "OpenAIReference"]

#: The reference's ``ModelConfig`` field -> how to read it from a Hugging Face GPT-OSS ``config.json``.
CONFIG_MAP = {
    "num_hidden_layers": ("num_hidden_layers",),
    "num_experts": ("num_local_experts",),
    "experts_per_token": ("num_experts_per_tok",),
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "swiglu_limit": ("swiglu_limit",),
    "head_dim": ("head_dim",),
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "sliding_window": ("sliding_window",),
    "initial_context_length": ("rope_scaling", "original_max_position_embeddings"),
    "rope_theta": ("rope_theta",),
    "rope_scaling_factor": ("rope_scaling", "factor"),
    "rope_ntk_alpha": ("rope_scaling", "beta_slow"),
    "rope_ntk_beta": ("rope_scaling", "beta_fast"),
}


def available() -> bool:
    """True when OpenAI's ``gpt_oss.torch.model`` imports here."""
    try:
        import gpt_oss.torch.model  # noqa: F401
    except ImportError:
        return False
    return True


def _config(hf: dict) -> dict:
    """The reference's ``ModelConfig`` keyword arguments from a Hugging Face ``config.json`` dict.

    Raises:
        ValueError: the checkpoint is not one the reference computes as written: not ``gpt_oss``, layers not
            alternating sliding / full starting with sliding (the reference windows the even layers), or YaRN with
            ``truncate`` other than false (the reference never rounds the ramp).
    """
    if hf.get("model_type") != "gpt_oss":
        raise ValueError(f"model_type {hf.get('model_type')!r}: OpenAI's reference computes gpt_oss only")
    kinds = hf.get("layer_types") or []
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])]
    if kinds and kinds != want:
        raise ValueError(f"layer_types {kinds}: OpenAI's reference windows exactly the even layers ({want})")
    if (hf.get("rope_scaling") or {}).get("truncate", True) is not False:
        raise ValueError("rope_scaling.truncate is not false: OpenAI's reference never rounds YaRN's correction range")
    out = {}
    for field, path in CONFIG_MAP.items():
        value: Any = hf
        for key in path:
            if not isinstance(value, dict) or key not in value:
                raise ValueError(f"config.json has no {'.'.join(path)} (the reference's {field})")
            value = value[key]
        out[field] = value
    return out


def reference_tensors(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The reference's parameters (``gpt_oss/torch/model.py`` names) from Hugging Face GPT-OSS tensors.

    ``hf``: ``{name: tensor}`` in transformers' layout (``model.layers.{n}.self_attn.q_proj.weight`` ``[heads * 64,
    hidden]``, ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * I]`` with gate/up interleaved on the last dimension,
    ``down_proj`` ``[E, I, hidden]``, ...). Returns the same values, not copied where no reshaping is needed:
    ``attn.qkv`` = ``q | k | v`` stacked on dim 0 (weights and biases), ``mlp1_weight`` = ``gate_up_proj``
    transposed to ``[E, 2 * I, hidden]`` (the interleaving kept: the reference's ``swiglu`` reads ``x[..., ::2]`` as the
    gate, as transformers does), ``mlp2_weight`` = ``down_proj`` transposed to ``[E, hidden, I]``.

    Raises:
        KeyError: a tensor the reference needs is missing (its Hugging Face name).
    """
    import torch

    out = {"embedding.weight": hf["model.embed_tokens.weight"], "norm.scale": hf["model.norm.weight"],
           "unembedding.weight": hf["lm_head.weight"]}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        out[f"block.{n}.attn.norm.scale"] = hf[p + "input_layernorm.weight"]
        out[f"block.{n}.attn.qkv.weight"] = torch.cat([hf[a + f"{x}_proj.weight"] for x in "qkv"], dim=0)
        out[f"block.{n}.attn.qkv.bias"] = torch.cat([hf[a + f"{x}_proj.bias"] for x in "qkv"], dim=0)
        out[f"block.{n}.attn.out.weight"] = hf[a + "o_proj.weight"]
        out[f"block.{n}.attn.out.bias"] = hf[a + "o_proj.bias"]
        out[f"block.{n}.attn.sinks"] = hf[a + "sinks"]
        m = p + "mlp."
        out[f"block.{n}.mlp.norm.scale"] = hf[p + "post_attention_layernorm.weight"]
        out[f"block.{n}.mlp.gate.weight"] = hf[m + "router.weight"]
        out[f"block.{n}.mlp.gate.bias"] = hf[m + "router.bias"]
        out[f"block.{n}.mlp.mlp1_weight"] = hf[m + "experts.gate_up_proj"].transpose(-1, -2)
        out[f"block.{n}.mlp.mlp1_bias"] = hf[m + "experts.gate_up_proj_bias"]
        out[f"block.{n}.mlp.mlp2_weight"] = hf[m + "experts.down_proj"].transpose(-1, -2)
        out[f"block.{n}.mlp.mlp2_bias"] = hf[m + "experts.down_proj_bias"]
    return out


def write_original(checkpoint: str | Path) -> Path:
    """Write ``original/`` into an MXFP4 GPT-OSS checkpoint directory in Hugging Face's layout, as the official
    repositories ship it beside their Hugging Face files (``openai/gpt-oss-20b``/``-120b``: ``original/config.json``,
    ``original/dtypes.json``, ``original/model.safetensors``): OpenAI's configuration (:data:`CONFIG_MAP`) and
    tensor names (``gpt_oss/torch/weights.py``: ``block.{n}.mlp.mlp1_weight.blocks`` / ``.scales`` for the MXFP4
    experts, the rest as :func:`reference_tensors` names them), the same values.

    A loader that reads only the top-level ``*.safetensors`` (vLLM's, transformers') must ignore it; one that
    globbed recursively would meet a second copy of every weight under other names. ``original/config.json`` is
    written where :func:`_config` maps the Hugging Face configuration (transformers 4.x files; not the
    ``rope_parameters`` that transformers 5 writes). Returns the ``original/`` path.

    Raises:
        KeyError: a tensor is missing (its Hugging Face name); ValueError: the checkpoint is not MXFP4.
    """
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    if (hf_config.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        raise ValueError(f"{checkpoint} is not an MXFP4 checkpoint (config.json quantization_config.quant_method)")
    hf: dict[str, Any] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        hf.update(load_file(str(shard)))
    layers = hf_config["num_hidden_layers"]
    experts = {}
    for n in range(layers):
        m = f"model.layers.{n}.mlp.experts."
        for ours, theirs in (("gate_up_proj", "mlp1_weight"), ("down_proj", "mlp2_weight")):
            for part in ("blocks", "scales"):
                experts[f"block.{n}.mlp.{theirs}.{part}"] = hf.pop(f"{m}{ours}_{part}")
            # reference_tensors reads the BF16 matrices: zero-size stand-ins, dropped again below
            hf[m + ours] = torch.empty(0, 0, 0)
    out = {k: v.contiguous() for k, v in reference_tensors(hf, layers).items()
           if not k.endswith(("mlp1_weight", "mlp2_weight"))}
    out.update(experts)
    original = checkpoint / "original"
    original.mkdir(exist_ok=True)
    save_file(out, str(original / "model.safetensors"))
    try:  # transformers 5 writes rope_parameters, whose fields the reference's configuration is not mapped from
        (original / "config.json").write_text(json.dumps(_config(hf_config), indent=2) + "\n")
    except ValueError:
        pass  # the tensors still stand beside the Hugging Face files, which is what a loader must ignore
    (original / "dtypes.json").write_text(json.dumps({k: str(v.dtype).removeprefix("torch.") for k, v in out.items()},
                                                     indent=2) + "\n")
    return original


class OpenAIReference:
    """OpenAI's ``Transformer`` (float32, CPU) with the decoding interface of :mod:`gptoss_patch_testkit.ablations`.

    Attributes:
        model: the ``gpt_oss.torch.model.Transformer``.
    """

    def __init__(self, model: Any):
        self.model = model

    def _hidden(self, tokens: list[int]):
        """``Transformer.forward`` up to and with the final norm: ``[len(tokens), hidden]`` float32."""
        import torch

        with torch.inference_mode():
            x = self.model.embedding(torch.as_tensor(tokens, dtype=torch.int32))
            for block in self.model.block:
                x = block(x)
            return self.model.norm(x)

    def argmax_at(self, tokens: list[int], positions: Iterable[int]) -> dict[int, int]:
        """The greedy next token after each of ``positions`` (0-based indices into ``tokens``): ``{pos: token id}``,
        from one forward pass over ``tokens``."""
        import torch

        positions = list(positions)
        hidden = self._hidden(tokens)[positions]
        with torch.inference_mode():
            return dict(zip(positions, self.model.unembedding(hidden).argmax(-1).tolist()))

    def greedy(self, prompt: list[int], max_new: int, stop: Iterable[int]) -> list[int]:
        """Greedy continuation of ``prompt`` (token ids) up to ``max_new`` tokens, ending with the first of ``stop``
        (as ``TokenGenerator.generate`` at temperature 0: the whole sequence again at each step, argmax of the last
        row)."""
        stop = set(stop)
        tokens, out = list(prompt), []
        while len(out) < max_new:
            nxt = self.argmax_at(tokens, [len(tokens) - 1])[len(tokens) - 1]
            tokens.append(nxt)
            out.append(nxt)
            if nxt in stop:
                break
        return out


def load(checkpoint: str | Path) -> OpenAIReference:
    """OpenAI's reference model of the Hugging Face GPT-OSS checkpoint directory ``checkpoint`` (``config.json`` and
    BF16 ``*.safetensors``), in float32 on the CPU.

    Raises:
        ImportError: ``gpt-oss`` is not installed (``noxfile.py`` :data:`OPENAI_REFERENCE_STEP` installs it).
        ValueError: the configuration is not one the reference computes as written (:func:`_config`), or a
            parameter's shape differs from the tensor mapped to it (names both).
        KeyError: a tensor is missing from the checkpoint.
    """
    import torch
    from gpt_oss.torch.model import ModelConfig, Transformer
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    config = ModelConfig(**_config(json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))))
    hf: dict[str, Any] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        hf.update(load_file(str(shard)))
    tensors = reference_tensors(hf, config.num_hidden_layers)
    model = Transformer(config=config, device=torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint gives {tuple(value.shape)}, the reference expects "
                                 f"{tuple(param.shape)}")
            param.data = value.to(torch.float32).clone()
    return OpenAIReference(model.float())
