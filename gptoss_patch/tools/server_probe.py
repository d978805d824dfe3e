"""Probe a running OpenAI-compatible GPT-OSS server: a chat, a forced tool call, a ``json_schema`` answer, the chat
streamed, and a raw completion, at temperature 0.

``probe_server(url, model=None)`` sends at most six requests (``GET /v1/models`` when no model is
named, four ``POST /v1/chat/completions``, ``POST /v1/completions``), each bounded by ``timeout`` seconds,
with the standard library's HTTP client (no extra dependency), and checks what deployers trip over:

* HTTP status 200 and a JSON body (a server that answers ``"stream": false`` with an event stream is
  reported; its deltas are still read so the other checks can run);
* the ``model`` field echoes the served model name (``--served-model-name``);
* chat: non-empty ``message.content``, and a reasoning field (``reasoning_content`` as vLLM 0.11 names it,
  or ``reasoning`` as later vLLM adds) with text - missing when vLLM runs without
  ``--reasoning-parser openai_gptoss`` (vllm#41902). Content empty while reasoning holds text is the
  vllm#23694 case: evaluation scripts that read only ``content`` score zero;
* a tool call forced with ``tool_choice: "required"``, a ``response_format: json_schema`` answer (both through vLLM's
  structured outputs: a missing backend is HTTP 500, an ignored grammar free text, vllm-ascend 0.13.x with xgrammar
  < 0.1.30 an engine that dies in a mixed batch) and the chat streamed (deltas equal to the non-streamed message);
* raw completion: non-empty ``text`` (the fixed-length benchmark path, vllm perf-eval PR #77);
* ``usage``: positive ``prompt_tokens`` and ``completion_tokens``, ``total_tokens`` their sum;
* latency of each request (wall clock, seconds);
* ``VLLM_PLUGINS`` in this environment: vLLM loads only the listed plugin names of every group
  (``vllm/plugins/__init__.py``), so a value without our entry-point name filters gptoss-patch's
  ``vllm.general_plugins`` entry point out (the ``.pth`` hook still activates it).

The raw-completion prompt is vllm-ascend PR #8465's regression probe ("Say this is a test", 7 tokens,
temperature 0; the BF16 120b gives ". This is only a test."); its text is reported, not judged, since
the answer depends on the weights.

Command line: ``python -m gptoss_patch.verify --server URL [--model NAME]`` (see :func:`main` here for the
same without verify's other checks: ``python -m gptoss_patch.tools.server_probe URL [--model NAME]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from gptoss_patch.tools import Findings

__all__ = ["ProbeReport", "probe_server", "check_chat_response", "check_completion_response",
           "check_json_schema_response", "plugin_filter_warning", "plugin_entry_point_name", "main"]

#: Prompt of vllm-ascend PR #8465's regression check (greedy, 7 tokens).
COMPLETION_PROMPT = "Say this is a test"
CHAT_PROMPT = "Say this is a test."
#: The function the tool-call request forces (``tool_choice: "required"``): its arguments are bounded by the schema, so
#: a grammar that is applied gives valid JSON whatever the weights; one that is ignored or crashes shows.
PROBE_TOOL = {"type": "function", "function": {
    "name": "record_answer", "description": "Record whether the statement is a test.",
    "parameters": {"type": "object", "properties": {"is_test": {"type": "boolean"}}, "required": ["is_test"],
                   "additionalProperties": False}}}
#: The ``response_format: json_schema`` the JSON request asks for (bounded, as :data:`PROBE_TOOL`'s arguments).
PROBE_SCHEMA = {"type": "object", "properties": {"is_test": {"type": "boolean"}}, "required": ["is_test"],
                "additionalProperties": False}


@dataclass
class ProbeReport(Findings):
    """Result of :func:`probe_server`: ``problems`` (the server is not usable as deployed), ``warnings``,
    ``facts`` (model, answers, usage) and ``latency_s`` (request name -> seconds)."""

    url: str
    model: str | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    latency_s: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Human-readable report lines."""
        out = [f"server {self.url} (model {self.model or '?'}):"]
        for name, seconds in self.latency_s.items():
            out.append(f"  {name}: {seconds:.3f} s")
        for key, value in self.facts.items():
            out.append(f"  {key.replace('_', ' ')}: {value if not isinstance(value, str) else repr(value[:200])}")
        return out + self.closing_lines()


def plugin_entry_point_name() -> str:
    """Name of gptoss-patch's ``vllm.general_plugins`` entry point from the installed metadata (pyproject.toml);
    ``"gptoss_patch"`` when the distribution metadata is not installed (a plain checkout)."""
    from importlib import metadata

    try:
        for ep in metadata.entry_points(group="vllm.general_plugins"):
            if ep.value.split(":")[0].split(".")[0] == "gptoss_patch":
                return ep.name
    except Exception:  # noqa: BLE001 - broken metadata of some other distribution
        pass
    return "gptoss_patch"


def plugin_filter_warning(environ: dict | None = None) -> str | None:
    """The warning text when ``VLLM_PLUGINS`` (in ``environ``, default ``os.environ``) filters out our plugin.

    vLLM 0.11 splits the value on "," without stripping (``vllm/envs.py``), so ``"ascend, gptoss_patch"``
    does not match either; this check splits the same way.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("VLLM_PLUGINS")
    if value is None:
        return None
    name = plugin_entry_point_name()
    if name in value.split(","):
        return None
    return (f"VLLM_PLUGINS={value!r} filters out the '{name}' vllm.general_plugins entry point (vLLM loads only the "
            f"listed names of every plugin group, platform plugins included); the .pth start-up hook still "
            f"activates gptoss-patch, but use VLLM_PLUGINS={value + ',' if value else ''}{name} or unset it")


def _base(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"server URL must look like http://HOST:PORT or http://HOST:PORT/v1, got {url!r}")
    path = parsed.path.rstrip("/")
    if "/v1/" in path + "/" and not path.endswith("/v1"):
        raise ValueError(f"server URL must be the server's base (http://HOST:PORT or http://HOST:PORT/v1), not an "
                         f"endpoint under /v1; got {url!r}")
    if not path.endswith("/v1"):
        path += "/v1"  # a reverse-proxy prefix such as http://HOST/gpt-oss keeps its path
    return urllib.parse.urlunparse((parsed.scheme, parsed.netloc, path, "", "", ""))


def _request(method: str, url: str, body: dict | None, timeout: float, api_key: str | None):
    """(status, content type, body text, seconds); status 0 = connection failed, -1 = timed out (text says why)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
            return resp.status, resp.headers.get("Content-Type", ""), text, time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", "replace")
        return exc.code, exc.headers.get("Content-Type", ""), text, time.perf_counter() - start
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):  # connected (or connecting) but no complete answer in time
            return -1, "", f"no complete answer within {timeout:g} s", time.perf_counter() - start
        return 0, "", f"{type(reason).__name__}: {reason}", time.perf_counter() - start


def _decode(name: str, url: str, status: int, ctype: str, text: str, report: ProbeReport) -> dict | None:
    """The JSON object of a response (or the merged chunks of an event stream); problems go to ``report``."""
    if status == 0:
        report.problems.append(f"{name}: cannot reach {url}: {text}")
        return None
    if status == -1:
        report.problems.append(f"{name}: {url}: {text}")
        return None
    if status != 200:
        report.problems.append(f"{name}: HTTP {status} from {url}: {text[:300]}")
        return None
    if "text/event-stream" in ctype or text.lstrip().startswith("data:"):
        report.problems.append(f"{name}: {url} answered a non-streaming request (\"stream\": false) with an event "
                               "stream; OpenAI clients and evaluation tools expect one JSON object")
        return _merge_stream(text)
    try:
        obj = json.loads(text)
    except ValueError:
        report.problems.append(f"{name}: {url} returned a body that is not JSON: {text[:200]!r}")
        return None
    if not isinstance(obj, dict):
        report.problems.append(f"{name}: {url} returned JSON that is not an object: {text[:200]!r}")
        return None
    return obj


def _merge_stream(text: str) -> dict:
    """Fold ``data: {...}`` chunks into one completion-shaped object (content/reasoning concatenated)."""
    merged: dict = {"choices": [{"message": {}, "text": ""}]}
    message = merged["choices"][0]["message"]
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            continue
        merged.setdefault("model", chunk.get("model"))
        if chunk.get("usage"):
            merged["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                if key in delta:
                    message[key] = (message.get(key) or "") + (delta[key] or "")
            merged["choices"][0]["text"] += choice.get("text") or ""
            if choice.get("finish_reason"):
                merged["choices"][0]["finish_reason"] = choice["finish_reason"]
    return merged


def _check_usage(name: str, obj: dict, report: ProbeReport) -> None:
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        report.problems.append(f"{name}: no usage object (prompt_tokens/completion_tokens/total_tokens)")
        return
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    report.facts[f"{name}_usage"] = f"prompt {p}, completion {c}, total {t}"
    if not (isinstance(p, int) and p > 0 and isinstance(c, int) and c > 0):
        report.problems.append(f"{name}: usage has prompt_tokens={p!r}, completion_tokens={c!r}; expected positive "
                               "integers")
    elif t != p + c:
        report.problems.append(f"{name}: usage total_tokens {t!r} is not prompt_tokens + completion_tokens ({p + c})")


def _check_model(name: str, obj: dict, model: str, report: ProbeReport) -> None:
    got = obj.get("model")
    if got != model:
        report.problems.append(f"{name}: response model is {got!r}, requested {model!r} (clients and evaluation "
                               "tools match on the served model name; set --served-model-name)")


def check_chat_response(obj: dict, model: str, report: ProbeReport, chat_max_tokens: int | None = None) -> None:
    """Check a decoded ``/v1/chat/completions`` body: model echo, content, reasoning field, usage.

    Problems and facts go to ``report``; ``chat_max_tokens`` only words the hint for a cut-off answer.
    """
    _check_model("chat", obj, model, report)
    choice = (obj.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content = message.get("content") or ""
    reasoning_key = next((k for k in ("reasoning_content", "reasoning") if k in message), None)
    reasoning = (message.get(reasoning_key) if reasoning_key else None) or ""
    report.facts["chat_content"] = content
    report.facts["chat_reasoning_field"] = reasoning_key or "absent"
    report.facts["chat_finish_reason"] = choice.get("finish_reason")
    if not content.strip():
        why = ""
        if reasoning.strip():
            why = (" while the reasoning field holds text (vllm#23694): evaluation scripts reading only "
                   "'content' score zero")
        elif choice.get("finish_reason") == "length":
            why = f" and finish_reason is 'length': raise the chat token budget (now {chat_max_tokens})"
        report.problems.append(f"chat: empty message.content{why}")
    if not reasoning_key:
        report.problems.append("chat: no reasoning field (reasoning_content / reasoning) in the message: serve "
                               "with --reasoning-parser openai_gptoss")
    elif not reasoning.strip():
        report.problems.append(f"chat: the {reasoning_key} field is empty: serve with --reasoning-parser "
                               "openai_gptoss (vllm#41902)")
    _check_usage("chat", obj, report)


def check_completion_response(obj: dict, model: str, report: ProbeReport) -> None:
    """Check a decoded ``/v1/completions`` body: model echo, non-empty text, usage; problems go to ``report``."""
    _check_model("completion", obj, model, report)
    choice = (obj.get("choices") or [{}])[0]
    completion = choice.get("text") or ""
    report.facts["completion_text"] = completion
    if not completion.strip():
        report.problems.append("completion: empty choices[0].text")
    _check_usage("completion", obj, report)


def _message(obj: dict) -> dict:
    return ((obj.get("choices") or [{}])[0] or {}).get("message") or {}


def _split(message: dict) -> tuple[str, str]:
    """(reasoning, content) of a chat message (``reasoning_content`` or ``reasoning``)."""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    return reasoning, message.get("content") or ""


def _schema_problem(value, schema: dict) -> str | None:
    """What makes ``value`` invalid against the flat object ``schema`` of :data:`PROBE_SCHEMA` (booleans, required
    keys, no others), or None. A small check, not a JSON Schema validator: the product has no dependency on one."""
    if not isinstance(value, dict):
        return f"{value!r} is not an object"
    missing = [k for k in schema["required"] if k not in value]
    extra = [k for k in value if k not in schema["properties"]]
    wrong = [k for k, v in value.items() if k in schema["properties"] and not isinstance(v, bool)]
    if missing or extra or wrong:
        return "; ".join(filter(None, [missing and f"missing {missing}", extra and f"not allowed {extra}",
                                       wrong and f"not a boolean: {wrong}"]))
    return None


def check_json_schema_response(obj: dict, report: ProbeReport, *, max_tokens: int) -> None:
    """Check a chat answer to a ``response_format: json_schema`` request with :data:`PROBE_SCHEMA`.

    ``obj``: the decoded ``/v1/chat/completions`` body; ``max_tokens``: the request's budget (named in the messages).
    Content that parses and validates passes. Free text is a problem (the grammar was not applied); an answer the
    budget cut inside the JSON object (``finish_reason`` "length", content opening with ``{``) is a warning - the
    grammar was applied, and xgrammar's JSON grammar lets a model pad with whitespace until ``max_tokens`` unless vLLM
    runs with ``disable_any_whitespace`` (``vllm/config/structured_outputs.py``, vLLM 0.11-0.19) - and so is an
    answer still on harmony's analysis channel when the budget ended (vLLM applies the schema to the final message).
    No content and no reasoning at ``finish_reason`` "length" is a problem of its own (no harmony message at all, as
    the plain chat's empty message), not a grammar that was skipped. Records ``facts["json_schema_content"]``.
    """
    message = _message(obj)
    content = message.get("content") or ""
    report.facts["json_schema_content"] = content[:200]
    try:
        problem = _schema_problem(json.loads(content), PROBE_SCHEMA)
    except ValueError:
        problem = "not JSON"
    if not problem:
        return
    reasoning, _ = _split(message)
    finish = ((obj.get("choices") or [{}])[0] or {}).get("finish_reason")
    padding = len(content) - len(content.rstrip())
    if finish == "length" and content.lstrip().startswith("{"):
        # seen on vLLM 0.19.1 with the trained tiny GPT-OSS: '{"is_test"     :' then blanks to the budget
        report.warnings.append(
            f"json_schema: not checked - the answer reached max_tokens ({max_tokens}) inside the JSON object "
            f"({content.strip()[:60]!r}"
            + (f", then {padding} whitespace characters: the model pads where the grammar allows any whitespace; "
               "serve with --structured-outputs-config '{\"disable_any_whitespace\": true}' for compact JSON)"
               if padding >= 16 else "; raise --chat-max-tokens)"))
    elif not content.strip() and reasoning.strip():
        report.warnings.append(f"json_schema: not checked - no content, only reasoning: the answer did not reach "
                               f"harmony's final channel within {max_tokens} tokens (the schema applies there); "
                               "raise --chat-max-tokens")
    elif not content.strip() and finish == "length":
        # the same finding as the plain chat's empty message: nothing the reasoning parser could split into harmony
        # messages came back within the budget, so there was no final message for the grammar to constrain
        report.problems.append(f"json_schema: empty message.content and reasoning, finish_reason 'length': the answer "
                               f"formed no harmony message within {max_tokens} tokens, so the schema (which applies "
                               "to the final message) was never reached; raise --chat-max-tokens")
    else:
        report.problems.append(f"json_schema: content {content[:200]!r} does not follow the requested schema "
                               f"({problem}): the structured-output grammar was not applied")


def _probe_api(base: str, model: str, plain: dict, report: ProbeReport, *, timeout: float, chat_max_tokens: int,
               api_key: str | None) -> None:
    """The requests users send beyond a plain chat (issue 29), each checked:

    * **tool call**: ``tools`` = [:data:`PROBE_TOOL`], ``tool_choice: "required"`` -> a call returned in
      ``message.tool_calls`` must name it, with arguments that are a JSON object valid for its parameters; no call at all
      is a warning (vLLM's harmony path turns "required" into a grammar on the final message, and a GPT-OSS answer can
      stay off it); a missing structured-output backend answers HTTP 500 (a problem);
    * **json_schema**: ``response_format`` with :data:`PROBE_SCHEMA` -> ``content`` that parses and validates; an
      answer cut by ``max_tokens`` inside the object (the grammar applied, the model padding with whitespace) or one
      still reasoning when the budget ended is a warning, free text a problem;
    * **streaming**: the plain chat again with ``"stream": true`` -> the concatenated ``content`` and reasoning deltas
      equal ``plain``'s non-streamed message (temperature 0).

    Problems go to ``report`` (an HTTP error names the request); facts record each answer.
    """
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": chat_max_tokens, "temperature": 0, "stream": False,
            "tools": [PROBE_TOOL], "tool_choice": "required"}
    status, ctype, text, secs = _request("POST", base + "/chat/completions", body, timeout, api_key)
    report.latency_s["tool_call"] = secs
    obj = _decode("tool call (tool_choice required)", base + "/chat/completions", status, ctype, text, report)
    if obj is not None:
        calls = _message(obj).get("tool_calls") or []
        name = PROBE_TOOL["function"]["name"]
        if not calls:
            # a warning, not a problem: vLLM's harmony path does not always force the call (it turns "required" into
            # a grammar on the final message, while harmony calls a tool on the commentary channel; seen on vLLM 0.13
            # with an answer in content) - clients that rely on "required" must check for tool_calls themselves
            report.warnings.append(f"tool call: tool_choice 'required' returned no tool_calls (content "
                                   f"{_message(obj).get('content')!r}); without --tool-call-parser openai "
                                   "--enable-auto-tool-choice a call is never parsed")
        else:
            fn = calls[0].get("function") or {}
            report.facts["tool_call"] = f"{fn.get('name')}({fn.get('arguments')})"
            try:
                problem = _schema_problem(json.loads(fn.get("arguments") or ""), PROBE_TOOL["function"]["parameters"])
            except ValueError:
                problem = "not JSON"
            if fn.get("name") != name or problem:
                report.problems.append(f"tool call: {fn.get('name')}({fn.get('arguments')}) is not a valid call of "
                                       f"{name}{': ' + problem if problem else ''}")

    body = {"model": model, "messages": messages, "max_tokens": chat_max_tokens, "temperature": 0, "stream": False,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "is_test", "schema": PROBE_SCHEMA, "strict": True}}}
    status, ctype, text, secs = _request("POST", base + "/chat/completions", body, timeout, api_key)
    report.latency_s["json_schema"] = secs
    obj = _decode("json_schema", base + "/chat/completions", status, ctype, text, report)
    if obj is not None:
        check_json_schema_response(obj, report, max_tokens=chat_max_tokens)

    body = {"model": model, "messages": messages, "max_tokens": chat_max_tokens, "temperature": 0, "stream": True}
    status, ctype, text, secs = _request("POST", base + "/chat/completions", body, timeout, api_key)
    report.latency_s["stream"] = secs
    if status != 200:
        _decode("stream", base + "/chat/completions", status, ctype, text, report)
    elif "text/event-stream" not in ctype and not text.lstrip().startswith("data:"):
        report.problems.append(f"stream: \"stream\": true answered without an event stream ({ctype or 'no type'})")
    else:
        streamed = _split(_merge_stream(text)["choices"][0]["message"])
        whole = _split(_message(plain))
        if streamed != whole:
            report.problems.append(f"stream: the streamed deltas (reasoning {streamed[0]!r}, content {streamed[1]!r}) "
                                   f"differ from the non-streamed answer (reasoning {whole[0]!r}, content "
                                   f"{whole[1]!r})")


def probe_server(url: str, model: str | None = None, *, timeout: float = 120.0, chat_max_tokens: int = 512,
                 completion_max_tokens: int = 7, api_key: str | None = None,
                 environ: dict | None = None, api: bool = True) -> ProbeReport:
    """Probe the OpenAI-compatible server at ``url`` and return a :class:`ProbeReport`.

    ``url``: ``http(s)://HOST:PORT`` with or without the ``/v1`` suffix. ``model``: the served model
    name; default the first id of ``GET /v1/models``. ``timeout``: seconds per request (at most six
    requests are sent, three without ``api``). ``chat_max_tokens``: GPT-OSS reasons before it answers, so the chat budget must
    cover the analysis channel. ``api_key``: sent as a Bearer token (default ``$OPENAI_API_KEY``).
    ``environ``: where ``VLLM_PLUGINS`` is read (default ``os.environ``). ``api``: also send the three
    requests of :func:`_probe_api` (a forced tool call, a ``json_schema`` answer, the chat streamed).
    Server faults become problems in the report; raises ``ValueError`` for a URL that is not http(s)
    or a non-positive timeout/token budget.
    """
    base = _base(url)
    if timeout <= 0 or chat_max_tokens < 1 or completion_max_tokens < 1:
        raise ValueError("timeout, chat_max_tokens and completion_max_tokens must be positive")
    api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    report = ProbeReport(url=base, model=model)
    warning = plugin_filter_warning(environ)
    if warning:
        report.warnings.append(warning)

    if model is None:
        status, ctype, text, secs = _request("GET", base + "/models", None, timeout, api_key)
        report.latency_s["models"] = secs
        obj = _decode("models", base + "/models", status, ctype, text, report)
        ids = [m.get("id") for m in (obj or {}).get("data") or [] if isinstance(m, dict)]
        if not ids:
            if obj is not None:
                report.problems.append(f"models: {base}/models lists no model; pass the served model name (--model)")
            return report
        model = report.model = ids[0]
        report.facts["served_models"] = ", ".join(map(str, ids))

    chat_body = {"model": model, "messages": [{"role": "user", "content": CHAT_PROMPT}],
                 "max_tokens": chat_max_tokens, "temperature": 0, "stream": False}
    status, ctype, text, secs = _request("POST", base + "/chat/completions", chat_body, timeout, api_key)
    report.latency_s["chat_completion"] = secs
    obj = _decode("chat", base + "/chat/completions", status, ctype, text, report)
    if obj is not None:
        check_chat_response(obj, model, report, chat_max_tokens=chat_max_tokens)

    if obj is not None and api:
        _probe_api(base, model, obj, report, timeout=timeout, chat_max_tokens=chat_max_tokens, api_key=api_key)

    comp_body = {"model": model, "prompt": COMPLETION_PROMPT, "max_tokens": completion_max_tokens,
                 "temperature": 0, "stream": False}
    status, ctype, text, secs = _request("POST", base + "/completions", comp_body, timeout, api_key)
    report.latency_s["completion"] = secs
    obj = _decode("completion", base + "/completions", status, ctype, text, report)
    if obj is not None:
        check_completion_response(obj, model, report)
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI ``URL [--model NAME] [--timeout S] [--chat-max-tokens N] [--json]``: exit 0 ok, 1 problems, 2 usage
    error."""
    from gptoss_patch._cli import at_least, parse, positive_float, prog

    ap = argparse.ArgumentParser(prog=prog("gptoss-patch-probe", "gptoss_patch.tools.server_probe"),
                                 description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--model", help="served model name (default: the first of GET /v1/models)")
    ap.add_argument("--timeout", type=positive_float, default=120.0, help="seconds per request")
    ap.add_argument("--chat-max-tokens", type=at_least(1), default=512, metavar="N",
                    help="max_tokens of each chat request (GPT-OSS reasons before it answers)")
    ap.add_argument("--json", action="store_true")
    args = parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        report = probe_server(args.url, args.model, timeout=args.timeout, chat_max_tokens=args.chat_max_tokens)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return report.emit(args.json)


if __name__ == "__main__":
    sys.exit(main())
