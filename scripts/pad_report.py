"""Per-rank MoE shapes of gpt-oss-20b / gpt-oss-120b under tensor / expert parallelism, before and after NZ padding.

For each model and parallel layout: the per-rank expert intermediate size ``I``, the NZ-aligned ``I'`` (multiple of
16, :mod:`gptoss_patch.kernels.padding`), the expert weight shapes as vllm-ascend stores them after
``process_weights_after_loading`` (``w13 (E, H, 2I)``, ``w2 (E, I, H)``: the ``(k, n)`` the grouped matmul checks), and
the memory the padding adds per rank: MiB over all layers, % of the rank's expert weights and % of all its weights.

Model facts:

* gpt-oss-120b: 36 layers, 128 experts (top-4), hidden 2880, expert intermediate 2880, 64 query / 8 KV heads of 64,
  vocab 201088 - transformers 4.57.1 ``GptOssConfig`` defaults (docs/upstream.md §8.5).
* gpt-oss-20b: 24 layers, 32 experts (top-4), hidden 2880, intermediate 2880, 64 query / 8 KV heads of 64, vocab
  201088 - NVIDIA Megatron Bridge "GPT OSS" model page (docs.nvidia.com/nemo/megatron-bridge/nightly/models/llm/
  gpt-oss.html: "24 decoder layers, 32 routed experts per layer with top-4 routing, hidden size 2880, FFN hidden size
  2880 (expert layers), 64 query heads, 8 key-value groups, vocab size 201,088") and the openai/gpt-oss-20b fields
  read from the Hugging Face API by github.com/ParagEkbote/hf-model-inspector ``model_inspection_report.md`` (hidden
  2880, 24 layers, 64 heads, intermediate 2880, 8 KV heads). The original ``huggingface.co/openai/gpt-oss-20b``
  ``config.json`` itself was not reachable from here.

Per-rank weights (bf16, vLLM 0.11 sharding): embedding and LM head vocab-parallel (``V / TP``); q/k/v/o split by
heads (``max(1, KV / TP)`` KV heads: replicated beyond TP 8), their biases likewise (o_proj bias: full ``H`` on every
rank); sinks ``Nq / TP``; norms and router replicated; experts ``(E, 2I, H) + (E, 2I) + (E, H, I) + (E, H)`` with
``E`` = all experts and ``I = 2880 / TP`` without expert parallelism, ``E / TP`` experts and ``I = 2880`` with it.

Usage::

    python scripts/pad_report.py [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from gptoss_patch.kernels.padding import expert_bytes, moe_rank_layout

MIB = 1024 * 1024


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    experts: int
    hidden: int = 2880
    intermediate: int = 2880
    q_heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088


MODELS = (Model("gpt-oss-20b", layers=24, experts=32), Model("gpt-oss-120b", layers=36, experts=128))

#: (tensor-parallel size, expert parallel)
LAYOUTS = [(1, False), (2, False), (4, False), (8, False), (16, False), (2, True), (4, True), (8, True), (16, True)]


def non_expert_bytes(m: Model, tp: int) -> int:
    """bf16 bytes of everything but the experts on one rank (see the module docstring for the sharding)."""
    h, d = m.hidden, m.head_dim
    q = m.q_heads // tp * d
    kv = max(1, m.kv_heads // tp) * d
    attn = (q + 2 * kv) * h + (q + 2 * kv) + h * q + h + m.q_heads // tp  # qkv w+b, o w+b, sinks
    per_layer = attn + 2 * h + m.experts * h + m.experts  # + 2 norms + router (replicated)
    return 2 * (m.layers * per_layer + 2 * (m.vocab // tp) * h + h)


def rows():
    out = []
    for m in MODELS:
        for tp, ep in LAYOUTS:
            lay = moe_rank_layout(m.experts, m.hidden, m.intermediate, tp, 1, ep)
            before = expert_bytes(lay.shapes()) * m.layers
            after = expert_bytes(lay.shapes(padded=True)) * m.layers
            total = before + non_expert_bytes(m, tp)
            e, h, i, ip = lay.experts, lay.hidden, lay.intermediate, lay.target
            out.append({
                "model": m.name, "layout": f"TP{tp}" + (" EP" if ep else ""), "experts/rank": e, "I/rank": i,
                "I'": ip if lay.padded else "-",
                "w13 (E,H,2I)": f"({e}, {h}, {2 * i})" + (f" -> ({e}, {h}, {2 * ip})" if lay.padded else ""),
                "w2 (E,I,H)": f"({e}, {i}, {h})" + (f" -> ({e}, {ip}, {h})" if lay.padded else ""),
                "experts MiB/rank": f"{before / MIB:,.1f}",
                "overhead MiB": f"{(after - before) / MIB:,.1f}",
                "% experts": f"{100 * (after - before) / before:.2f}",
                "% all weights": f"{100 * (after - before) / total:.2f}",
            })
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    table = rows()
    cols = list(table[0])
    if args.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join("---" for _ in cols) + "|")
        for r in table:
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")
        return 0
    widths = {c: max(len(c), *(len(str(r[c])) for r in table)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in table:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    print("\nPadding applies only where I' is shown (I/rank not a multiple of 16), and only when vllm-ascend casts the "
          "bf16 experts to FRACTAL_NZ\n(0.11.0: with eagle/eagle3 speculative decoding; 0.11.0rc1/rc2, 0.12.0rc1: by "
          "default; 0.13+: VLLM_ASCEND_ENABLE_NZ=2).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
