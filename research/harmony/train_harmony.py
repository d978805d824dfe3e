#!/usr/bin/env python3
"""Train a tiny GPT-OSS (real architecture, o200k_harmony vocabulary) on a synthetic harmony task, on the CPU.

Modes::

    python train_harmony.py data  OUT.pt                # tokenized data set only (for a GPU recipe search)
    python train_harmony.py train CKPT_DIR [--steps N]  # data + training + checkpoint (+ tokenizer files)
    python train_harmony.py evaluate CKPT_DIR           # greedy accuracy through transformers, with ablations
    python train_harmony.py search DATA.pt ...          # (GPU) train/eval variants of the recipe from DATA.pt

Everything is derived from --seed (default 0): the items, the initialisation and the batch order.

The task (one item = one harmony conversation, loss on the assistant tokens only):
  the user message holds a registry ``Name=code`` far (> 128 tokens) before the request, filler text with
  ``mode: X.`` statements, the last of which lies within the last 128 tokens of the position that must read it,
  and *decoy* mode statements just outside the window (one at exactly 128 tokens, so that a 129-key band sees it);
  kinds: ``recall`` (plain final answer), ``json`` (final answer is a JSON object), ``tool`` (a ``lookup_order``
  function call on the commentary channel with JSON arguments, a tool result, then a final answer using it).

Compact vocabulary: the model is trained on the ids the task uses plus one pseudo-row ``rest`` standing for the
other ids; ``log(N_rest)`` is added to the rest logit, which equals full-vocabulary training when every unused
lm_head row is a copy of the rest row (done when the checkpoint is written).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 201088
SPECIAL = {"return": 200002, "constrain": 200003, "channel": 200005, "start": 200006, "end": 200007,
           "message": 200008, "call": 200012}
WINDOW = 128

# ----------------------------------------------------------------------------------------------------------------
# Model shape (GptOssConfig overrides); COMMON values as gptoss_patch/selftest/tiny.py
# ----------------------------------------------------------------------------------------------------------------
MODEL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, experts_per_token=2, num_experts_per_tok=2)
COMMON = {
    "vocab_size": VOCAB_SIZE, "head_dim": 64, "sliding_window": WINDOW, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "swiglu_limit": 7.0, "attention_dropout": 0.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9,
    "output_router_logits": False, "use_cache": True, "initializer_range": 0.02, "eos_token_id": 200002,
    "pad_token_id": 199999, "attention_bias": True,
}

# ----------------------------------------------------------------------------------------------------------------
# The synthetic task
# ----------------------------------------------------------------------------------------------------------------
FILLER = ("river lamp stone cloud garden window paper bridge forest candle market silver winter music valley harbor "
          "yellow morning letter basket ladder orchard meadow engine pocket mirror castle island shadow thunder "
          "village blanket feather kitchen marble pillow rocket saddle tunnel velvet wagon anchor barrel cotton desert "
          "fabric glacier hammer jacket kettle lemon magnet needle ocean pepper rabbit salmon tiger violin walnut").split()
NAMES = ("Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Laura Mike Nina Oscar Paul Quinn Rachel "
         "Steve Tina Victor Wendy Xavier Yusuf Zara Adam Bella Chris Diana Ethan Fiona George").split()
MODES = "fast slow eco turbo quiet silent normal manual auto night day sport none".split()  # 'none': no statement
NONE_SHARE = 0.2  # items without a mode statement inside the window
STATUSES = "shipped packed delayed lost returned pending".split()
CODES = [100 + 22 * i for i in range(40)]  # 40 three-digit numbers (one o200k token each)
EFFORTS = ("low", "medium", "high")
TOOL = {
    "name": "lookup_order",
    "description": "Look up an order by its number.",
    "parameters": {"type": "object",
                   "properties": {"order_id": {"type": "integer"},
                                  "mode": {"type": "string", "enum": MODES}},
                   "required": ["order_id", "mode"]},
}
JSON_INSTRUCTIONS = 'Reply with a JSON object {"name": string, "code": integer, "mode": string}.'
KINDS = ("recall", "json", "tool")


def _harmony():
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(_vocab_dir()))
    import openai_harmony as H
    return H, H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)


def _vocab_dir() -> Path:
    """o200k_base.tiktoken laid out offline from PyPI quicktok-v1 (sha256-checked), no network."""
    d = HERE / ".tok"
    f = d / "o200k_base.tiktoken"
    if not f.is_file():
        import base64, hashlib, importlib.util, struct
        spec = importlib.util.find_spec("quicktok")
        src = next(Path(p) / "data" / "o200k.vocab" for p in spec.submodule_search_locations
                   if (Path(p) / "data" / "o200k.vocab").is_file())
        data = src.read_bytes()
        (count,), off, toks = struct.unpack_from("<I", data, 0), 4, []
        for _ in range(count):
            (n,) = struct.unpack_from("<H", data, off)
            tok = data[off + 2: off + 2 + n]
            (rank,) = struct.unpack_from("<I", data, off + 2 + n)
            toks.append((rank, tok))
            off += 6 + n
        toks.sort()
        text = b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for r, t in toks)
        assert hashlib.sha256(text).hexdigest() == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
        d.mkdir(exist_ok=True)
        tmp = d / f".tmp{os.getpid()}"
        tmp.write_bytes(text)
        os.replace(tmp, f)
    return d


def _words(rng, n):
    return " ".join(rng.choice(FILLER) for _ in range(n))


class Task:
    """Renders items with openai-harmony. ``make(rng, kind, exact128)`` -> dict with tokens, mask, meta."""

    def __init__(self):
        self.H, self.enc = _harmony()
        H = self.H
        self.cfg = H.RenderConversationConfig(auto_drop_analysis=False)
        self._cache = {}
        self.tool = H.ToolDescription.new(TOOL["name"], TOOL["description"], parameters=TOOL["parameters"])

    # --- messages -------------------------------------------------------------------------------------------
    def _system(self, rng):
        H = self.H
        date = f"20{rng.randint(25, 27)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        effort = {"low": H.ReasoningEffort.LOW, "medium": H.ReasoningEffort.MEDIUM,
                  "high": H.ReasoningEffort.HIGH}[rng.choice(EFFORTS)]
        content = H.SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(date)
        return H.Message.from_role_and_content(H.Role.SYSTEM, content)

    def _developer(self, rng, kind):
        H = self.H
        tools = kind == "tool" or rng.random() < 0.3
        instructions = JSON_INSTRUCTIONS if kind == "json" else None
        if not tools and instructions is None:
            return None
        content = H.DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        if tools:
            content = content.with_function_tools([self.tool])
        return H.Message.from_role_and_content(H.Role.DEVELOPER, content)

    def _messages(self, rng, kind, user_text, name, code, mode, status, days):
        H = self.H
        A = H.Role.ASSISTANT
        analysis = f"Code of {name}: {code}. Current mode: {mode}"
        msgs_prompt = [m for m in (self._system(rng), self._developer(rng, kind)) if m is not None]
        msgs_prompt.append(H.Message.from_role_and_content(H.Role.USER, user_text))
        answer = [H.Message.from_role_and_content(A, analysis + ".").with_channel("analysis")]
        if kind == "recall":
            final = f"{name} has code {code}, mode {mode}."
            answer.append(H.Message.from_role_and_content(A, final).with_channel("final"))
            tool_result = None
        elif kind == "json":
            final = json.dumps({"name": name, "code": code, "mode": mode}, separators=(", ", ": "))
            answer.append(H.Message.from_role_and_content(A, final).with_channel("final"))
            tool_result = None
        else:
            args = json.dumps({"order_id": code, "mode": mode}, separators=(", ", ": "))
            answer.append(H.Message.from_role_and_content(A, args).with_channel("commentary")
                          .with_recipient("functions." + TOOL["name"]).with_content_type("<|constrain|>json"))
            tool_result = json.dumps({"status": status, "days": days}, separators=(", ", ": "))
            answer.append(H.Message.from_author_and_content(H.Author.new(H.Role.TOOL, "functions." + TOOL["name"]),
                                                            tool_result).with_channel("commentary")
                          .with_recipient("assistant"))
            final = f"Order {code} is {status}, {days} days."
            answer.append(H.Message.from_role_and_content(A, final).with_channel("final"))
        return msgs_prompt, answer, final, tool_result

    def _tok(self, text):
        if text not in self._cache:
            self._cache[text] = self.enc.encode(text, disallowed_special=())
        return self._cache[text]

    def _render(self, msgs, bounds=True):
        """Tokens of the conversation (analysis kept), boundaries of each message, last <|end|> -> <|return|>."""
        H = self.H
        bounds = [len(self.enc.render_conversation(H.Conversation.from_messages(msgs[:k]), self.cfg))
                  for k in range(1, len(msgs) + 1)] if bounds else None
        toks = list(self.enc.render_conversation(H.Conversation.from_messages(msgs), self.cfg))
        assert toks[-1] == SPECIAL["end"]
        toks[-1] = SPECIAL["return"]
        return toks, bounds

    # --- one item ---------------------------------------------------------------------------------------------
    def make(self, rng, kind, exact128, short=False):
        """One conversation. Long items (all of the evaluation): the access code stands > 128 tokens before the
        request (only the full-attention layers see it); the last mode statement 20..120 tokens before the reading
        position q (the token before the mode in the analysis), the nearest *decoy* statement exactly 128 (exact128)
        or 129..170 tokens before q, other decoys further back; in 20 % of the items there is no statement within
        the window and the answer is 'none'. Short items (a share of the training set): no decoys, fact nearby."""
        H = self.H
        name, code = rng.choice(NAMES), rng.choice(CODES)
        none = rng.random() < NONE_SHARE
        mode = "none" if none else rng.choice(MODES[:-1])
        decoys = [rng.choice([m for m in MODES[:-1] if m != mode]) for _ in range(rng.randint(1, 2))]
        status, days = rng.choice(STATUSES), rng.randint(2, 9)
        fact = f"Access code for {name}: {code}."
        request = {"recall": f"What is the code of {name}, and the current mode?",
                   "json": f"Give the code of {name} and the current mode.",
                   "tool": f"Look up the order of {name} in the current mode."}[kind]
        d_real = rng.randint(20, 120)
        d_near = WINDOW if exact128 else rng.randint(WINDOW + 1, WINDOW + 42)
        n_a = rng.randint(0, 10)
        far = [rng.randint(3, 12) for _ in decoys[1:]]
        sd = rng.random()
        c_words, gap = 3, 5
        mode_tok = self._tok(" " + mode)[0]
        for _ in range(16):
            text = [fact, "Notes:", _words(rng_fixed(sd, 1), n_a)]
            if short:
                text += ([] if none else [f"mode: {mode}."]) + [_words(rng_fixed(sd, 4), c_words), request]
            else:
                for dm, fw in zip(decoys[1:], far):
                    text += [f"mode: {dm}.", _words(rng_fixed(sd, 2 + fw), fw)]
                text += [f"mode: {decoys[0]}.", _words(rng_fixed(sd, 3), gap)]
                text += ([] if none else [f"mode: {mode}."]) + [_words(rng_fixed(sd, 4), c_words), request]
            user_text = " ".join(t for t in text if t)
            prompt, answer, final, tool_result = self._messages(rng_fixed(sd, 5), kind, user_text, name,
                                                                code, mode, status, days)
            toks, _ = self._render(prompt + answer, bounds=False)
            st, u_id, a_id = SPECIAL["start"], self._tok("user")[0], self._tok("assistant")[0]
            up = next(i for i in range(len(toks) - 1) if toks[i] == st and toks[i + 1] == u_id)  # user message
            a0 = next(i for i in range(up, len(toks) - 1) if toks[i] == st and toks[i + 1] == a_id)  # 1st answer
            q = next(i for i in range(a0, len(toks) - 1) if toks[i + 1] == mode_tok)
            if short:
                real = near = None
                break
            reg_end = next(i for i in range(up, a0) if toks[i] == self._tok(".")[0])  # end of the fact
            req_start = a0 - len(self._tok(request)) - 2
            near_tok = self._tok(" " + decoys[0])[0]
            near = max(i for i in range(up, a0) if toks[i] == near_tok)
            real = None if none else max(i for i in range(up, a0) if toks[i] == mode_tok)
            if not none and q - real != d_real:
                if c_words + (d_real - (q - real)) < 0:  # closer than the request allows
                    d_real = q - real - c_words
                    c_words = 0
                else:
                    c_words += d_real - (q - real)
                continue
            if none and q - near != d_near:  # no statement inside the window: place the decoy with the filler
                c_words = max(0, c_words + (d_near - (q - near)))
                if c_words == 0 and q - near > d_near:
                    d_near = q - near
                continue
            if req_start - reg_end <= WINDOW:  # the fact must lie outside the window of the request
                n_a += WINDOW + 1 - (req_start - reg_end)
                continue
            if q - near != d_near:
                gap = gap + (d_near - (q - near))
                if gap < 1:
                    d_real += 1 - gap
                    gap = 1
                continue
            break
        else:
            raise RuntimeError("layout did not converge")
        toks, bounds = self._render(prompt + answer)
        assert bounds[len(prompt) - 1] == a0 and bounds[len(prompt) - 2] == up, (bounds, a0, up)
        assert short or req_start - reg_end > WINDOW, (req_start, reg_end)
        # loss mask: tokens predicted inside assistant messages (the first header's <|start|>assistant is prompt)
        mask = [0] * len(toks)
        msgs = prompt + answer
        for k, m in enumerate(msgs):
            if m.author.role != self.H.Role.ASSISTANT:
                continue
            s, e = (bounds[k - 1] if k else 0), bounds[k]
            prev_assistant = k > 0 and msgs[k - 1].author.role == self.H.Role.ASSISTANT
            s = s if prev_assistant else s + 2  # '<|start|>' 'assistant' after a user/tool message: prompt
            for i in range(s, e):
                mask[i] = 1
        # eval prompts: phase 1 (up to and incl. '<|start|>assistant'), phase 2 (after the tool result)
        p1 = bounds[len(prompt) - 1] + 2
        meta = {"kind": kind, "name": name, "code": code, "mode": mode, "final": final, "q": q,
                "d_real": None if real is None else q - real, "d_near": None if near is None else q - near, "p1": p1,
                "len": len(toks), "exact128": exact128, "short": short}
        meta["gen_ref1"] = toks[p1:bounds[len(prompt) + 1]] if kind == "tool" else toks[p1:]
        if kind == "tool":
            meta["call_args"] = {"order_id": code, "mode": mode}
            meta["tool_result"] = tool_result
            meta["tool_tokens"] = toks[bounds[len(prompt) + 1]: bounds[len(prompt) + 2]]
        return {"tokens": toks, "mask": mask, "meta": meta}


def rng_fixed(seed, k):
    return random.Random(f"{seed}:{k}")


def make_dataset(seed, n_train, n_eval, short_share=0.5):
    task = Task()
    items = {"train": [], "eval": []}
    for split, n in (("train", n_train), ("eval", n_eval)):
        rng = random.Random(f"harmony-task:{seed}:{split}")
        for i in range(n):
            kind = KINDS[i % 3]
            exact = True if split == "eval" else rng.random() < 0.6
            short = split == "train" and rng.random() < short_share
            items[split].append(task.make(rng, kind, exact, short))
    used = sorted({t for s in items.values() for it in s for t in it["tokens"]} | set(SPECIAL.values()))
    return {"seed": seed, "used_ids": used, **items}


# ----------------------------------------------------------------------------------------------------------------
# The compact model: GptOssForCausalLM's math (transformers 4.57 modeling_gpt_oss), dense experts, compact vocab
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------------------------
def hf_config(layer_types):
    from transformers import GptOssConfig
    cfg = dict(COMMON, **MODEL)
    cfg["layer_types"] = layer_types
    c = GptOssConfig(**cfg)
    c.torch_dtype = "bfloat16"
    return c


def write_checkpoint(model, c_of, out_dir, tokenizer=True):
    import torch
    from transformers import GptOssForCausalLM, GenerationConfig
    used = sorted(c_of, key=c_of.get)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(MODEL["num_hidden_layers"])]
    cfg = hf_config(layer_types)
    H = MODEL["hidden_size"]
    idx = torch.tensor(used)
    m = model
    sd = {}

    def full_rows(w):
        full = w[-1:].detach().float().cpu().expand(VOCAB_SIZE, H).clone()
        full[idx] = w[:-1].detach().float().cpu()
        return full
    sd["model.embed_tokens.weight"] = full_rows(m.embed)
    sd["lm_head.weight"] = full_rows(m.head)
    sd["model.norm.weight"] = m.norm
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
    with torch.device("meta"):
        hf = GptOssForCausalLM(cfg)
    missing, unexpected = hf.load_state_dict(sd, strict=True, assign=True)
    hf.config.torch_dtype = torch.bfloat16
    hf.generation_config = GenerationConfig(bos_token_id=199998, eos_token_id=[200002, 199999, 200012],
                                            pad_token_id=199999, do_sample=True, temperature=1.0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size="10GB")
    (out_dir / "task_vocab.json").write_text(json.dumps({"used_ids": used}) + "\n")
    if tokenizer:
        write_tokenizer_files(out_dir)
    return out_dir


def write_tokenizer_files(out_dir):
    """tokenizer.json etc.: gptoss_patch.tools.tokenizer when importable, else the same conversion inline."""
    try:
        from gptoss_patch.tools.tokenizer import write_tokenizer_files as w
        return w(out_dir)
    except ImportError:
        pass
    import tempfile
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    pattern = "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
    named = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
             200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
             200018: "<|endofprompt|>"}
    specials = [named.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)]
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        backend = TikTokenConverter(vocab_file=str(_vocab_dir() / "o200k_base.tiktoken"), pattern=pattern,
                                    additional_special_tokens=specials, extra_special_tokens=specials).converted()
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>",
                                  pad_token="<|endoftext|>", model_input_names=["input_ids", "attention_mask"],
                                  model_max_length=None)
    tok.save_pretrained(str(out_dir))


def round_bf16_(model):
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def check_equivalence(model, c_of, ckpt, items, ablations=("",) + ABLATIONS, log=print):
    """Full-vocabulary transformers forward of the written checkpoint vs the compact model (bf16-rounded weights)."""
    import torch
    used = torch.tensor(sorted(c_of, key=c_of.get))
    worst = 0.0
    for abl in ablations:
        a = (abl,) if abl else ()
        hf = load_hf(ckpt, a)
        for it in items:
            ids = torch.tensor([it["tokens"]])
            with torch.no_grad():
                full = hf(ids).logits[0].float()
                comp = model(torch.tensor([[c_of[t] for t in it["tokens"]]]), a)[0].float()
            err = (full[:, used] - comp[:, :-1]).abs().max().item()
            rest_ids = torch.ones(VOCAB_SIZE, dtype=torch.bool)
            rest_ids[used] = False
            rest_err = (full[:, rest_ids] - (comp[:, -1:] - model.log_rest)).abs().max().item()
            am_full = full.argmax(-1)
            comp_single = comp.clone()
            comp_single[:, -1] -= model.log_rest  # one unused id's logit
            am_comp = comp_single.argmax(-1)
            am_comp_full = torch.where(am_comp < len(used), used[am_comp.clamp(max=len(used) - 1)], -1)
            am_full = torch.where(rest_ids[am_full], -1, am_full)  # any unused id = the rest row
            mask = torch.tensor(it["mask"][1:] + [0], dtype=torch.bool)
            agree = bool((am_full[mask] == am_comp_full[mask]).all())
            worst = max(worst, err, rest_err)
            log(f"  equivalence [{abl or 'patched'}]: max|logit diff| used ids {err:.2e}, rest rows {rest_err:.2e}, "
                f"argmax on assistant tokens {'identical' if agree else 'DIFFERENT'}")
    return worst


# ----------------------------------------------------------------------------------------------------------------
# Evaluation through transformers (greedy), with ablations
# ----------------------------------------------------------------------------------------------------------------
def load_hf(ckpt, abl=()):
    import torch
    from transformers import GptOssForCausalLM
    from transformers.models.gpt_oss import modeling_gpt_oss as M
    model = GptOssForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    if "no_sinks" in abl:
        for l in model.model.layers:
            l.self_attn.sinks.data.fill_(float("-inf"))
    if "no_bias" in abl:
        for l in model.model.layers:
            l.mlp.experts.gate_up_proj_bias.data.zero_()
            l.mlp.experts.down_proj_bias.data.zero_()
    if "plain_swiglu" in abl:
        def plain_forward(self, hidden_states, router_indices=None, routing_weights=None):
            B = hidden_states.shape[0]
            h = hidden_states.reshape(-1, self.hidden_size)
            gu = torch.einsum("nh,ehi->eni", h, self.gate_up_proj) + self.gate_up_proj_bias[:, None, :]
            act = torch.nn.functional.silu(gu[..., ::2]) * gu[..., 1::2]
            out = torch.einsum("eni,eih->enh", act, self.down_proj) + self.down_proj_bias[:, None, :]
            return torch.einsum("enh,ne->nh", out, routing_weights).view(B, -1, self.hidden_size)
        for l in model.model.layers:
            l.mlp.experts.forward = plain_forward.__get__(l.mlp.experts)
    if "full_everywhere" in abl:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        for l in model.model.layers:
            l.attention_type = "full_attention"
            l.self_attn.sliding_window = None
    if "band129" in abl:
        cfg.sliding_window = WINDOW + 1
        for l in model.model.layers:
            if l.self_attn.sliding_window is not None:
                l.self_attn.sliding_window = WINDOW + 1
    if "yarn_truncate" in abl:
        cfg.rope_scaling = dict(cfg.rope_scaling, truncate=True)
        model.model.rotary_emb = M.GptOssRotaryEmbedding(config=cfg)
    return model


def greedy(model, prompt, stop=(200002, 200012), max_new=64):
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(stop), pad_token_id=199999, use_cache=True)
    return out[0, len(prompt):].tolist()


def parse_assistant(enc, H, toks):
    """Messages generated after '<|start|>assistant': list of (channel, recipient, content_type, text)."""
    toks = list(toks)
    if not toks or toks[-1] not in (200002, 200012):
        return None
    try:
        msgs = enc.parse_messages_from_completion_tokens(toks, H.Role.ASSISTANT)
    except Exception:
        return None
    return [(m.channel, m.recipient, m.content_type, "".join(c.text for c in m.content)) for m in msgs]


def _continue(model, prefix, stop=(200002, 200012), max_new=64):
    if prefix[-1] in stop:
        return []
    return greedy(model, prefix, stop, max_new=max_new)


def score_item(model, task, item):
    """Greedy decoding through transformers; returns (right, detail).

    Exact and cheap: one forward pass over prompt + reference answer; where every argmax on the assistant tokens is
    the reference token, greedy decoding reproduces the reference (by induction). At the first difference the
    greedy continuation is generated with the KV cache from there (the prefix is what greedy decoding produced)."""
    import torch
    H, enc = task.H, task.enc
    meta, toks, mask = item["meta"], item["tokens"], item["mask"]
    pos = [j - 1 for j in range(1, len(toks)) if mask[j]]
    with torch.no_grad():  # GptOssForCausalLM.forward = model.model + lm_head; lm_head only where it is needed
        hid = model.model(input_ids=torch.tensor([toks])).last_hidden_state[0, pos]
        am = model.lm_head(hid).argmax(-1).tolist()
    pred = dict(zip(pos, am))
    j = next((j for j in range(1, len(toks)) if mask[j] and pred[j - 1] != toks[j]), None)
    p2 = None
    if meta["kind"] == "tool":
        p2 = meta["p1"] + len(meta["gen_ref1"]) + len(meta["tool_tokens"]) + 2
    if j is None:
        gen1 = meta["gen_ref1"]
        gen2 = toks[p2:] if p2 else None
    elif p2 is None or j < p2:  # (at most 12 tokens more than the reference answer: a longer one is wrong anyway)
        prefix = toks[:j] + [pred[j - 1]]
        end1 = meta["p1"] + len(meta["gen_ref1"])
        gen1 = prefix[meta["p1"]:] + _continue(model, prefix, max_new=max(4, end1 - j + 12))
        gen2 = None
    else:
        gen1 = meta["gen_ref1"]
        prefix = toks[:j] + [pred[j - 1]]
        gen2 = prefix[p2:] + _continue(model, prefix, max_new=max(4, len(toks) - j + 12))
    return _judge(model, task, item, gen1, gen2)


def _judge(model, task, item, gen1, gen2=None):
    H, enc = task.H, task.enc
    meta, toks = item["meta"], item["tokens"]
    msgs = parse_assistant(enc, H, gen1)
    if not msgs:
        return False, {"error": "unparsable", "text": enc.decode(gen1)}
    if meta["kind"] != "tool":
        final = [m for m in msgs if m[0] == "final"]
        if not final:
            return False, {"error": "no final", "text": enc.decode(gen1)}
        text = final[-1][3]
        if meta["kind"] == "json":
            try:
                obj = json.loads(text)
            except ValueError:
                return False, {"error": "invalid json", "text": text}
            return obj == {"name": meta["name"], "code": meta["code"], "mode": meta["mode"]}, {"text": text}
        return text == meta["final"], {"text": text}
    calls = [m for m in msgs if m[1] and m[1].startswith("functions.")]
    if not calls or gen1[-1] != 200012:
        return False, {"error": "no tool call", "text": enc.decode(gen1)}
    ch, rcpt, ctype, args = calls[-1]
    try:
        a = json.loads(args)
    except ValueError:
        return False, {"error": "invalid args json", "text": args}
    schema_ok = (rcpt == "functions." + TOOL["name"] and isinstance(a, dict) and set(a) == {"order_id", "mode"}
                 and isinstance(a.get("order_id"), int) and a.get("mode") in MODES)
    if not schema_ok:
        return False, {"error": "args do not match schema", "text": args}
    if a != meta["call_args"]:
        return False, {"error": "wrong args", "text": args}
    if gen2 is None:  # the call differed from the reference's tokens: phase 2 after the generated call
        prompt2 = toks[:meta["p1"]] + gen1 + meta["tool_tokens"] + [SPECIAL["start"], task._tok("assistant")[0]]
        gen2 = greedy(model, prompt2, max_new=len(toks) - meta["p1"] - len(meta["gen_ref1"]) + 12)
    msgs2 = parse_assistant(enc, H, gen2)
    final = [m for m in (msgs2 or []) if m[0] == "final"]
    if not final:
        return False, {"error": "no final after tool", "text": enc.decode(gen2)}
    return final[-1][3] == meta["final"], {"text": final[-1][3], "args": args}


def evaluate(ckpt, seed, n_eval, ablations=ABLATIONS, show=3, log=print, patched=True):
    task = Task()
    rng = random.Random(f"harmony-task:{seed}:eval")
    items = [task.make(rng, KINDS[i % 3], True) for i in range(n_eval)]
    rows = []
    for abl in ([()] if patched else []) + [(a,) for a in ablations]:
        model = load_hf(ckpt, abl)
        t0 = time.time()
        right = {k: [0, 0] for k in KINDS}
        for j, it in enumerate(items):
            ok, det = score_item(model, task, it)
            right[it["meta"]["kind"]][0] += ok
            right[it["meta"]["kind"]][1] += 1
            if not abl and j < show:
                log(f"  [{it['meta']['kind']}] {'RIGHT' if ok else 'WRONG'} {det}")
        acc = sum(v[0] for v in right.values()) / len(items)
        rows.append((abl[0] if abl else "patched (reference)", acc, {k: v[0] / v[1] for k, v in right.items()},
                     time.time() - t0))
        log(f"{rows[-1][0]:22s} {acc * 100:6.1f} %  " + "  ".join(f"{k} {v * 100:5.1f}" for k, v in rows[-1][2].items())
            + f"   ({rows[-1][3]:.0f}s)")
    return rows


# ----------------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["data", "train", "evaluate", "search", "exp"])
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-eval", type=int, default=150)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short-share", type=float, default=0.5)
    ap.add_argument("--data-cache", default=None, help="exp: data set file (written when absent)")
    ap.add_argument("--ablations", default="", help="evaluate: comma-separated subset of " + ",".join(ABLATIONS))
    ap.add_argument("--skip-patched", action="store_true", help="evaluate: only the ablations")
    ap.add_argument("--check", type=int, default=2, help="train: items for the transformers equivalence check")
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--init", default="{}", help="JSON overrides of DEFAULT_INIT")
    ap.add_argument("--model", default="{}", help="JSON overrides of MODEL")
    ap.add_argument("--variants", default="[]", help="search: JSON list of dicts of overrides")
    args = ap.parse_args(argv)
    MODEL.update(json.loads(args.model))
    import torch
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.mode == "data":
        ds = make_dataset(args.seed, args.n_train, args.n_eval)
        torch.save(ds, args.path)
        lens = [len(it["tokens"]) for it in ds["train"]]
        print(f"wrote {args.path}: {len(ds['train'])} train, {len(ds['eval'])} eval, {len(ds['used_ids'])} ids, "
              f"len {min(lens)}..{max(lens)} mean {sum(lens) / len(lens):.0f}")
    elif args.mode == "search":
        ds = torch.load(args.path, weights_only=False)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        out = Path(os.environ.get("OUT", "."))
        base_model = dict(MODEL)
        for var in json.loads(args.variants):
            v = dict(steps=args.steps, bs=args.bs, lr=args.lr, init={}, model={}, seed=args.seed, device=dev)
            v.update(var)
            MODEL.clear()
            MODEL.update(base_model, **v["model"])
            if v["device"] == "cpu":  # CPU throughput benchmark of the recipe (2 threads)
                torch.set_num_threads(2)
                t0 = time.time()
                train(ds, v["steps"], v["bs"], v["lr"], dict(DEFAULT_INIT, **v["init"]), v["seed"], "cpu",
                      log_every=1)
                res = {"variant": var, "cpu_s_per_step": round((time.time() - t0) / v["steps"], 3)}
                print(json.dumps(res), flush=True)
                with open(out / "search.jsonl", "a") as f:
                    f.write(json.dumps(res) + "\n")
                continue
            init = dict(DEFAULT_INIT, **v["init"])
            t0 = time.time()
            model, c_of = train(ds, v["steps"], v["bs"], v["lr"], init, v["seed"], dev, log_every=max(1, v["steps"] // 4))
            tt = time.time() - t0
            res = {"variant": var, "train_s": round(tt, 1)}
            for abl in [()] + [(a,) for a in ABLATIONS]:
                acc, per = tf_eval(model, ds, c_of, abl, dev)
                res[abl[0] if abl else "patched"] = round(acc, 3)
                res.setdefault("per_kind", per)
            print(json.dumps(res), flush=True)
            with open(out / "search.jsonl", "a") as f:
                f.write(json.dumps(res) + "\n")
    elif args.mode == "exp":  # recipe experiment on this CPU: train, then the compact model's ablations
        ds = torch.load(args.data_cache, weights_only=False) if args.data_cache and os.path.exists(
            args.data_cache) else make_dataset(args.seed, args.n_train, args.n_eval, args.short_share)
        if args.data_cache and not os.path.exists(args.data_cache):
            torch.save(ds, args.data_cache)
        init = dict(DEFAULT_INIT, **json.loads(args.init))
        t1 = time.time()
        model, c_of = train(ds, args.steps, args.bs, args.lr, init, args.seed, log_every=max(1, args.steps // 8))
        tt = time.time() - t1
        res = {"train_s": round(tt, 1), "steps": args.steps, "bs": args.bs, "lr": args.lr, "init": args.init,
               "model": args.model}
        for abl in ("",) + ABLATIONS:
            acc, per = tf_eval(model, ds, c_of, (abl,) if abl else ())
            res[abl or "patched"] = [round(acc, 3)] + [round(per[k], 2) for k in KINDS]
        print(json.dumps(res), flush=True)
    elif args.mode == "train":
        t0 = time.time()
        ds = make_dataset(args.seed, args.n_train, args.n_eval, args.short_share)
        t1 = time.time()
        print(f"data: {len(ds['train'])} train items, {len(ds['used_ids'])} used ids, {t1 - t0:.1f}s")
        init = dict(DEFAULT_INIT, **json.loads(args.init))
        model, c_of = train(ds, args.steps, args.bs, args.lr, init, args.seed)
        t2 = time.time()
        acc, per = tf_eval(model, ds, c_of)
        print(f"train: {t2 - t1:.1f}s; teacher-forced eval accuracy {acc * 100:.1f} % {per}")
        round_bf16_(model)
        acc, per = tf_eval(model, ds, c_of)
        print(f"bf16-rounded weights: teacher-forced eval accuracy {acc * 100:.1f} % {per}")
        write_checkpoint(model, c_of, args.path, tokenizer=not args.no_tokenizer)
        print(f"checkpoint: {args.path} ({time.time() - t2:.1f}s); total {time.time() - t0:.1f}s")
        if args.check:
            check_equivalence(model, c_of, args.path, ds["eval"][:args.check])
    elif args.mode == "evaluate":
        evaluate(args.path, args.seed, args.n_eval,
                 ablations=tuple(args.ablations.split(",")) if args.ablations else ABLATIONS,
                 patched=not args.skip_patched)


if __name__ == "__main__":
    main()
