"""The OpenAI API with real answers: the trained harmony model behind ``vllm serve`` on the simulated NPU.

``python -m gptoss_patch_testkit.jobs.api_job [--mode PIECEWISE|FULL_DECODE_ONLY|eager] [--items N] [--workdir DIR]
[--json]`` in a cell environment. One server (:func:`gptoss_patch.selftest.harmony.write_checkpoint`'s checkpoint,
float32, ``--reasoning-parser openai_gptoss --tool-call-parser openai --enable-auto-tool-choice``) answers all of:

1. **the task through raw completions**: each held-out item's prompt ids (and, for tool items, the second prompt after
   the call the server generated and the tool's result), greedy; transformers' float32 ``GptOssForCausalLM`` decodes
   the same prompts greedily - every token must be equal, and each answer is judged right or wrong
   (:func:`gptoss_patch.selftest.harmony.judge_tokens`), so the accuracy through the server is compared with the
   reference's on the same items;
2. **the task through ``/v1/chat/completions``** as a client sends it (the user message; ``tools`` for tool items,
   then the call and the tool's result sent back): ``reasoning_content`` / ``reasoning``, ``content``,
   ``tool_calls`` with JSON arguments, judged (:func:`gptoss_patch.selftest.harmony.judge`);
3. **API features** (:data:`CHECKS`): ``tool_choice`` ``required`` and named, ``response_format: json_schema`` (the
   task's object, and a schema the model's natural answer violates, which only an applied grammar satisfies),
   streaming (concatenated deltas equal the non-streamed answer) for a plain, a JSON and a tool-call answer,
   ``reasoning_effort`` low / high in the rendered system message, ``/v1/responses`` (the Responses API answers a plain,
   a JSON and a tool item as chat completions does: the same reasoning, the same message text, the same function call),
   ``verify --server`` (exit 0), the accuracy runner (``gptoss-patch-eval --local``, lm-eval, run by the python
   ``GPTOSS_EVAL_PYTHON`` names - a client venv, as users run it) scoring the recall and json items as the chat answers
   are, and last a constrained request batched with plain ones.

Nothing here asserts: the report says what happened; ``tests/cell/test_api.py`` and its native twin assert.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: The API feature checks, in the order run (see the module docstring).
#: ``accuracy_runner`` only where ``GPTOSS_EVAL_PYTHON`` names a python with lm-eval (:data:`EVAL_PYTHON`).
EVAL_PYTHON = os.environ.get("GPTOSS_EVAL_PYTHON") or None
CHECKS = ("tool_choice_required", "tool_choice_named", "json_schema", "json_schema_enforced", "stream_recall",
          "stream_json", "stream_tool", "reasoning_effort_low", "reasoning_effort_high", "responses_recall",
          "responses_json", "responses_tool", "verify_server", *(("accuracy_runner",) if EVAL_PYTHON else ()),
          "json_schema_in_mixed_batch")

def forced_mode_schema(mode: str) -> dict:
    """The task's object with ``mode`` allowed to be ``mode`` only. Asked of an item whose answer has another mode,
    the model's natural answer violates it: content that validates shows the grammar applied (xgrammar's bitmask,
    which vllm-ascend applies to the logits on the host); the natural answer shows it ignored."""
    return {"type": "object", "properties": {"name": {"type": "string"}, "code": {"type": "integer"},
                                             "mode": {"type": "string", "enum": [mode]}},
            "required": ["name", "code", "mode"], "additionalProperties": False}
#: The task's JSON object (what a json item asks for).
TASK_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "code": {"type": "integer"},
                                                 "mode": {"type": "string"}},
               "required": ["name", "code", "mode"], "additionalProperties": False}
#: What the cell tests assert, one test each (:meth:`ApiReport.problems`): the task's tokens and accuracy through the
#: server equal transformers', the chat answers (reasoning and content split, tool round trip) are right, and each of
#: :data:`CHECKS`.
PROPERTIES = ("tokens_equal_transformers", "accuracy_equals_transformers", "chat_answers", "chat_tool_calls", *CHECKS)
#: The least accuracy the trained model must reach on the items served (transformers' greedy accuracy on the 150
#: held-out items is in docs/harmony-model.md; a stack that breaks any capability falls far below).
MIN_ACCURACY = 0.75
STOP = [200002, 200012]  # <|return|>, <|call|>
#: The unpatched stack, let through the start-up guard (docs/operations.md): what the patches are for.
UNPATCHED_ENV = {"GPTOSS_PATCH_DISABLE": "1", "GPTOSS_PATCH_ALLOW_UNPATCHED": "1"}
MODEL = "gpt-oss-tiny"


@dataclass
class ItemResult:
    """One held-out item through raw completions, beside the reference."""

    index: int
    kind: str
    server: list[list[int]] = field(default_factory=list)  # generated ids per turn (tool items: two turns)
    reference: list[list[int]] = field(default_factory=list)
    #: where the row documents a deviation (``ApiReport.expected_ablation``): transformers with that deviation
    expected: list[list[int]] = field(default_factory=list)
    expected_right: bool = False
    server_right: bool = False
    reference_right: bool = False
    server_detail: str = ""
    reference_detail: str = ""
    text: str = ""  # the server's answer, decoded
    #: OpenAI's reference implementation (``gpt_oss/torch/model.py``, float32; empty where ``gpt-oss`` is not
    #: installed: :mod:`gptoss_patch_testkit.openai_reference`), greedy on the same prompts
    openai: list[list[int]] = field(default_factory=list)
    openai_right: bool = False

    @property
    def tokens_equal(self) -> bool:
        """The server's tokens equal the reference's (or, on a row with a documented deviation, the deviated
        reference's)."""
        return bool(self.server) and self.server == (self.expected or self.reference)


@dataclass
class ChatResult:
    """One held-out item through ``/v1/chat/completions``."""

    index: int
    kind: str
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    content_after_tool: str | None = None
    right: bool = False
    detail: str = ""


@dataclass
class ApiReport:
    mode: str
    #: an :data:`gptoss_patch_testkit.ablations.ABLATIONS` name: the deviation the row documents (``band129`` where
    #: the matrix says the attention capability *deviates*); the server must then equal transformers with it
    expected_ablation: str | None = None
    started: bool = False
    items: list[ItemResult] = field(default_factory=list)
    chats: list[ChatResult] = field(default_factory=list)
    checks: dict[str, dict] = field(default_factory=dict)  # name -> {"ok": bool, "detail": str}
    seconds: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    log_path: str = ""
    log_tail: str = ""

    @property
    def log_text(self) -> str:
        """The server's whole output."""
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""

    def problems(self, prop: str) -> list[str]:
        """What is wrong with property ``prop`` (one of :data:`PROPERTIES`); empty when it holds.

        Raises:
            ValueError: an unknown property.
        """
        if prop not in PROPERTIES:
            raise ValueError(f"unknown property {prop!r}: use one of {', '.join(PROPERTIES)}")
        if not self.started:
            return [f"the server did not start: {self.error}\n{self.log_tail}"]
        if self.error:
            return [f"the job failed: {self.error}"]
        if prop == "tokens_equal_transformers":
            who = f"transformers with {self.expected_ablation}" if self.expected_ablation else "transformers"
            return [f"item {r.index} ({r.kind}): server {r.server} != {who} {r.expected or r.reference}"
                    for r in self.items if not r.tokens_equal] or ([] if self.items else ["no items"])
        if prop == "accuracy_equals_transformers":
            out = []
            want = "expected" if self.expected_ablation else "reference"
            if self.accuracy("server") != self.accuracy(want):
                out.append(f"accuracy through the server {self.accuracy('server'):.3f} != transformers' "
                           f"{self.accuracy(want):.3f}" + (f" (with {self.expected_ablation})"
                                                           if self.expected_ablation else ""))
            if self.accuracy("reference") < MIN_ACCURACY:
                out.append(f"transformers' accuracy {self.accuracy('reference'):.3f} < {MIN_ACCURACY}: the trained "
                           "model does not answer the task")
            return out
        if prop == "chat_answers":
            out = [f"chat item {c.index} ({c.kind}): empty reasoning" for c in self.chats if not c.reasoning]
            out += [f"chat item {c.index} ({c.kind}): neither content nor a tool call" for c in self.chats
                    if not (c.content or c.tool_calls)]
            # on a row with a documented deviation the accuracy is what the deviation leaves (tokens_equal_transformers
            # holds the server to transformers with it); elsewhere the chat path must answer as well as the task allows
            if not self.expected_ablation and self.accuracy("chat") < MIN_ACCURACY:
                out.append(f"chat accuracy {self.accuracy('chat'):.3f} < {MIN_ACCURACY}: "
                           + "; ".join(f"{c.index} {c.kind}: {c.detail}" for c in self.chats if not c.right))
            return out
        if prop == "chat_tool_calls":
            tools = [c for c in self.chats if c.kind == "tool"]
            out = [f"chat item {c.index}: {c.detail}" for c in tools
                   if not c.tool_calls or "not JSON" in c.detail or "no call" in c.detail]
            return out + [f"chat item {c.index}: no answer after the tool's result" for c in tools
                          if c.tool_calls and not c.content_after_tool]
        check = self.checks.get(prop)
        if check is None:
            return [f"{prop} did not run"]
        return [] if check["ok"] else [f"{prop}: {check['detail']}"]

    def accuracy(self, who: str) -> float:
        """Share of items right through ``"server"`` (raw completions), ``"reference"`` (transformers), ``"expected"``
        (the deviated reference), ``"openai"`` (OpenAI's reference implementation) or ``"chat"``."""
        rows = self.chats if who == "chat" else self.items
        if not rows:
            return 0.0
        attr = {"chat": "right", "server": "server_right", "reference": "reference_right",
                "expected": "expected_right", "openai": "openai_right"}[who]
        ok = [getattr(r, attr) for r in rows]
        return sum(ok) / len(ok)


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url}: HTTP {exc.code}: {exc.read()[:800]!r}") from None


def complete_ids(url: str, prompt: list[int], max_tokens: int = 64) -> list[int]:
    """Greedy ``/v1/completions`` of token ids, stopping at ``<|return|>`` / ``<|call|>``: the generated ids (the stop
    token included, as harmony's parser wants it)."""
    d = _post(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                        "stop_token_ids": STOP, "skip_special_tokens": False,
                                        "return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    c = d["choices"][0]
    ids = c.get("token_ids") or [int(t.split(":", 1)[1]) for t in (c.get("logprobs") or {}).get("tokens", [])]
    return list(ids)


def reference_greedy(model, prompt: list[int], max_tokens: int = 64) -> list[int]:
    """transformers' greedy continuation (float32), stopping at ``<|return|>`` / ``<|call|>`` (included)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=STOP, pad_token_id=199999)
    return out[0, len(prompt):].tolist()


def _reasoning(message) -> str | None:
    extra = getattr(message, "model_extra", None) or {}
    return extra.get("reasoning_content") or extra.get("reasoning") or getattr(message, "reasoning_content", None)


def _calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in (message.tool_calls or [])]


def chat_item(client, item: dict, **extra) -> ChatResult:
    """One item through chat completions (greedy), the tool round trip included; judged."""
    from gptoss_patch.selftest import harmony

    m = item["meta"]
    res = ChatResult(index=-1, kind=m["kind"])
    messages = harmony.chat_messages(item)
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=96, **extra)
    if m["kind"] == "tool":
        kw.setdefault("tools", harmony.chat_tools())
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    res.reasoning, res.content, res.tool_calls = _reasoning(msg), msg.content, _calls(msg)
    if m["kind"] != "tool":
        res.right, res.detail = harmony.judge(item, final=res.content)
        return res
    if not res.tool_calls:
        res.detail = f"no tool call (content {res.content!r})"
        return res
    call = res.tool_calls[0]
    back = messages + [
        {"role": "assistant", "content": None, "reasoning_content": res.reasoning, "reasoning": res.reasoning,
         "tool_calls": [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": m["tool_result"]}]
    r2 = client.chat.completions.create(model=MODEL, messages=back, temperature=0, max_tokens=64,
                                        tools=harmony.chat_tools())
    res.content_after_tool = r2.choices[0].message.content
    res.right, res.detail = harmony.judge(item, call_name=call["name"], call_arguments=call["arguments"],
                                          final_after_tool=res.content_after_tool)
    return res


#: Streamed runs of one item before its check fails (see ``run_checks``' ``stream``: vLLM's harmony streaming parser
#: with multi-token deltas, vllm#27641 / vllm#31501).
STREAM_ATTEMPTS = 3


def stream_item(client, item: dict) -> dict:
    """The first turn of ``item`` streamed: concatenated reasoning, content and tool-call name/arguments."""
    from gptoss_patch.selftest import harmony

    kw = dict(model=MODEL, messages=harmony.chat_messages(item), temperature=0, max_tokens=96, stream=True)
    if item["meta"]["kind"] == "tool":
        kw["tools"] = harmony.chat_tools()
    reasoning, content, calls = [], [], {}
    for chunk in client.chat.completions.create(**kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = _reasoning(d)
        if r:
            reasoning.append(r)
        if d.content:
            content.append(d.content)
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
    return {"reasoning": "".join(reasoning) or None, "content": "".join(content) or None,
            "tool_calls": [calls[k] for k in sorted(calls)]}


def _check(report: ApiReport, name: str, fn) -> None:
    try:
        ok, detail = fn()
    except Exception as exc:  # a check that raises failed; the job goes on with the others
        ok, detail = False, f"{type(exc).__name__}: {str(exc)[:600]}"
    report.checks[name] = {"ok": bool(ok), "detail": detail}


def run_checks(report: ApiReport, client, url: str, items: list[dict]) -> None:
    """The :data:`CHECKS` against the running server (fills ``report.checks``)."""
    from gptoss_patch.selftest import harmony

    by_kind = {k: next(it for it in items if it["meta"]["kind"] == k) for k in harmony.KINDS}
    tool_item, json_item, recall_item = by_kind["tool"], by_kind["json"], by_kind["recall"]

    def tool_choice(choice):
        def fn():
            r = client.chat.completions.create(model=MODEL, messages=harmony.chat_messages(tool_item), temperature=0,
                                               max_tokens=96, tools=harmony.chat_tools(), tool_choice=choice)
            calls = _calls(r.choices[0].message)
            if not calls:
                return False, f"no tool_calls; content {r.choices[0].message.content!r}"
            try:
                args = json.loads(calls[0]["arguments"])
            except ValueError:
                return False, f"arguments {calls[0]['arguments']!r} are not JSON"
            problem = harmony.schema_problem(args, harmony.TOOL["parameters"])
            return (calls[0]["name"] == harmony.TOOL["name"] and problem is None,
                    f"{calls[0]['name']}({calls[0]['arguments']}){' - ' + problem if problem else ''}")
        return fn

    def json_schema(schema, name):
        def fn():
            r = client.chat.completions.create(
                model=MODEL, messages=harmony.chat_messages(json_item), temperature=0, max_tokens=96,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}})
            content = r.choices[0].message.content
            try:
                value = json.loads(content or "")
            except ValueError:
                return False, f"content {content!r} is not JSON"
            problem = harmony.schema_problem(value, schema)
            return problem is None, f"{content}{' - ' + problem if problem else ''}"
        return fn

    def non_streamed(item, whole):
        if item["meta"]["kind"] == "tool":
            r = client.chat.completions.create(model=MODEL, messages=harmony.chat_messages(item), temperature=0,
                                               max_tokens=96, tools=harmony.chat_tools())
            msg = r.choices[0].message
            return {"reasoning": _reasoning(msg), "content": msg.content,
                    "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in _calls(msg)]}
        return {"reasoning": whole.reasoning, "content": whole.content, "tool_calls": []}

    def stream(item):
        def fn():
            whole = chat_item(client, item) if item["meta"]["kind"] != "tool" else None
            plain = non_streamed(item, whole)
            # vLLM's harmony streaming (openai_gptoss + openai parsers) parses each delta as it comes; when the server
            # coalesces several tokens into one delta - a client or a host too slow to take them one by one - it can
            # misroute or drop a tool call's pieces (vllm#27641, vllm#31501; fix proposed in vllm#35449). So a streamed
            # answer that differs is streamed again, up to STREAM_ATTEMPTS times, and every differing attempt is shown.
            tries = []
            for _ in range(STREAM_ATTEMPTS):
                tries.append(stream_item(client, item))
                if tries[-1] == plain:
                    break
            same = tries[-1] == plain and bool(plain["content"] or plain["tool_calls"])
            earlier = "".join(f" (attempt {i + 1} streamed {t})" for i, t in enumerate(tries[:-1]))
            return same, f"streamed {tries[-1]} / non-streamed {plain}{earlier}"
        return fn

    def effort(level):
        def fn():
            d = _post(url + "/v1/chat/completions", {
                "model": MODEL, "messages": harmony.chat_messages(recall_item), "max_tokens": 1, "temperature": 0,
                "reasoning_effort": level, "return_token_ids": True})
            prompt = d.get("prompt_token_ids") or d["choices"][0].get("prompt_token_ids")
            if prompt is None:
                return False, "no prompt_token_ids in the answer"
            _, enc = harmony.encoding()
            text = enc.decode(prompt)
            line = f"Reasoning: {level}"
            return line in text, f"{line!r} {'in' if line in text else 'NOT in'} the rendered system message"
        return fn

    _check(report, "tool_choice_required", tool_choice("required"))
    _check(report, "tool_choice_named", tool_choice({"type": "function", "function": {"name": harmony.TOOL["name"]}}))
    _check(report, "json_schema", json_schema(TASK_SCHEMA, "answer"))
    other = next(m for m in ("eco", "turbo", "quiet") if m != json_item["meta"]["mode"])
    _check(report, "json_schema_enforced", json_schema(forced_mode_schema(other), "forced_mode"))
    _check(report, "stream_recall", stream(recall_item))
    _check(report, "stream_json", stream(json_item))
    _check(report, "stream_tool", stream(tool_item))
    _check(report, "reasoning_effort_low", effort("low"))
    _check(report, "reasoning_effort_high", effort("high"))

    def responses(item):
        """``POST /v1/responses`` (vLLM's harmony path, ``serving_responses.py``) with the item's user message (and the
        task's tool in the Responses format): its ``reasoning`` item, ``message`` text and ``function_call`` equal the
        chat completion of the same item (``report.chats``, greedy, the same budget), and the answer is not empty."""
        def fn():
            chat = report.chats[items.index(item)]
            kw = dict(model=MODEL, input=item["meta"]["user"], temperature=0, max_output_tokens=96)
            if item["meta"]["kind"] == "tool":
                kw["tools"] = [{"type": "function", **t["function"]} for t in harmony.chat_tools()]
            r = client.responses.create(**kw)
            got = {"reasoning": "".join(c.text for o in r.output if o.type == "reasoning" for c in (o.content or [])),
                   "content": "".join(c.text for o in r.output if o.type == "message" for c in o.content
                                      if c.type == "output_text"),
                   "tool_calls": [{"name": o.name, "arguments": o.arguments} for o in r.output
                                  if o.type == "function_call"]}
            want = {"reasoning": chat.reasoning or "", "content": chat.content or "",
                    "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in chat.tool_calls]}
            return got == want and bool(got["content"] or got["tool_calls"]), f"responses {got} / chat {want}"
        return fn

    _check(report, "responses_recall", responses(recall_item))
    _check(report, "responses_json", responses(json_item))
    _check(report, "responses_tool", responses(tool_item))

    def verify_server():
        """``python -m gptoss_patch.verify --server URL`` (the operations kit's probe) exits 0 against this model."""
        import subprocess

        run = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--server", url], capture_output=True,
                             text=True, timeout=300)
        if run.returncode == 0:
            return True, "exit 0"
        return False, f"exit {run.returncode}: {run.stdout[-1500:]}{run.stderr[-500:]}"

    _check(report, "verify_server", verify_server)

    def accuracy_runner():
        """``gptoss-patch-eval --local`` (lm-eval's exact match through its chat client) on the recall and json items
        (:func:`harmony.local_task_rows`, tests/data/harmony/test.jsonl) scores what the chat answers above score: the
        share of answers whose content is exactly the expected final message."""
        import subprocess
        import tempfile

        rows = harmony.local_task_rows(len(items))
        content = {it["meta"]["user"]: c.content for it, c in zip(items, report.chats)}
        want = sum(content[r["question"]] == r["answer"] for r in rows) / len(rows)
        with tempfile.TemporaryDirectory(prefix="gptoss-eval-") as work:
            data = Path(work) / "local.jsonl"
            data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            run = subprocess.run([EVAL_PYTHON, "-m", "gptoss_patch.tools.eval_accuracy", "--server", url, "--model",
                                  MODEL, "--local", str(data), "--max-tokens", "96", "--concurrency", "4",
                                  "--workdir", str(Path(work) / "eval"), "--json"],
                                 capture_output=True, text=True, timeout=600)
        if run.returncode:
            return False, f"exit {run.returncode}: {run.stdout[-1500:]}{run.stderr[-1500:]}"
        out = json.loads(run.stdout[run.stdout.rindex("\n{") + 1:])  # the last top-level object: the results
        task = out["tasks"]["gptoss_local"]
        score = task["scores"]["none"][0]
        return (task["n"] == len(rows) and score == want,
                f"lm-eval exact_match {score:.3f} on {task['n']} items; chat content exact {want:.3f} on {len(rows)}; "
                f"answer sources {out['answer_sources']}")

    if EVAL_PYTHON:
        _check(report, "accuracy_runner", accuracy_runner)

    def mixed_batch():
        """A constrained request batched with plain ones (vLLM then hands xgrammar the constrained rows' indices).
        Last: on a pairing that crashes (vLLM >= 0.12 passes the indices as a tensor, xgrammar < 0.1.30's CPU kernel
        takes a list) the engine dies here."""
        import concurrent.futures

        plain = dict(model=MODEL, messages=harmony.chat_messages(recall_item), temperature=0, max_tokens=48)
        schema = forced_mode_schema(other)
        constrained = dict(model=MODEL, messages=harmony.chat_messages(json_item), temperature=0, max_tokens=96,
                           response_format={"type": "json_schema", "json_schema": {"name": "forced_mode",
                                                                                   "schema": schema}})
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(client.chat.completions.create, **kw) for kw in (plain, constrained, plain)]
            answers = [f.result().choices[0].message.content for f in futures]
        try:
            problem = harmony.schema_problem(json.loads(answers[1] or ""), schema)
        except ValueError:
            problem = "not JSON"
        return problem is None and all(answers), f"answers {answers}{' - ' + problem if problem else ''}"

    _check(report, "json_schema_in_mixed_batch", mixed_batch)


def ensure_checkpoint(workdir: Path) -> Path:
    """The harmony checkpoint under ``workdir``, keyed by :data:`harmony.WEIGHTS`, the writer's code and transformers'
    major version (tokenizer files saved by transformers 5 name a class 4.x lacks: cells of both share the workdir);
    written into a temporary directory and renamed, so a reader never sees half a checkpoint."""
    import hashlib
    import os
    import shutil
    import tempfile

    from gptoss_patch.selftest import harmony
    from gptoss_patch_testkit.jobs.main_job import _writer_key

    h = hashlib.sha256(harmony.WEIGHTS.read_bytes())
    h.update(Path(harmony.__file__).read_bytes())
    ckpt = workdir / f"harmony-{h.hexdigest()[:12]}-{_writer_key()}"
    if not (ckpt / "tokenizer_config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".harmony-", dir=workdir))
        try:
            harmony.write_checkpoint(tmp)
            os.replace(tmp, ckpt)
        except OSError:  # another process renamed its copy first: keep that one
            if not (ckpt / "tokenizer_config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


def run(workdir: Path, mode: str = "PIECEWISE", n_items: int = 12, extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None, startup_timeout: float = 900.0, checks: bool = True,
        expected_ablation: str | None = None) -> ApiReport:
    """Run the job once (never raises for a server that fails: ``report.error`` and ``log_tail`` say why).

    ``n_items``: held-out items (kinds in turn). ``extra_env`` / ``extra_args``: more server environment / arguments
    (:data:`UNPATCHED_ENV` shows the unpatched stack). ``checks``: also run :data:`CHECKS`. ``expected_ablation``:
    the deviation the matrix documents for this row (``band129``): transformers with it is what the server must equal,
    transformers without it stays the reference the accuracy is judged against."""
    import openai
    import torch
    from transformers import GptOssForCausalLM

    from gptoss_patch import environment
    from gptoss_patch.selftest import harmony
    from gptoss_patch.tools import tokenizer
    from gptoss_patch_testkit.jobs import serve_job

    report = ApiReport(mode=mode, expected_ablation=expected_ablation)
    v = environment.installed_versions()
    report.versions = {"vllm": str(v.vllm), "vllm_ascend": str(v.vllm_ascend)}
    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer.prepare(workdir / "vocab")
    import os

    os.environ.update(vocab.env)
    ckpt = ensure_checkpoint(workdir)
    items = harmony.eval_items(n_items)
    report.seconds["prepare"] = time.perf_counter() - t0
    port = serve_job.free_port()
    cmd = serve_job.serve_command(ckpt, port, mode, extra=["--tool-call-parser", "openai",
                                                           "--enable-auto-tool-choice", *(extra_args or [])])
    # vLLM's compile caches off, as for jobs/plain_models: vLLM 0.12's AOT cache handed this model's second start a
    # graph compiled for another shape ("_npu_rotary_embedding: 4 is not a multiple of head_size 64" at the profile run)
    env = serve_job.serve_env(vocab.env, VLLM_DISABLE_COMPILE_CACHE="1", **(extra_env or {}))
    log = workdir / f"api-server-{mode}-{os.getpid()}.log"
    report.log_path = str(log)
    with serve_job.Server(cmd, env, log, port) as server:
        t1 = time.perf_counter()
        report.started = server.wait_ready(startup_timeout)
        report.seconds["startup"] = time.perf_counter() - t1
        if not report.started:
            report.error = "the server did not come up"
            report.log_tail = server.log()[-6000:]
            return report
        try:
            # the items are independent requests: sent 4 at a time (the server's --max-num-seqs), as clients do, so
            # the engine decodes them in one batch (a tool item's second turn follows its first in the same thread)
            import concurrent.futures

            def turns(it):
                first = complete_ids(server.url, harmony.prompt_ids(it))
                if it["meta"]["kind"] != "tool":
                    return [first]
                return [first, complete_ids(server.url, harmony.second_prompt_ids(it, first))]

            t2 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for i, (it, done) in enumerate(zip(items, pool.map(turns, items))):
                    report.items.append(ItemResult(index=i, kind=it["meta"]["kind"], server=done))
            report.seconds["completions"] = time.perf_counter() - t2
            t3 = time.perf_counter()
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for i, c in enumerate(pool.map(lambda it: chat_item(client, it), items)):
                    c.index = i
                    report.chats.append(c)
            report.seconds["chat"] = time.perf_counter() - t3
            t4 = time.perf_counter()
            if checks:
                run_checks(report, client, server.url, items)
            report.seconds["checks"] = time.perf_counter() - t4
        except Exception:
            report.error = traceback.format_exc()[-3000:]
        report.log_tail = server.log()[-4000:]
    t5 = time.perf_counter()
    from gptoss_patch_testkit import ablations, openai_reference

    reference = ReferenceCache(workdir, ckpt, "transformers",
                               lambda: GptOssForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval())
    _, enc = harmony.encoding()
    for res, it in zip(report.items, items):
        res.reference.append(reference.greedy(harmony.prompt_ids(it)))
        if res.kind == "tool":
            res.reference.append(reference.greedy(harmony.second_prompt_ids(it, res.reference[0])))
        res.server_right, res.server_detail = harmony.judge_tokens(it, *res.server)
        res.reference_right, res.reference_detail = harmony.judge_tokens(it, *res.reference)
        res.text = enc.decode([t for turn in res.server for t in turn])
    if expected_ablation:
        deviated = ReferenceCache(workdir, ckpt, expected_ablation, lambda: ablations.load(ckpt, expected_ablation))
        for res, it in zip(report.items, items):
            res.expected.append(deviated.greedy(harmony.prompt_ids(it)))
            if res.kind == "tool":
                res.expected.append(deviated.greedy(harmony.second_prompt_ids(it, res.expected[0])))
            res.expected_right = harmony.judge_tokens(it, *res.expected)[0]
        deviated.save()
    reference.save()
    report.seconds["reference"] = time.perf_counter() - t5
    if openai_reference.available():  # the second oracle (installed in the 0.11.0 cell: the demo's)
        t6 = time.perf_counter()
        ref = ReferenceCache(workdir, ckpt, "openai", lambda: openai_reference.load(ckpt), ablations.greedy)
        for res, it in zip(report.items, items):
            res.openai.append(ref.greedy(harmony.prompt_ids(it)))
            if res.kind == "tool":
                res.openai.append(ref.greedy(harmony.second_prompt_ids(it, res.openai[0])))
            res.openai_right = harmony.judge_tokens(it, *res.openai)[0]
        ref.save()
        report.seconds["openai_reference"] = time.perf_counter() - t6
    return report


class ReferenceCache:
    """An oracle's greedy continuations of prompts (:func:`reference_greedy`), cached on disk across cells and runs.

    Greedy tokens of a float32 model are fixed by the checkpoint, the oracle and the library versions, so the cache
    file (``workdir/reference-cache/api-<key>.json``) is keyed by the checkpoint directory (named by the weights and
    the writer's code, :func:`ensure_checkpoint`), ``oracle`` (``"transformers"``, an ablation name or
    ``"openai"``), the transformers and torch versions and the source of this module and of
    :mod:`gptoss_patch_testkit.ablations` / :mod:`gptoss_patch_testkit.openai_reference`; each entry by the prompt's
    ids. ``load()`` builds the oracle only when a prompt is missing; ``decode(model, prompt)`` continues one."""

    def __init__(self, workdir: Path, ckpt: Path, oracle: str, load, decode=None):
        import hashlib

        import torch
        import transformers

        from gptoss_patch_testkit import ablations, openai_reference

        h = hashlib.sha256(f"{Path(ckpt).name}/{oracle}/{transformers.__version__}/{torch.__version__}".encode())
        for module in (sys.modules[__name__], ablations, openai_reference):
            h.update(Path(module.__file__).read_bytes())
        self.path = Path(workdir) / "reference-cache" / f"api-{h.hexdigest()[:16]}.json"
        self.entries: dict[str, list[int]] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self._load, self._decode, self._model, self._dirty = load, decode or reference_greedy, None, False

    def greedy(self, prompt: list[int]) -> list[int]:
        """The oracle's greedy continuation of ``prompt`` (token ids, the stop token included)."""
        import hashlib

        key = hashlib.sha256(json.dumps(list(map(int, prompt))).encode()).hexdigest()[:24]
        if key not in self.entries:
            if self._model is None:
                self._model = self._load()
            self.entries[key] = list(map(int, self._decode(self._model, prompt)))
            self._dirty = True
        return list(self.entries[key])

    def save(self) -> None:
        """Write the cache file if an entry was added (atomically: a reader never sees half a file)."""
        if not self._dirty:
            return
        import os
        import tempfile

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".api-", dir=self.path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.entries, fh)
        os.replace(tmp, self.path)
        self._dirty = False


def print_report(report: ApiReport, out=sys.stdout) -> None:
    """The story a person reads: per conversation the reasoning, the answer, the tool call, right/wrong."""
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"api job ({report.mode}; vllm {report.versions.get('vllm')}, vllm-ascend {report.versions.get('vllm_ascend')})")
    for c in report.chats:
        p(f"  [{c.kind}] {'RIGHT' if c.right else 'WRONG'}  reasoning: {c.reasoning!r}")
        for call in c.tool_calls:
            p(f"           tool call: {call['name']}({call['arguments']})  -> after the result: {c.content_after_tool!r}")
        if c.kind != "tool":
            p(f"           answer: {c.content!r}")
        if c.detail:
            p(f"           ({c.detail})")
    same = sum(r.tokens_equal for r in report.items)
    p(f"accuracy on {len(report.items)} items: server {report.accuracy('server'):.0%} (raw completions), "
      f"transformers {report.accuracy('reference'):.0%}"
      + (f" ({report.expected_ablation}: {report.accuracy('expected'):.0%})" if report.expected_ablation else "")
      + (f", OpenAI's reference gpt_oss/torch {report.accuracy('openai'):.0%}"
         if any(r.openai for r in report.items) else "")
      + f", chat API {report.accuracy('chat'):.0%}; "
      f"tokens equal to transformers' in {same}/{len(report.items)}"
      + (f", to OpenAI's reference in {sum(r.server == r.openai for r in report.items)}/{len(report.items)}"
         if any(r.openai for r in report.items) else ""))
    for name in CHECKS:
        c = report.checks.get(name)
        if c is not None:
            p(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: {c['detail'][:300]}")
    if report.error:
        p(f"error: {report.error}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gptoss_patch_testkit.jobs.api_job", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="PIECEWISE", choices=("PIECEWISE", "FULL_DECODE_ONLY", "eager"))
    ap.add_argument("--items", type=int, default=12)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gptoss-api-job"))
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--unpatched", action="store_true",
                    help="also serve the same model unpatched (GPTOSS_PATCH_DISABLE=1 GPTOSS_PATCH_ALLOW_UNPATCHED=1) "
                         "and print its accuracy beside")
    args = ap.parse_args(argv)
    report = run(args.workdir, args.mode, args.items)
    if args.json:
        print(json.dumps(asdict(report), indent=1))
    else:
        print_report(report)
    ok = report.started and all(not report.problems(p) for p in PROPERTIES)
    if args.unpatched:
        bare = run(args.workdir, args.mode, args.items, extra_env=UNPATCHED_ENV, checks=False)
        print(f"unpatched ({' '.join(f'{k}={v}' for k, v in UNPATCHED_ENV.items())}): "
              + (f"accuracy through the server {bare.accuracy('server'):.0%} (raw completions), chat API "
                 f"{bare.accuracy('chat'):.0%}; tokens equal to transformers' in "
                 f"{sum(r.tokens_equal for r in bare.items)}/{len(bare.items)}" if bare.started
                 else f"did not start: {bare.error}"))
        for c in bare.chats[:3]:
            print(f"  [{c.kind}] {'RIGHT' if c.right else 'WRONG'}  reasoning: {(c.reasoning or '')[:120]!r}  answer: "
                  f"{(c.content or c.tool_calls or None)!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
