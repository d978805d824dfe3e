"""The trained harmony model with one GPT-OSS capability removed, and its greedy accuracy on the task.

Each ablation is what a stack that ignores the capability computes (``docs/patches.md``: the upstream failure each
patch exists for), applied to transformers' float32 ``GptOssForCausalLM`` (transformers ``models/gpt_oss/
modeling_gpt_oss.py``, 4.57):

* ``no_sinks``: the attention sinks dropped (every sink logit ``-inf``: a plain softmax);
* ``plain_swiglu``: ``silu(gate) * up`` instead of GPT-OSS's clamped ``swigluoai`` (``gate * sigmoid(1.702 gate)`` with
  the clamp at 7 and ``up + 1``);
* ``no_bias``: the experts' ``gate_up_proj_bias`` and ``down_proj_bias`` dropped;
* ``full_everywhere``: full attention in every layer (the sliding window ignored);
* ``band129``: the sliding layers attend 129 keys (``pre_tokens = sliding_window`` with sparse mode 4 on the native
  releases, docs/operators.md) instead of 128;
* ``yarn_truncate``: YaRN's correction range rounded (``truncate: true``) although the config says ``false``.

:func:`accuracy` decodes greedily and judges with :func:`gptoss_patch.selftest.harmony.judge_tokens`.
"""

from __future__ import annotations

ABLATIONS = ("no_sinks", "plain_swiglu", "no_bias", "full_everywhere", "band129", "yarn_truncate")
STOP = (200002, 200012)


def load(checkpoint, ablation: str | None = None):
    """transformers' float32 model of ``checkpoint`` (eager attention) with ``ablation`` (one of
    :data:`ABLATIONS`, or None) applied. Raises ValueError for an unknown ablation."""
    import torch
    from transformers import GptOssForCausalLM
    from transformers.models.gpt_oss import modeling_gpt_oss as M

    if ablation not in (None, *ABLATIONS):
        raise ValueError(f"unknown ablation {ablation!r}: use one of {', '.join(ABLATIONS)}")
    model = GptOssForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    layers = model.model.layers
    if ablation == "no_sinks":
        for layer in layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))
    elif ablation == "no_bias":
        for layer in layers:
            layer.mlp.experts.gate_up_proj_bias.data.zero_()
            layer.mlp.experts.down_proj_bias.data.zero_()
    elif ablation == "plain_swiglu":
        def plain_forward(self, hidden_states, router_indices=None, routing_weights=None):
            b = hidden_states.shape[0]
            h = hidden_states.reshape(-1, self.hidden_size)
            gu = torch.einsum("nh,ehi->eni", h, self.gate_up_proj) + self.gate_up_proj_bias[:, None, :]
            act = torch.nn.functional.silu(gu[..., ::2]) * gu[..., 1::2]
            out = torch.einsum("eni,eih->enh", act, self.down_proj) + self.down_proj_bias[:, None, :]
            return torch.einsum("enh,ne->nh", out, routing_weights).view(b, -1, self.hidden_size)
        for layer in layers:
            layer.mlp.experts.forward = plain_forward.__get__(layer.mlp.experts)
    elif ablation == "full_everywhere":
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        for layer in layers:
            layer.attention_type = "full_attention"
            layer.self_attn.sliding_window = None
    elif ablation == "band129":
        cfg.sliding_window += 1
        for layer in layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = cfg.sliding_window
    elif ablation == "yarn_truncate":
        cfg.rope_scaling = dict(cfg.rope_scaling, truncate=True)
        model.model.rotary_emb = M.GptOssRotaryEmbedding(config=cfg)
    return model


def greedy(model, prompt: list[int], max_new: int = 64) -> list[int]:
    """Greedy continuation of ``prompt`` up to and with ``<|return|>`` / ``<|call|>``. ``model``: a transformers
    model from :func:`load`, or any object with ``greedy(prompt, max_new, stop)`` (OpenAI's reference,
    :class:`gptoss_patch_testkit.openai_reference.OpenAIReference`)."""
    import torch

    if prompt and prompt[-1] in STOP:
        return []
    if hasattr(model, "greedy"):
        return model.greedy(prompt, max_new, STOP)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(STOP), pad_token_id=199999)
    return out[0, len(prompt):].tolist()


def answer_tokens(model, item: dict) -> tuple[list[int], list[int] | None]:
    """The greedy answer of ``model`` (as :func:`greedy` takes it) to ``item``: (first turn, second turn after the
    tool result or None).

    Exact and cheap: one forward pass over the reference conversation; while every assistant argmax equals the
    reference token, greedy decoding reproduces the reference (by induction); from the first difference on, the
    continuation is generated."""
    import torch

    from gptoss_patch.selftest import harmony

    meta, toks, mask = item["meta"], item["tokens"], item["mask"]
    pos = [j - 1 for j in range(1, len(toks)) if mask[j]]
    if hasattr(model, "argmax_at"):  # OpenAI's reference (gptoss_patch_testkit.openai_reference)
        pred = model.argmax_at(toks, pos)
    else:
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([toks])).last_hidden_state[0, pos]
            pred = dict(zip(pos, model.lm_head(hidden).argmax(-1).tolist()))
    first_diff = next((j for j in range(1, len(toks)) if mask[j] and pred[j - 1] != toks[j]), None)
    p1 = meta["p1"]
    end1 = p1 + len(meta["gen_ref1"])
    if meta["kind"] != "tool":
        if first_diff is None:
            return toks[p1:], None
        prefix = toks[:first_diff] + [pred[first_diff - 1]]
        return prefix[p1:] + greedy(model, prefix, max(4, len(toks) - first_diff + 12)), None
    p2 = end1 + len(meta["tool_tokens"]) + 2
    if first_diff is None:
        return toks[p1:end1], toks[p2:]
    if first_diff < end1:
        prefix = toks[:first_diff] + [pred[first_diff - 1]]
        first = prefix[p1:] + greedy(model, prefix, max(4, end1 - first_diff + 12))
        second = greedy(model, harmony.second_prompt_ids(item, first), len(toks) - end1 + 12) \
            if first and first[-1] == harmony.SPECIAL["call"] else None
        return first, second
    prefix = toks[:first_diff] + [pred[first_diff - 1]]
    return toks[p1:end1], prefix[p2:] + greedy(model, prefix, max(4, len(toks) - first_diff + 12))


def accuracy(model, items: list[dict]) -> tuple[float, list[tuple[bool, str]]]:
    """Share of ``items`` ``model`` answers right (greedy), and (right, reason) per item."""
    from gptoss_patch.selftest import harmony

    verdicts = [harmony.judge_tokens(it, *[t for t in answer_tokens(model, it) if t is not None]) for it in items]
    return sum(v[0] for v in verdicts) / max(1, len(verdicts)), verdicts
