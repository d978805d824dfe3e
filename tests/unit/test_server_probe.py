"""gptoss_patch.tools.server_probe / ``verify --server`` against a real OpenAI-style server that is not ours.

The server is transformers' own ``transformers serve`` (transformers 4.57.1) hosting the tiny GPT-OSS
checkpoint on 127.0.0.1, offline (HF_HUB_OFFLINE=1), started and stopped by the module fixture. It is
only partly OpenAI-compatible, and that is what the probe must find: it answers ``"stream": false``
with an event stream, echoes the model as ``<path>@main``, keeps no usage, has no reasoning field (its
gpt-oss branch drops the analysis channel, and the random tiny model never reaches the final channel,
so content stays empty) and has no ``/v1/completions``. Requests are bounded: at most 8 new tokens,
90 s per request, 5 probe runs in all.

Needs, beside the unit dependencies: fastapi, uvicorn, openai, pydantic (transformers' serve extras)
and accelerate (transformers 4.57.1's serve loads models with device_map).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, clean_env
from gptoss_patch.tools.server_probe import plugin_filter_warning, probe_server


def shared_tiny(tmp_path_factory):
    """The tiny checkpoint (with tokenizer files), written once per session under pytest's base temp
    and shared by test_serve, test_checkpoint and test_server_probe (tests copy it before editing)."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    path = tmp_path_factory.getbasetemp() / "ops-kit-tiny"
    if not (path / ".complete").is_file():
        write_checkpoint(path, preset="tiny", seed=0, tokenizer=True)
        (path / ".complete").write_text("")
    return path


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory):
    """(base URL, checkpoint dir) of a ``transformers serve`` on 127.0.0.1 hosting the tiny checkpoint."""
    ckpt = shared_tiny(tmp_path_factory)
    port = _free_port()
    log = tmp_path_factory.mktemp("hf-log") / "serve.log"
    env = clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "transformers.commands.transformers_cli", "serve",
                                 "--host", "127.0.0.1", "--port", str(port), "--log_level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not healthy within 90 s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, ckpt
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and nothing else
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_probe_reports_what_transformers_serve_lacks(hf_server):
    url, ckpt = hf_server
    report = probe_server(url + "/v1/", str(ckpt), timeout=90, chat_max_tokens=8, completion_max_tokens=4,
                          environ={})
    assert report.url == url + "/v1" and report.model == str(ckpt)
    assert set(report.latency_s) == {"chat_completion", "tool_call", "json_schema", "stream", "completion"}
    assert all(0 < s < 90 for s in report.latency_s.values())
    assert report.facts["chat_reasoning_field"] == "absent"
    assert report.warnings == ["tool call: tool_choice 'required' returned no tool_calls (content None); without "
                               "--tool-call-parser openai --enable-auto-tool-choice a call is never parsed"]
    chat = f"{url}/v1/chat/completions"
    assert report.problems == [
        f"chat: {chat} answered a non-streaming request (\"stream\": false) with an event stream; OpenAI clients "
        "and evaluation tools expect one JSON object",
        f"chat: response model is '{ckpt}@main', requested '{ckpt}' (clients and evaluation tools match on the "
        "served model name; set --served-model-name)",
        "chat: empty message.content",
        "chat: no reasoning field (reasoning_content / reasoning) in the message: serve with --reasoning-parser "
        "openai_gptoss",
        "chat: no usage object (prompt_tokens/completion_tokens/total_tokens)",
        # transformers serve ignores tools and response_format: no call, no JSON (the stream itself agrees with the
        # non-streamed answer: both empty)
        f"tool call (tool_choice required): {chat} answered a non-streaming request (\"stream\": false) with an event "
        "stream; OpenAI clients and evaluation tools expect one JSON object",
        f"json_schema: {chat} answered a non-streaming request (\"stream\": false) with an event stream; OpenAI "
        "clients and evaluation tools expect one JSON object",
        "json_schema: content '' does not follow the requested schema (not JSON): the structured-output grammar "
        "was not applied",
        f"completion: HTTP 404 from {url}/v1/completions: {{\"detail\":\"Not Found\"}}",
    ]
    assert not report.ok


def test_probe_without_model_uses_the_models_listing(hf_server):
    url, _ = hf_server
    report = probe_server(url, timeout=30, chat_max_tokens=4, completion_max_tokens=4, environ={})
    # transformers serve lists a fixed catalogue of hub models, not what it hosts; offline, the first
    # of them cannot be loaded - the probe picks it, says so, and reports the failure
    assert "models" in report.latency_s and report.model == report.facts["served_models"].split(", ")[0]
    assert report.problems[0].startswith(f"chat: HTTP 500 from {url}/v1/chat/completions")


def test_verify_server_cli(hf_server):
    url, ckpt = hf_server
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--server", url, "--model", str(ckpt),
                           "--chat-max-tokens", "4"],
                          capture_output=True, text=True, env=clean_env(VLLM_PLUGINS="ascend"), timeout=200, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert out.startswith("gptoss-patch verify --server\n")
    assert re.search(r"^    chat_completion: \d+\.\d{3} s$", out, re.M)  # latency printed
    assert re.search(r"^    completion: \d+\.\d{3} s$", out, re.M)
    assert "warning: VLLM_PLUGINS='ascend' filters out the 'gptoss_patch' vllm.general_plugins entry point" in out
    assert f"PROBLEM: completion: HTTP 404 from {url}/v1/completions" in out
    assert out.rstrip().endswith("result: NOT OK")
    bad = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--server", "localhost:8000"],
                         capture_output=True, text=True, env=clean_env(), timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "server URL must look like http://HOST:PORT" in bad.stderr


def test_unreachable_server_and_bad_url():
    port = _free_port()  # nothing listens there any more
    report = probe_server(f"http://127.0.0.1:{port}", "m", timeout=5, environ={})
    assert len(report.problems) == 2
    assert report.problems[0].startswith(f"chat: cannot reach http://127.0.0.1:{port}/v1/chat/completions: "
                                         "ConnectionRefusedError")
    with pytest.raises(ValueError, match="server URL must look like http://HOST:PORT"):
        probe_server("127.0.0.1:8000")
    with pytest.raises(ValueError, match="not an endpoint under /v1; got 'http://127.0.0.1:8000/v1/chat/completions'"):
        probe_server("http://127.0.0.1:8000/v1/chat/completions")  # an endpoint, not the base: never mangled


def test_vllm_plugins_filter():
    assert plugin_filter_warning({}) is None
    assert plugin_filter_warning({"VLLM_PLUGINS": "ascend,gptoss_patch"}) is None
    # vLLM splits on "," without stripping: a space breaks the match, as it does in vLLM
    assert "use VLLM_PLUGINS=ascend, gptoss_patch,gptoss_patch" in plugin_filter_warning(
        {"VLLM_PLUGINS": "ascend, gptoss_patch"})
    assert "use VLLM_PLUGINS=gptoss_patch or unset it" in plugin_filter_warning({"VLLM_PLUGINS": ""})


#: The chat response body a vLLM server (0.11.3.dev + the fork, gpt-oss-120b-bf16 on 910B3 x 8) returned in the
#: seed deployment write-up (shared/seeds, "验证推理服务"), verbatim: no server here can produce a conforming
#: answer, so the success path of the checks runs on this recorded one.
SEED_VLLM_CHAT = json.loads(
    '{"id":"chatcmpl-a1caa47ab6734ef3b5fa9b28ece54945","object":"chat.completion","created":1765360849,'
    '"model":"gpt-oss-120b-bf16","choices":[{"index":0,"message":{"role":"assistant","content":"I\u2019m ChatGPT, '
    'an AI language model created by OpenAI. I can help answer questions, brainstorm ideas, explain concepts, and '
    'chat about a wide range of topics. Feel free to ask me anything!","refusal":null,"annotations":null,'
    '"audio":null,"function_call":null,"tool_calls":[],"reasoning":"The user asks \\"who are you\\". We should '
    'respond with a brief introduction. The system says we are ChatGPT, large language model trained by OpenAI, '
    'knowledge cutoff 2024-06. Keep it short and friendly.","reasoning_content":"The user asks \\"who are you\\". '
    'We should respond with a brief introduction. The system says we are ChatGPT, large language model trained by '
    'OpenAI, knowledge cutoff 2024-06. Keep it short and friendly."},"logprobs":null,"finish_reason":"stop",'
    '"stop_reason":null,"token_ids":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":72,'
    '"total_tokens":170,"completion_tokens":98,"prompt_tokens_details":null},"prompt_logprobs":null,'
    '"prompt_token_ids":null,"kv_transfer_params":null}')


def test_checks_pass_on_the_recorded_vllm_answer():
    from gptoss_patch.tools.server_probe import ProbeReport, check_chat_response

    report = ProbeReport(url="-")
    check_chat_response(SEED_VLLM_CHAT, "gpt-oss-120b-bf16", report)
    assert report.problems == []
    assert report.facts["chat_reasoning_field"] == "reasoning_content"
    assert report.facts["chat_usage"] == "prompt 72, completion 98, total 170"


def test_checks_on_broken_variants_of_the_recorded_answer():
    import copy

    from gptoss_patch.tools.server_probe import ProbeReport, check_chat_response

    final_in_reasoning = copy.deepcopy(SEED_VLLM_CHAT)  # vllm#23694: the answer lands in the reasoning field
    final_in_reasoning["choices"][0]["message"]["content"] = None
    report = ProbeReport(url="-")
    check_chat_response(final_in_reasoning, "gpt-oss-120b-bf16", report)
    assert report.problems == ["chat: empty message.content while the reasoning field holds text (vllm#23694): "
                               "evaluation scripts reading only 'content' score zero"]
    no_parser = copy.deepcopy(SEED_VLLM_CHAT)  # vLLM 0.11.0 without --reasoning-parser: reasoning_content null
    del no_parser["choices"][0]["message"]["reasoning"]
    no_parser["choices"][0]["message"]["reasoning_content"] = None
    no_parser["usage"]["total_tokens"] = 171
    report = ProbeReport(url="-")
    check_chat_response(no_parser, "gpt-oss-120b", report)
    assert report.problems == [
        "chat: response model is 'gpt-oss-120b-bf16', requested 'gpt-oss-120b' (clients and evaluation tools match "
        "on the served model name; set --served-model-name)",
        "chat: the reasoning_content field is empty: serve with --reasoning-parser openai_gptoss (vllm#41902)",
        "chat: usage total_tokens 171 is not prompt_tokens + completion_tokens (170)",
    ]


def test_json_schema_answers_judged():
    """A valid object passes; free text is a problem (grammar not applied); an object cut by max_tokens while the
    model pads with whitespace (the 0.19.1rc1 cell's answer to the probe: '{"is_test"     :' and blanks to 512
    tokens) and an answer still reasoning are warnings naming the setting that helps."""
    import copy

    from gptoss_patch.tools.server_probe import ProbeReport, check_json_schema_response

    def judged(content, finish="stop", reasoning="The user wants JSON."):
        answer = copy.deepcopy(SEED_VLLM_CHAT)
        answer["choices"][0]["message"].update(content=content, reasoning_content=reasoning, reasoning=reasoning)
        answer["choices"][0]["finish_reason"] = finish
        report = ProbeReport(url="-")
        check_json_schema_response(answer, report, max_tokens=512)
        return report.problems, report.warnings

    assert judged('{"is_test": true}') == ([], [])
    assert judged('{ "is_test" : false }\n') == ([], [])
    assert judged("I'm ChatGPT") == (["json_schema: content \"I'm ChatGPT\" does not follow the requested schema "
                                      "(not JSON): the structured-output grammar was not applied"], [])
    assert judged('{"is_test": "yes"}') == (["json_schema: content '{\"is_test\": \"yes\"}' does not follow the "
                                             "requested schema (not a boolean: ['is_test']): the structured-output "
                                             "grammar was not applied"], [])
    problems, warnings = judged('{"is_test"     :' + " " * 480, finish="length")
    assert problems == [] and warnings == [
        "json_schema: not checked - the answer reached max_tokens (512) inside the JSON object ('{\"is_test\"     :', "
        "then 480 whitespace characters: the model pads where the grammar allows any whitespace; serve with "
        "--structured-outputs-config '{\"disable_any_whitespace\": true}' for compact JSON)"]
    problems, warnings = judged('{"is_te', finish="length")
    assert problems == [] and warnings[0].endswith("('{\"is_te'; raise --chat-max-tokens)")
    problems, warnings = judged(None, finish="length")
    assert problems == [] and warnings[0].startswith("json_schema: not checked - no content, only reasoning")
    # neither content nor reasoning within the budget: no harmony message at all (a model that does not speak
    # harmony, as the main job's random tiny model), named as such - not a grammar that was skipped
    assert judged(None, finish="length", reasoning=None) == ([
        "json_schema: empty message.content and reasoning, finish_reason 'length': the answer formed no harmony "
        "message within 512 tokens, so the schema (which applies to the final message) was never reached; raise "
        "--chat-max-tokens"], [])
    assert judged("", reasoning="")[0][0].startswith("json_schema: content '' does not follow")  # stopped: no excuse
    # a stop inside the object is not the budget: the grammar let an unfinished object end
    assert judged('{"is_test"')[0] == ["json_schema: content '{\"is_test\"' does not follow the requested schema "
                                        "(not JSON): the structured-output grammar was not applied"]
