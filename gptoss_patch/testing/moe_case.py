"""GPT-OSS MoE test cases: random expert weights in transformers' layout, tokens, and the transformers oracle.

Shared by the MoE and padding cell tests. :func:`reference` runs transformers 4.57's ``GptOssMLP`` (router with
bias, softmax top-4 renormalised, ``gate_up_proj`` interleaved with bias, clamped swigluoai, ``down_proj`` with bias)
holding the weights - the independent oracle for vllm-ascend's MoE layer with our patches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: GPT-OSS experts per token.
TOP_K = 4


@dataclass
class Weights:
    """One GPT-OSS MoE block in transformers' layout, float32."""

    router_w: torch.Tensor  # [E, H]
    router_b: torch.Tensor  # [E]
    w13: torch.Tensor  # [E, H, 2I] gate/up interleaved
    b13: torch.Tensor  # [E, 2I]
    w2: torch.Tensor  # [E, I, H]
    b2: torch.Tensor  # [E, H]

    @property
    def dims(self):
        e, h, two_i = self.w13.shape
        return e, h, two_i // 2

    def rounded(self, dtype):
        """The same weights rounded to ``dtype`` and back to float32 (what a ``dtype`` model holds)."""
        return Weights(*(t.to(dtype).float() for t in (self.router_w, self.router_b, self.w13, self.b13, self.w2,
                                                        self.b2)))


def make_weights(num_experts, hidden, inter, seed, dead_experts=()):
    """Random weights whose gate/up pre-activations often pass the +-7 clamps (std ~4.5). ``dead_experts`` get a
    router bias of -60 so that no token ever routes to them."""
    g = torch.Generator().manual_seed(seed)
    w = Weights(
        router_w=torch.randn(num_experts, hidden, generator=g) * (2.0 / hidden ** 0.5),
        router_b=torch.randn(num_experts, generator=g),
        w13=torch.randn(num_experts, hidden, 2 * inter, generator=g) * (4.0 / hidden ** 0.5),
        b13=torch.randn(num_experts, 2 * inter, generator=g),
        w2=torch.randn(num_experts, inter, hidden, generator=g) * (1.0 / inter ** 0.5),
        b2=torch.randn(num_experts, hidden, generator=g),
    )
    for e in dead_experts:
        w.router_b[e] = -60.0
    return w


def make_tokens(w, num_tokens, seed, dtype=torch.float32, min_gap=0.0):
    """``(num_tokens, H)`` inputs (values exactly representable in ``dtype``), as float32. With ``min_gap`` > 0, rows
    whose 4th/5th largest router logit are closer than ``min_gap`` are redrawn (routing near-ties)."""
    g = torch.Generator().manual_seed(seed)
    e, h, _ = w.dims
    x = torch.randn(num_tokens, h, generator=g).to(dtype).float()
    for _ in range(100):
        if min_gap <= 0 or e <= TOP_K:
            break
        logits = x @ w.router_w.to(dtype).float().T + w.router_b.to(dtype).float()
        top = logits.topk(TOP_K + 1, dim=-1).values
        bad = (top[:, TOP_K - 1] - top[:, TOP_K]) < min_gap
        if not bad.any():
            break
        x[bad] = torch.randn(int(bad.sum()), h, generator=g).to(dtype).float()
    return x


def hf_mlp(w, dtype=torch.float32):
    """transformers' ``GptOssMLP`` holding ``w`` (cast to ``dtype``)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    e, h, i = w.dims
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=TOP_K,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, vocab_size=512)
    mlp = GptOssMLP(cfg)
    with torch.no_grad():
        mlp.router.weight.copy_(w.router_w)
        mlp.router.bias.copy_(w.router_b)
        mlp.experts.gate_up_proj.copy_(w.w13)
        mlp.experts.gate_up_proj_bias.copy_(w.b13)
        mlp.experts.down_proj.copy_(w.w2)
        mlp.experts.down_proj_bias.copy_(w.b2)
    return mlp.to(dtype).eval()


def reference(w, x, dtype=torch.float32):
    """transformers' GPT-OSS MLP output for tokens ``x`` ``(T, H)`` (computed in ``dtype``), as float32."""
    with torch.no_grad():
        out, _ = hf_mlp(w, dtype)(x.to(dtype)[None])
    return out[0].float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (float32)."""
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()
