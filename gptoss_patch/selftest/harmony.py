"""A tiny GPT-OSS that has learned a harmony task, and the task: answers a person can read and judge.

The random tiny checkpoints of :mod:`gptoss_patch.selftest.tiny` prove token identity, but a random model never writes
a well-formed harmony message, so vLLM's reasoning parser, tool parser, structured outputs and streaming never see
real content. This module holds a 2-layer GPT-OSS (the real architecture and tensor names, o200k_harmony vocabulary
of 201088 ids, attention sinks, one 128-token sliding-window layer and one full-attention layer, ``swigluoai`` experts
with both biases, YaRN with ``truncate: false``) trained on a synthetic task rendered in harmony, and the task itself.

**The task** (``Task.make``; deterministic from a seed). A user message states ``Access code for NAME: CODE.``, then
filler words and ``mode: X.`` statements, then a request of one of three kinds:

* ``recall``: ``What is the code of NAME, and the current mode?`` -> final ``NAME has code CODE, mode MODE.``;
* ``json``: the same question plus ``Reply with a JSON object {...}`` -> final ``{"name": .., "code": .., "mode": ..}``;
* ``tool``: ``Look up the order of NAME in the current mode.`` with the ``lookup_order`` function tool -> a
  ``commentary`` call ``to=functions.lookup_order`` with ``{"order_id": CODE, "mode": MODE}``, then, after the
  tool's result ``{"status": S, "days": N}``, the final ``Order CODE is S, N days.``.

Every answer starts with an ``analysis`` message ``Code of NAME: CODE. Current mode: MODE.``. The current mode is the
last ``mode:`` statement inside the 128-token window of the position that writes it; a *decoy* statement stands
exactly 128 tokens before that position in every held-out item (visible to full attention and to a 129-key band, not
to GPT-OSS's window), and in 20 % of the items no statement is inside the window (answer ``none``: attend to nothing,
the sinks' job). The code stands more than 128 tokens before the request, so only the full-attention layer reads it.

Held-out items are rendered as vLLM's chat path renders the same request (:data:`EVAL_VARIANT`); training also saw
harmony's canonical rendering and the second turn as chat clients send it back (``Task._messages``), so the served
model answers through ``/v1/chat/completions`` as through raw token prompts.

**The weights** (:data:`WEIGHTS`, 0.5 MB): only the vocabulary rows the task uses plus one ``rest`` row, made by
``scripts/train_harmony.py`` (deterministic from its seed on the CPU; its log and accuracy in docs/harmony-model.md).
:func:`write_checkpoint` expands them into the public BF16 layout (every unused embedding / ``lm_head`` row a copy of
the ``rest`` row, which is exact: training added ``log(201088 - used)`` to the rest logit) with the real tokenizer files.

Needs ``openai-harmony`` (a vLLM dependency) and the o200k vocabulary offline
(:func:`gptoss_patch.tools.tokenizer.prepare`; ``TIKTOKEN_ENCODINGS_BASE`` must point at it before :func:`encoding`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["WEIGHTS", "PRESET", "KINDS", "TOOL", "JSON_INSTRUCTIONS", "EVAL_VARIANT", "SPECIAL", "WINDOW", "Task",
           "encoding", "eval_items", "parse_answer", "judge", "chat_messages", "chat_tools", "write_checkpoint"]

#: The compact weights (see the module docstring); written by ``scripts/train_harmony.py``.
WEIGHTS = Path(__file__).with_name("data") / "harmony_tiny.safetensors"

#: GptOssConfig values on top of :data:`gptoss_patch.selftest.tiny.COMMON` (TP-2 shardable: 4 : 2 heads, 4 experts).
PRESET = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}

VOCAB_SIZE = 201088
#: harmony's special token ids (o200k_harmony; ``openai_harmony`` ``HARMONY_GPT_OSS``).
SPECIAL = {"return": 200002, "constrain": 200003, "channel": 200005, "start": 200006, "end": 200007,
           "message": 200008, "call": 200012}
#: GPT-OSS's sliding window: a query attends to itself and the 127 tokens before it (128 keys).
WINDOW = 128

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
#: Held-out items are rendered as vLLM's chat path renders a request (the JSON instruction in the user message)
EVAL_VARIANT = {"style": "chat", "dev_instr": False, "turn2": None}



class Task:
    """Renders task items with openai-harmony (``HARMONY_GPT_OSS``).

    ``make(rng, kind, exact128, short=False, variant=None)`` -> ``{"tokens": [int], "mask": [0|1], "meta": {...}}``:
    the whole conversation's token ids (the last ``<|end|>`` as ``<|return|>``), the training loss mask (1 on the
    assistant tokens a model must predict) and what the answer must be (``meta``: kind, name, code, mode, final,
    ``p1`` = prompt length up to and with ``<|start|>assistant``, the layout distances, for tool items the call's
    arguments and the tool result's tokens).

    Raises:
        RuntimeError: the layout did not converge (never for the seeds used here; a new filler list may).
    """

    def __init__(self):
        self.H, self.enc = encoding()
        H = self.H
        self.cfg = H.RenderConversationConfig(auto_drop_analysis=False)
        self._cache = {}
        self.tool = H.ToolDescription.new(TOOL["name"], TOOL["description"], parameters=TOOL["parameters"])

    # --- messages -------------------------------------------------------------------------------------------
    def _system(self, rng, tools, style):
        """vLLM renders the system message itself: the reasoning effort asked for (or harmony's default), today's date,
        and from vLLM 0.13 the commentary channel only when the request has tools (0.11: never). ``style``:
        ``canonical`` (harmony's default channels) or ``chat`` (vLLM's rule, either release)."""
        H = self.H
        date = f"20{rng.randint(25, 27)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        effort = {"low": H.ReasoningEffort.LOW, "medium": H.ReasoningEffort.MEDIUM,
                  "high": H.ReasoningEffort.HIGH}[rng.choice(EFFORTS)]
        content = H.SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(date)
        if style == "chat" and (not tools or rng.random() < 0.3):
            content = content.with_channel_config(H.ChannelConfig.require_channels(["analysis", "final"]))
        return H.Message.from_role_and_content(H.Role.SYSTEM, content)

    def _developer(self, rng, kind, instructions_in_developer, style):
        H = self.H
        tools = kind == "tool" or rng.random() < 0.3
        instructions = JSON_INSTRUCTIONS if kind == "json" and instructions_in_developer else None
        if not tools and instructions is None and not (style == "chat" and rng.random() < 0.6):
            return None  # vLLM 0.11-0.18 always send a developer message, empty without tools; 0.19 only with tools
        content = H.DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        if tools:
            content = content.with_function_tools([self.tool])
        return H.Message.from_role_and_content(H.Role.DEVELOPER, content)

    def _messages(self, rng, kind, user_text, name, code, mode, status, days, variant):
        """Prompt and answer messages. ``variant``: {"style": "canonical"|"chat", "dev_instr": bool,
        "turn2": None | {"analysis": bool, "ctype": str, "recipient": bool}}. ``turn2`` renders the conversation as
        a chat client sends it back after the tool call (vLLM's parse of the assistant's ``tool_calls`` and the
        ``tool`` message): the analysis kept or dropped, the call's content type ``json`` (vLLM) or
        ``<|constrain|>json`` (harmony's own), the tool message with or without ``to=assistant`` (vLLM 0.11)."""
        H = self.H
        A = H.Role.ASSISTANT
        analysis = f"Code of {name}: {code}. Current mode: {mode}"
        system = self._system(rng, kind == "tool", variant["style"])
        msgs_prompt = [m for m in (system, self._developer(rng, kind, variant["dev_instr"], variant["style"]))
                       if m is not None]
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
            t2 = variant.get("turn2")
            args = json.dumps({"order_id": code, "mode": mode}, separators=(", ", ": "))
            answer.append(H.Message.from_role_and_content(A, args).with_channel("commentary")
                          .with_recipient("functions." + TOOL["name"])
                          .with_content_type(t2["ctype"] if t2 else "<|constrain|>json"))
            if t2 and not t2["analysis"]:
                answer.pop(0)
            tool_result = json.dumps({"status": status, "days": days}, separators=(", ", ": "))
            tool_msg = H.Message.from_author_and_content(H.Author.new(H.Role.TOOL, "functions." + TOOL["name"]),
                                                         tool_result).with_channel("commentary")
            if not t2 or t2["recipient"]:
                tool_msg = tool_msg.with_recipient("assistant")
            answer.append(tool_msg)
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
    def make(self, rng, kind, exact128, short=False, variant=None):
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
        if variant is None:  # training: the canonical rendering and the renderings of vLLM's chat path
            variant = {"style": "chat" if rng.random() < 0.6 else "canonical", "dev_instr": rng.random() < 0.3,
                       "turn2": None}
            if kind == "tool" and rng.random() < 0.5:
                variant["turn2"] = {"analysis": rng.random() < 0.5, "ctype": rng.choice(["json", "<|constrain|>json"]),
                                    "recipient": rng.random() < 0.5}
        if kind == "json" and not variant["dev_instr"]:  # a chat client asks in the user message
            request += " " + JSON_INSTRUCTIONS
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
                                                                code, mode, status, days, dict(variant, turn2=None))
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
        if variant["turn2"]:  # the layout above is the canonical one; the same conversation as a client sends it back
            prompt, answer, final, tool_result = self._messages(rng_fixed(sd, 5), kind, user_text, name, code, mode,
                                                                status, days, variant)
        toks, bounds = self._render(prompt + answer)
        assert bounds[len(prompt) - 1] == a0 and bounds[len(prompt) - 2] == up, (bounds, a0, up)
        assert short or req_start - reg_end > WINDOW, (req_start, reg_end)
        # loss mask: tokens predicted inside assistant messages (the first header's <|start|>assistant is prompt)
        mask = [0] * len(toks)
        msgs = prompt + answer
        for k, m in enumerate(msgs):
            if m.author.role != self.H.Role.ASSISTANT or (variant["turn2"] and k != len(msgs) - 1):
                continue  # a second-turn rendering teaches the final answer only
            s, e = (bounds[k - 1] if k else 0), bounds[k]
            prev_assistant = k > 0 and msgs[k - 1].author.role == self.H.Role.ASSISTANT
            s = s if prev_assistant else s + 2  # '<|start|>' 'assistant' after a user/tool message: prompt
            for i in range(s, e):
                mask[i] = 1
        # eval prompts: phase 1 (up to and incl. '<|start|>assistant'), phase 2 (after the tool result)
        p1 = bounds[len(prompt) - 1] + 2
        meta = {"kind": kind, "name": name, "code": code, "mode": mode, "final": final, "q": q, "user": user_text,
                "d_real": None if real is None else q - real, "d_near": None if near is None else q - near, "p1": p1,
                "len": len(toks), "exact128": exact128, "short": short}
        meta["variant"] = variant
        if variant["turn2"]:  # training only
            return {"tokens": toks, "mask": mask, "meta": meta}
        meta["gen_ref1"] = toks[p1:bounds[len(prompt) + 1]] if kind == "tool" else toks[p1:]
        if kind == "tool":
            meta["call_args"] = {"order_id": code, "mode": mode}
            meta["tool_result"] = tool_result
            meta["tool_tokens"] = toks[bounds[len(prompt) + 1]: bounds[len(prompt) + 2]]
        return {"tokens": toks, "mask": mask, "meta": meta}




def _words(rng: random.Random, n: int) -> str:
    """``n`` filler words drawn by ``rng``."""
    return " ".join(rng.choice(FILLER) for _ in range(n))


def rng_fixed(seed, k) -> random.Random:
    """A ``random.Random`` for one part of an item, so that re-laying an item out redraws the same words."""
    return random.Random(f"{seed}:{k}")


def encoding():
    """(``openai_harmony`` module, its ``HARMONY_GPT_OSS`` encoding). The vocabulary must be reachable offline
    (``TIKTOKEN_ENCODINGS_BASE``, see :func:`gptoss_patch.tools.tokenizer.prepare`); harmony raises otherwise."""
    import openai_harmony as H

    return H, H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)


def eval_items(n: int, seed: int = 0, kinds: tuple[str, ...] = ("recall", "json", "tool")) -> list[dict]:
    """The first ``n`` held-out items of ``seed`` (kinds in turn), rendered as vLLM's chat path renders them
    (:data:`EVAL_VARIANT`); the same items ``scripts/train_harmony.py`` scores. Returns ``Task.make`` dicts."""
    task = Task()
    rng = random.Random(f"harmony-task:{seed}:eval")
    items = [task.make(rng, KINDS[i % 3], True, variant=EVAL_VARIANT) for i in range(n)]
    return [it for it in items if it["meta"]["kind"] in kinds]


def local_task_rows(n: int = 12, seed: int = 0) -> list[dict]:
    """The ``recall`` and ``json`` items among :func:`eval_items` ``(n, seed)`` as rows of the accuracy runner's local
    task (:func:`gptoss_patch.tools.eval_accuracy.load_local`): ``{"question": the user message, "answer": the
    expected final message}`` - answered right exactly when :func:`judge` says so (the ``json`` answer as the model
    was trained to write it). ``tests/data/harmony/test.jsonl`` holds ``local_task_rows()``."""
    return [{"question": it["meta"]["user"], "answer": it["meta"]["final"]}
            for it in eval_items(n, seed, kinds=("recall", "json"))]


def prompt_ids(item: dict) -> list[int]:
    """The item's first prompt: token ids up to and with ``<|start|>assistant`` (what a completion continues)."""
    return item["tokens"][:item["meta"]["p1"]]


def second_prompt_ids(item: dict, call: list[int]) -> list[int]:
    """A tool item's second prompt: the first prompt, the generated ``call`` tokens (ending in ``<|call|>``), the
    tool's result message and ``<|start|>assistant``. Raises ValueError for an item that is not a tool item."""
    if item["meta"]["kind"] != "tool":
        raise ValueError(f"{item['meta']['kind']!r} item: only tool items have a second turn")
    return prompt_ids(item) + list(call) + item["meta"]["tool_tokens"] + [SPECIAL["start"], _assistant_id()]


def _assistant_id() -> int:
    return 173781  # o200k 'assistant' (checked by tests/unit/test_harmony_task.py)


def parse_answer(tokens: list[int]) -> list[tuple[str | None, str | None, str]] | None:
    """Messages generated after ``<|start|>assistant``: ``[(channel, recipient, text), ...]``, or None when the
    tokens do not end a turn (``<|return|>`` or ``<|call|>``) or harmony cannot parse them."""
    H, enc = encoding()
    toks = list(tokens)
    if not toks or toks[-1] not in (SPECIAL["return"], SPECIAL["call"]):
        return None
    try:
        msgs = enc.parse_messages_from_completion_tokens(toks, H.Role.ASSISTANT)
    except Exception:  # harmony raises its own HarmonyError (and ValueError) for malformed messages
        return None
    return [(m.channel, m.recipient, "".join(c.text for c in m.content)) for m in msgs]


def judge(item: dict, final: str | None = None, call_name: str | None = None, call_arguments: str | None = None,
          final_after_tool: str | None = None) -> tuple[bool, str]:
    """Is an answer right? For ``recall``: ``final`` equals the expected sentence. ``json``: ``final`` parses as
    JSON equal to ``{"name", "code", "mode"}``. ``tool``: ``call_name`` is ``lookup_order``, ``call_arguments`` is
    JSON valid against the tool's schema and equal to the expected arguments, and ``final_after_tool`` (the answer
    after the tool's result) equals the expected sentence. Returns (right, a one-line reason)."""
    m = item["meta"]
    if m["kind"] == "recall":
        return (final == m["final"], "" if final == m["final"] else f"final {final!r}, expected {m['final']!r}")
    if m["kind"] == "json":
        try:
            obj = json.loads(final or "")
        except ValueError:
            return False, f"final {final!r} is not JSON"
        want = {"name": m["name"], "code": m["code"], "mode": m["mode"]}
        return obj == want, "" if obj == want else f"JSON {obj!r}, expected {want!r}"
    if call_name != TOOL["name"]:
        return False, f"no call of {TOOL['name']} (called {call_name!r})"
    try:
        args = json.loads(call_arguments or "")
    except ValueError:
        return False, f"call arguments {call_arguments!r} are not JSON"
    problem = schema_problem(args, TOOL["parameters"])
    if problem:
        return False, f"call arguments {args!r}: {problem}"
    if args != m["call_args"]:
        return False, f"call arguments {args!r}, expected {m['call_args']!r}"
    if final_after_tool != m["final"]:
        return False, f"final after the tool {final_after_tool!r}, expected {m['final']!r}"
    return True, ""


def judge_tokens(item: dict, first: list[int], second: list[int] | None = None) -> tuple[bool, str]:
    """:func:`judge` of generated token ids: ``first`` after the item's prompt, ``second`` after
    :func:`second_prompt_ids` (tool items)."""
    msgs = parse_answer(first)
    if msgs is None:
        return False, "the first turn is not a complete harmony answer"
    finals = [t for ch, _, t in msgs if ch == "final"]
    calls = [(r, t) for _, r, t in msgs if r and r.startswith("functions.")]
    if item["meta"]["kind"] != "tool":
        return judge(item, final=finals[-1] if finals else None)
    if not calls:
        return False, "no tool call"
    after = parse_answer(second) if second is not None else None
    after_finals = [t for ch, _, t in (after or []) if ch == "final"]
    return judge(item, call_name=calls[-1][0].removeprefix("functions."), call_arguments=calls[-1][1],
                 final_after_tool=after_finals[-1] if after_finals else None)


def schema_problem(value, schema: dict) -> str | None:
    """What makes ``value`` invalid against ``schema`` (jsonschema's message), or None when it is valid."""
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return exc.message
    return None


def chat_tools() -> list[dict]:
    """The task's function tool in the OpenAI chat ``tools`` format."""
    return [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                              "parameters": TOOL["parameters"]}}]


def chat_messages(item: dict) -> list[dict]:
    """The item as an OpenAI chat request's ``messages``: the user message (vLLM renders system and developer)."""
    return [{"role": "user", "content": item["meta"]["user"]}]


def write_checkpoint(directory, tokenizer=True) -> Path:
    """Expand :data:`WEIGHTS` into a GPT-OSS checkpoint directory in the public BF16 layout.

    ``config.json`` from :func:`gptoss_patch.selftest.tiny.config_for` with :data:`PRESET`; embed_tokens and lm_head
    ``[201088, 64]`` bf16 with the used rows from the file and every other row the ``rest`` row; the other tensors as
    stored; ``generation_config.json`` and (``tokenizer``) the tokenizer files as :func:`tiny.write_checkpoint`
    writes them. Byte-identical for the same :data:`WEIGHTS` and torch. Returns the directory.

    Raises:
        FileNotFoundError: :data:`WEIGHTS` is missing (a source checkout without ``gptoss_patch/selftest/data``).
        ValueError: the file's tensors do not fit :data:`PRESET` (names or shapes; the message names them).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from gptoss_patch.selftest import tiny

    compact = load_file(str(WEIGHTS))
    used = compact.pop("task.used_ids").tolist()
    config = tiny.config_for("tiny", **PRESET)
    model = tiny._meta_model(config)
    state = {}
    for name, value in compact.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = value[-1:].expand(VOCAB_SIZE, value.shape[1]).clone()
            full[torch.tensor(used)] = value[:-1]
            value = full
        state[name] = value.contiguous()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise ValueError(f"{WEIGHTS} does not fit the harmony preset: {diff[:6]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.generation_config = GenerationConfig(bos_token_id=199998, do_sample=True,
                                               eos_token_id=[200002, 199999, 200012], pad_token_id=199999)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True, max_shard_size="1TB")
    path = directory / "config.json"
    values = json.loads(path.read_text())
    values.pop("dtype", None)
    values["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    (directory / "model.safetensors").chmod(0o644)
    if tokenizer:
        from gptoss_patch.tools.tokenizer import write_tokenizer_files

        write_tokenizer_files(directory, None if tokenizer is True else tokenizer)
    return directory
