#!/usr/bin/env python3
"""Train the tiny harmony GPT-OSS of :mod:`gptoss_patch.selftest.harmony` on the CPU, deterministically from a seed.

    python scripts/train_harmony.py train [--out gptoss_patch/selftest/data/harmony_tiny.safetensors] [--seed 0]
    python scripts/train_harmony.py evaluate [--items 150] [--ablations]

``train`` renders the task (:class:`gptoss_patch.selftest.harmony.Task`: 3000 training items, half of them short,
150 held-out items), trains a compact model (the ~390 vocabulary rows the task uses plus one ``rest`` row whose logit
carries ``log(201088 - used)``: exact for the full-vocabulary softmax when every unused row is a copy of the rest
row), rounds the weights to bf16 and writes them (:data:`gptoss_patch.selftest.harmony.WEIGHTS`, ~0.5 MB), then
expands them into a full checkpoint and prints the greedy accuracy through transformers. It prints the time each
part took. ``evaluate`` expands the committed weights and prints the greedy accuracy of the patched model and, with
``--ablations``, of each capability removed (:mod:`gptoss_patch_testkit.ablations`).

The compact model re-implements transformers' GptOssForCausalLM forward (4.57 ``modeling_gpt_oss.py``: sinks as an
extra softmax column, the 128-key window on layer 0, YaRN with ``truncate: false``, top-k routing with softmax over
the chosen logits, clamped ``swigluoai`` with ``up + 1``, both expert biases) with dense experts for speed.
Recipe: :data:`DEFAULT_INIT`, AdamW (0.9, 0.95), lr 3e-3, 30 warm-up steps then cosine to 10 %, clip 1.0, batch 16
(length-bucketed, seeded order), 1600 steps, float32, ``torch.use_deterministic_algorithms``, 2 threads. Same seed, thread count and
torch build: byte-identical weights (the thread count changes float summation order).
Needs torch, transformers, safetensors, openai-harmony and the o200k vocabulary (prepared offline here from
PyPI ``quicktok-v1`` by :func:`gptoss_patch.tools.tokenizer.prepare`). History of the recipe: research/harmony/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "testkit")]

from gptoss_patch.selftest import harmony, tiny  # noqa: E402

VOCAB_SIZE = harmony.VOCAB_SIZE
WINDOW = harmony.WINDOW
KINDS = harmony.KINDS
COMMON = tiny.COMMON
MODEL = dict(harmony.PRESET, experts_per_token=harmony.PRESET["num_experts_per_tok"])


def make_dataset(seed, n_train, n_eval, short_share=0.5):
    """Training items (canonical and chat renderings, 60 % with the decoy at exactly 128, ``short_share`` short)
    and the held-out items of :func:`harmony.eval_items`; ``used_ids``: every id they contain."""
    task = harmony.Task()
    items = {"train": [], "eval": []}
    for split, n in (("train", n_train), ("eval", n_eval)):
        rng = random.Random(f"harmony-task:{seed}:{split}")
        for i in range(n):
            kind = KINDS[i % 3]
            exact = True if split == "eval" else rng.random() < 0.6
            short = split == "train" and rng.random() < short_share
            items[split].append(task.make(rng, kind, exact, short,
                                          harmony.EVAL_VARIANT if split == "eval" else None))
    used = sorted({t for s in items.values() for it in s for t in it["tokens"]} | set(harmony.SPECIAL.values()))
    return {"seed": seed, "used_ids": used, **items}


def yarn_inv_freq(truncate=False, head_dim=64):
    import torch
    rs = COMMON["rope_scaling"]
    base, dim, factor = COMMON["rope_theta"], head_dim, rs["factor"]
    omax = rs["original_max_position_embeddings"]
    attention_factor = 0.1 * math.log(factor) + 1.0
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def corr(nrot):
        return (dim * math.log(omax / (nrot * 2 * math.pi))) / (2 * math.log(base))
    low, high = corr(rs["beta_fast"]), corr(rs["beta_slow"])
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    ext_factor = 1 - ramp
    return inter * (1 - ext_factor) + extra * ext_factor, attention_factor


def build_model(n_vocab, n_rest, init, seed):
    import torch
    from torch import nn
    import torch.nn.functional as F

    H, I, L = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    NQ, NKV, D, E, K = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], 64, MODEL["num_local_experts"], \
        MODEL["experts_per_token"]
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]

    class Compact(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)

            def p(*shape, std=1.0, mean=0.0):
                return nn.Parameter(torch.randn(*shape, generator=g) * std + mean)
            self.embed = p(n_vocab + 1, H, std=init["embed"])
            self.layers = nn.ModuleList()
            for _ in range(L):
                m = nn.Module()
                m.ln1, m.ln2 = p(H, std=0.0, mean=1.0), p(H, std=0.0, mean=1.0)
                m.wq, m.bq = p(NQ * D, H, std=init["qk"] / math.sqrt(H)), p(NQ * D, std=0.1)
                m.wk, m.bk = p(NKV * D, H, std=init["qk"] / math.sqrt(H)), p(NKV * D, std=0.1)
                m.wv, m.bv = p(NKV * D, H, std=1 / math.sqrt(H)), p(NKV * D, std=0.02)
                m.wo, m.bo = p(H, NQ * D, std=init["out"] / math.sqrt(NQ * D)), p(H, std=0.02)
                m.sinks = p(NQ, std=init["sink_std"], mean=init["sink_mean"])
                m.wr, m.br = p(E, H, std=init["router"] / math.sqrt(H)), p(E, std=init["router_bias"])
                m.gu = p(E, H, 2 * I, std=init["gate_up"] / math.sqrt(H))
                m.gub = p(E, 2 * I, std=init["gate_up_bias"])
                m.dn = p(E, I, H, std=init["out"] / math.sqrt(I))
                m.dnb = p(E, H, std=init["down_bias"])
                self.layers.append(m)
            self.norm = p(H, std=0.0, mean=1.0)
            self.head = p(n_vocab + 1, H, std=init["head"] / math.sqrt(H))
            if init.get("tie"):  # lm_head rows start as the embedding rows (copying is then easy to learn)
                self.head.data.copy_(self.embed.data * init["head"] / math.sqrt(H))
            self.log_rest = math.log(n_rest)

        @staticmethod
        def rms(x, w):
            x32 = x.float()
            return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))

        def forward(self, ids, abl=()):
            """ids [B,T] compact ids -> logits [B,T,n_vocab+1] (rest logit incl. +log N_rest)."""
            B, T = ids.shape
            dev = ids.device
            inv, scale = yarn_inv_freq(truncate="yarn_truncate" in abl)
            pos = torch.arange(T, device=dev, dtype=torch.float32)
            fr = pos[:, None] * inv.to(dev)[None, :]
            cos, sin = fr.cos() * scale, fr.sin() * scale
            qi = torch.arange(T, device=dev)[:, None]
            ki = torch.arange(T, device=dev)[None, :]
            causal = ki <= qi
            win = 129 if "band129" in abl else WINDOW
            masks = {"full_attention": causal,
                     "sliding_attention": causal if "full_everywhere" in abl else causal & (ki > qi - win)}
            neg = torch.finfo(torch.float32).min
            x = self.embed[ids]
            for li, m in enumerate(self.layers):
                h = self.rms(x, m.ln1)
                q = (h @ m.wq.T + m.bq).view(B, T, NQ, D).transpose(1, 2)
                k = (h @ m.wk.T + m.bk).view(B, T, NKV, D).transpose(1, 2)
                v = (h @ m.wv.T + m.bv).view(B, T, NKV, D).transpose(1, 2)

                def rot(t):
                    a, b = t.chunk(2, dim=-1)
                    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
                q, k = rot(q), rot(k)
                k = k.repeat_interleave(NQ // NKV, dim=1)
                v = v.repeat_interleave(NQ // NKV, dim=1)
                att = (q @ k.transpose(2, 3)) * (D ** -0.5)
                att = att.masked_fill(~masks[layer_types[li]], neg)
                if "no_sinks" in abl:
                    sink = torch.full((B, NQ, T, 1), float("-inf"), device=dev)
                else:
                    sink = m.sinks.view(1, NQ, 1, 1).expand(B, NQ, T, 1)
                comb = torch.cat([att, sink], dim=-1)
                comb = comb - comb.max(dim=-1, keepdim=True).values
                pr = F.softmax(comb, dim=-1)[..., :-1]
                o = (pr @ v).transpose(1, 2).reshape(B, T, NQ * D)
                x = x + o @ m.wo.T + m.bo
                h = self.rms(x, m.ln2).reshape(B * T, H)
                rl = h @ m.wr.T + m.br
                tv, ti = torch.topk(rl, K, dim=-1)
                w = torch.zeros_like(rl).scatter_(1, ti, F.softmax(tv, dim=1))  # [N,E]
                gub = 0 if "no_bias" in abl else m.gub[:, None, :]
                dnb = 0 if "no_bias" in abl else m.dnb[:, None, :]
                gu = torch.einsum("nh,ehi->eni", h, m.gu) + gub
                gate, upv = gu[..., ::2], gu[..., 1::2]
                if "plain_swiglu" in abl:
                    act = F.silu(gate) * upv
                else:
                    gate = gate.clamp(max=7.0)
                    upv = upv.clamp(min=-7.0, max=7.0)
                    act = (upv + 1) * (gate * torch.sigmoid(gate * 1.702))
                out = torch.einsum("eni,eih->enh", act, m.dn) + dnb
                x = x + torch.einsum("enh,ne->nh", out, w).view(B, T, H)
            x = self.rms(x, self.norm)
            logits = x @ self.head.T
            return torch.cat([logits[..., :-1], logits[..., -1:] + self.log_rest], dim=-1)

    return Compact(), layer_types


#: The initialisation (normal std, or mean for sink_mean; "tie": lm_head rows start as the embedding rows). Started
#: with large expert biases and sinks ({"gate_up_bias": 1.5, "down_bias": 1.0, "sink_mean": 4.0, "sink_std": 0.5}
#: via --init) a model keeps its biases and swigluoai load-bearing but loses 9 points (docs/harmony-model.md).
DEFAULT_INIT = dict(embed=1.0, qk=1.0, out=1.0, sink_mean=1.0, sink_std=1.0, router=1.0, router_bias=0.5,
                    gate_up=1.0, gate_up_bias=0.5, down_bias=0.1, head=1.0, tie=1)


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def to_tensors(split, c_of):
    import torch
    out = []
    for it in split:
        ids = torch.tensor([c_of[t] for t in it["tokens"]], dtype=torch.long)
        mask = torch.tensor(it["mask"], dtype=torch.bool)
        out.append((ids, mask))
    return out


def batches(data, bs, steps, seed):
    """Deterministic order: epochs of a seeded permutation; batches of similar length (sorted in a chunk)."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    order = []
    while len(order) < steps * bs:
        order += torch.randperm(len(data), generator=g).tolist()
    out = []
    group = bs * 8  # sort each group of 8 batches by length: little padding, order still seeded
    for g0 in range(0, steps * bs, group):
        idx = sorted(order[g0:g0 + group], key=lambda i: len(data[i][0]))
        chunk = [idx[k:k + bs] for k in range(0, len(idx), bs)]
        perm = torch.randperm(len(chunk), generator=g).tolist()
        out += [chunk[p] for p in perm]
    for s in range(steps):
        yield [data[i] for i in out[s]]


def collate(b, device):
    import torch
    T = max(len(x[0]) for x in b)
    ids = torch.zeros(len(b), T, dtype=torch.long)
    tgt = torch.full((len(b), T), -100, dtype=torch.long)
    for i, (x, m) in enumerate(b):
        ids[i, :len(x)] = x
        t = torch.where(m[1:], x[1:], torch.full_like(x[1:], -100))  # predict token j from position j-1
        tgt[i, :len(x) - 1] = t
    return ids.to(device), tgt.to(device)


def train(ds, steps, bs, lr, init, seed, device="cpu", log_every=50, wd=0.0, warmup=30, log=print):
    import torch
    import torch.nn.functional as F
    used = ds["used_ids"]
    c_of = {t: i for i, t in enumerate(used)}
    n_rest = VOCAB_SIZE - len(used)
    model, _ = build_model(len(used), n_rest, init, seed)
    model.to(device)
    data = to_tensors(ds["train"], c_of)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd, eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    t0 = time.time()
    ntok = 0
    for step, b in enumerate(batches(data, bs, steps, seed)):
        ids, tgt = collate(b, device)
        ntok += ids.numel()
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:5d} loss {loss.item():.4f} {time.time() - t0:7.1f}s {ntok / (time.time() - t0):8.0f} tok/s")
    return model, c_of


def tf_eval(model, ds, c_of, abl=(), device="cpu", bs=32):
    """Teacher-forced: an item is right when every assistant token is the argmax (= greedy reproduces it)."""
    import torch
    data = to_tensors(ds["eval"], c_of)
    right = {k: [0, 0] for k in KINDS}
    with torch.no_grad():
        for i in range(0, len(data), bs):
            b = data[i:i + bs]
            ids, tgt = collate(b, device)
            lg = model(ids, abl)
            lg[..., -1] -= model.log_rest  # greedy over the full vocabulary compares single ids: one rest row
            pred = lg.argmax(-1)
            ok = ((pred == tgt) | (tgt == -100)).all(-1)
            for j, it in enumerate(ds["eval"][i:i + bs]):
                right[it["meta"]["kind"]][0] += int(ok[j])
                right[it["meta"]["kind"]][1] += 1
    tot = sum(v[0] for v in right.values()) / sum(v[1] for v in right.values())
    return tot, {k: v[0] / max(1, v[1]) for k, v in right.items()}


ABLATIONS = ("no_sinks", "plain_swiglu", "no_bias", "full_everywhere", "band129", "yarn_truncate")



def round_bf16_(model):
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())




def write_compact(model, c_of, path, meta):
    """The compact weights under transformers' tensor names (embed / lm_head: used rows then the rest row), bf16,
    plus ``task.used_ids`` (int64): the file :func:`harmony.write_checkpoint` expands."""
    import torch
    from safetensors.torch import save_file

    m = model
    sd = {"model.embed_tokens.weight": m.embed, "lm_head.weight": m.head, "model.norm.weight": m.norm}
    for i, l in enumerate(m.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = l.ln1
        sd[p + "post_attention_layernorm.weight"] = l.ln2
        for n, (w, b) in {"q_proj": (l.wq, l.bq), "k_proj": (l.wk, l.bk), "v_proj": (l.wv, l.bv),
                          "o_proj": (l.wo, l.bo)}.items():
            sd[p + f"self_attn.{n}.weight"], sd[p + f"self_attn.{n}.bias"] = w, b
        sd[p + "self_attn.sinks"] = l.sinks
        sd[p + "mlp.router.weight"], sd[p + "mlp.router.bias"] = l.wr, l.br
        sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"] = l.gu, l.gub
        sd[p + "mlp.experts.down_proj"], sd[p + "mlp.experts.down_proj_bias"] = l.dn, l.dnb
    sd = {k: v.detach().cpu().to(torch.bfloat16).contiguous() for k, v in sd.items()}
    sd["task.used_ids"] = torch.tensor(sorted(c_of, key=c_of.get), dtype=torch.int64)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={k: str(v) for k, v in meta.items()})
    os.chmod(path, 0o644)  # safetensors writes 0600; the file ships in the wheel


def evaluate(weights, n_items, ablations, log=print):
    """Greedy accuracy through transformers of the checkpoint expanded from ``weights`` (and of each ablation)."""
    from gptoss_patch_testkit import ablations as abl

    harmony.WEIGHTS = Path(weights)
    items = harmony.eval_items(n_items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = harmony.write_checkpoint(Path(tmp) / "ckpt", tokenizer=False)
        for a in [None, *(abl.ABLATIONS if ablations else ())]:
            t0 = time.time()
            acc, verdicts = abl.accuracy(abl.load(ckpt, a), items)
            per = {k: sum(v[0] for v, it in zip(verdicts, items) if it["meta"]["kind"] == k)
                   / max(1, sum(it["meta"]["kind"] == k for it in items)) for k in KINDS}
            rows.append((a or "patched", acc, per))
            log(f"{a or 'patched':16s} {acc * 100:5.1f} %  " + "  ".join(f"{k} {v * 100:5.1f}" for k, v in per.items())
                + f"   ({time.time() - t0:.0f} s)")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["train", "evaluate"])
    ap.add_argument("--out", type=Path, default=harmony.WEIGHTS, help="train: where the compact weights go")
    ap.add_argument("--weights", type=Path, default=harmony.WEIGHTS, help="evaluate: the compact weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--items", type=int, default=150, help="held-out items to score")
    ap.add_argument("--ablations", action="store_true", help="evaluate: also each capability removed")
    ap.add_argument("--init", default="{}", help="train: JSON overrides of DEFAULT_INIT (recipe experiments)")
    args = ap.parse_args(argv)
    import torch
    from gptoss_patch.tools import tokenizer

    vocab = tokenizer.prepare(Path(tempfile.gettempdir()) / "gptoss-patch-vocab")
    os.environ.update(vocab.env)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.mode == "evaluate":
        evaluate(args.weights, args.items, args.ablations)
        return 0
    t0 = time.time()
    ds = make_dataset(args.seed, 3000, args.items)
    t1 = time.time()
    print(f"data: {len(ds['train'])} training items, {len(ds['used_ids'])} used ids, {t1 - t0:.1f} s", flush=True)
    model, c_of = train(ds, args.steps, 16, 3e-3, dict(DEFAULT_INIT, **json.loads(args.init)), args.seed,
                        log=lambda s: print(s, flush=True))
    t2 = time.time()
    round_bf16_(model)
    acc, per = tf_eval(model, ds, c_of)
    print(f"train: {t2 - t1:.1f} s; teacher-forced held-out accuracy (bf16 weights) {acc * 100:.1f} % {per}")
    write_compact(model, c_of, args.out, {"seed": args.seed, "steps": args.steps, "threads": args.threads,
                                          "torch": torch.__version__})
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", flush=True)
    t3 = time.time()
    evaluate(args.out, args.items, ablations=False)
    print(f"evaluate: {time.time() - t3:.1f} s; total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
