"""Accuracy runner: MMLU, GSM8K and local-task subsets from local files, scored by lm-evaluation-harness against a server.

    gptoss-patch-eval --server http://HOST:8000 --model NAME \\
        --mmlu DIR_OR_FILE --gsm8k FILE [--local FILE] [--limit N] [--max-tokens 4096] [--dry-run]

The scoring is lm-eval's (``lm-eval run`` with its ``exact_match`` metric, its ``regex`` / ``take_first``
filters and its ``local-chat-completions`` client, concurrency, retries and timeouts); this module only

* reads the data from **local files** in their published formats (nothing is downloaded: lm-eval loads the
  converted JSONL through ``datasets``' ``json`` builder with ``HF_DATASETS_OFFLINE=1``/``HF_HUB_OFFLINE=1``):

  - MMLU: the original release layout (Hendrycks et al., ``data/test/<subject>_test.csv``: no header, columns
    question, A, B, C, D, answer letter) - a directory searched for ``*_test.csv`` or one such file - or rows of
    the ``cais/mmlu`` dataset (``question``, ``subject``, ``choices`` [4 strings], ``answer`` 0-3) as ``.jsonl``
    or ``.parquet``;
  - GSM8K: ``test.jsonl`` of openai/grade-school-math (``question``, ``answer`` ending in ``#### <number>``),
    or the ``openai/gsm8k`` rows as ``.parquet``;
  - a local task: ``.jsonl`` rows ``{"question": str, "answer": str}`` (GSM8K's fields), the question sent as the
    user message as it is, the answer the exact expected ``message.content`` - e.g. ``tests/data/harmony/test.jsonl``,
    the held-out items of the trained tiny GPT-OSS (:mod:`gptoss_patch.selftest.harmony`), a check that a server
    answers a model's own task before MMLU;

* writes two lm-eval task configurations for a reasoning chat model, zero-shot at temperature 0 (the
  setting of the published GPT-OSS figures): ``gptoss_mmlu`` with the prompt and answer pattern of OpenAI's
  simple-evals (``QUERY_TEMPLATE_MULTICHOICE`` / ``ANSWER_PATTERN_MULTICHOICE`` in ``openai/simple-evals``
  ``common.py``, the harness behind the model card's MMLU figure) and ``gptoss_gsm8k`` with lm-eval's own
  ``gsm8k_cot_llama`` prompt and its ``strict-match`` / ``flexible-extract`` filters;

* reads the answer from ``message.content`` and, when that is empty, from the reasoning field
  (``reasoning_content`` as vLLM 0.11 names it, ``reasoning`` as later vLLM adds): lm-eval's client reads
  ``content`` only, and a GPT-OSS server whose parser leaves the final answer in the reasoning field
  (vllm#23694) or runs out of tokens in the analysis channel would score zero without saying why. How many
  answers came from each place (and how many hit the token limit) is printed with the scores, so a deployment
  with that fault is visible instead of just scoring low.

Requests are bounded: at most ``limit`` (or all rows) per task, each retried at most ``--max-retries`` times,
each bounded by ``--timeout`` seconds, and the whole run is killed after ``--deadline`` seconds.
``--dry-run`` writes the data and task files and prints the exact ``lm-eval`` command line without sending
anything. The lm-eval command runs through ``python -m gptoss_patch.tools.eval_accuracy lm-eval ...``, which
registers the reasoning-aware client (:func:`register_lm_eval_model`) and then hands the arguments to
lm-eval's own command line (``lm_eval.__main__.cli_evaluate``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "MMLU_TEMPLATE", "MMLU_ANSWER_PATTERN", "GSM8K_TEMPLATE", "REFERENCE_FIGURES", "load_mmlu", "load_gsm8k",
    "load_local", "prepare", "lm_eval_command", "answer_from_choice", "register_lm_eval_model", "read_results", "main",
]

#: openai/simple-evals ``common.py`` QUERY_TEMPLATE_MULTICHOICE, in lm-eval's jinja form.
MMLU_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of the following "
    "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
    "\n\n{{question.strip()}}\n\nA) {{choices[0]}}\nB) {{choices[1]}}\nC) {{choices[2]}}\nD) {{choices[3]}}"
)
#: openai/simple-evals ``common.py`` ANSWER_PATTERN_MULTICHOICE (first match, as simple-evals' ``re.search``).
MMLU_ANSWER_PATTERN = r"(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?"
#: lm-eval ``tasks/gsm8k/gsm8k-cot-llama.yaml`` doc_to_text (zero-shot here).
GSM8K_TEMPLATE = (
    "Given the following problem, reason and give a final answer to the problem.\nProblem: {{question}}\n"
    "Your response should end with \"The final answer is [answer]\" where [answer] is the response to the "
    "problem.\n"
)

#: Published figures printed beside the scores; none was measured by this project.
REFERENCE_FIGURES = [
    ("mmlu", "gpt-oss-120b model card (arXiv 2508.10925), reasoning low / medium / high", "85.9 / 88.0 / 90.0 %"),
    ("mmlu", "gpt-oss-120b BF16, vLLM + forked vllm-ascend, 910B3 x 8, evalscope mmlu (seed write-up)", "87.55 %"),
    ("mmlu", "gpt-oss-20b BF16, same fork, one 910B3, medium reasoning, temperature 0 (seed write-up)", "83.41 %"),
    ("mmlu", "gpt-oss-120b-bf16, vllm-ascend tutorial, AISBench ('for reference only')", "89.50 %"),
    ("gsm8k", "gpt-oss-120b, vLLM on H100/H200/B200, lm-eval gsm8k strict (InferenceX PR #258; H200 TP1)",
     "95.38 %"),
    ("gsm8k", "gpt-oss-120b-bf16, SGLang on Ascend, 256 questions, max_new_tokens 512 (sglang PR #14197)", "84.4 %"),
]

_LETTERS = "ABCD"
_GSM8K_FINAL = re.compile(r"####\s*(\S+)\s*$")


class DataError(ValueError):
    """A dataset file that does not have the documented format (the message names the file and row)."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{lineno}: not a JSON object per line ({exc})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with lm-eval's datasets dependency
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def _mmlu_row(row: dict, where: str) -> dict:
    missing = [k for k in ("question", "choices", "answer") if k not in row]
    if missing:
        raise DataError(f"{where}: MMLU row without {missing}; expected the cais/mmlu fields question, subject, "
                        "choices (4 strings), answer (0-3)")
    choices, answer = row["choices"], row["answer"]
    if not (isinstance(choices, (list, tuple)) and len(choices) == 4):
        raise DataError(f"{where}: 'choices' must be a list of 4 strings, got {choices!r}")
    if isinstance(answer, str) and answer in _LETTERS:
        answer = _LETTERS.index(answer)
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer <= 3:
        raise DataError(f"{where}: 'answer' must be 0-3 (or a letter A-D), got {answer!r}")
    return {"question": str(row["question"]), "subject": str(row.get("subject", "")),
            "choices": [str(c) for c in choices], "answer": answer}


def load_mmlu(path) -> list[dict]:
    """MMLU test rows from ``path`` as ``{"question", "subject", "choices": [4 str], "answer": 0-3}`` dicts.

    ``path``: a directory (every ``*_test.csv`` below it, the original ``data/test/<subject>_test.csv``
    layout; the subject is the file name without ``_test.csv``), one such CSV file, or a ``.jsonl`` /
    ``.parquet`` file of ``cais/mmlu`` rows. Rows are interleaved round-robin across subjects (subjects in
    name order, rows in file order) so that the first N rows - what ``--limit N`` evaluates - span subjects.
    Raises :class:`DataError` for a missing path, no rows, or a row not in the documented format.
    """
    path = Path(path)
    by_subject: dict[str, list[dict]] = {}
    if path.is_dir() or path.suffix == ".csv":
        files = sorted(path.rglob("*_test.csv")) if path.is_dir() else [path]
        if not files:
            raise DataError(f"{path}: no *_test.csv files (expected the MMLU release layout data/test/"
                            "<subject>_test.csv)")
        for file in files:
            if not file.is_file():
                raise DataError(f"{file}: no such file")
            subject = file.name[: -len("_test.csv")] if file.name.endswith("_test.csv") else file.stem
            with open(file, newline="", encoding="utf-8") as fh:
                for lineno, cells in enumerate(csv.reader(fh), 1):
                    where = f"{file}:{lineno}"
                    if len(cells) != 6 or cells[5].strip() not in _LETTERS:
                        raise DataError(f"{where}: expected 6 columns (question, A, B, C, D, answer letter A-D) "
                                        f"as in the MMLU release, got {cells!r}")
                    by_subject.setdefault(subject, []).append(_mmlu_row(
                        {"question": cells[0], "subject": subject, "choices": cells[1:5],
                         "answer": cells[5].strip()}, where))
    elif path.suffix in (".jsonl", ".parquet"):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        raw = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
        for i, row in enumerate(raw, 1):
            parsed = _mmlu_row(row, f"{path}: row {i}")
            by_subject.setdefault(parsed["subject"], []).append(parsed)
    else:
        raise DataError(f"{path}: expected a directory or file of MMLU *_test.csv, or a .jsonl/.parquet of "
                        "cais/mmlu rows")
    rows = []
    subjects = sorted(by_subject)
    for i in range(max((len(v) for v in by_subject.values()), default=0)):
        rows += [by_subject[s][i] for s in subjects if i < len(by_subject[s])]
    if not rows:
        raise DataError(f"{path}: no MMLU rows")
    return rows


def load_gsm8k(path) -> list[dict]:
    """GSM8K rows from ``path`` (``test.jsonl`` of openai/grade-school-math or an ``openai/gsm8k`` ``.parquet``)
    as ``{"question", "answer"}`` dicts, in file order. Every ``answer`` must end in ``#### <number>`` (the
    release format; the number is the target). Raises :class:`DataError` otherwise."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{path}: expected the GSM8K test.jsonl (or an openai/gsm8k .parquet)")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    raw = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    return _question_answer_rows(path, raw, lambda q, a: bool(_GSM8K_FINAL.search(a)), "GSM8K ",
                                 "'question' and an 'answer' ending in '#### <number>' (GSM8K release format)")


def _question_answer_rows(path: Path, raw: list[dict], valid, kind: str, expected: str) -> list[dict]:
    """``raw`` rows as ``{"question", "answer"}`` dicts; :class:`DataError` naming the row where the two are not
    strings or ``valid(question, answer)`` is false, or when there is no row."""
    rows = []
    for i, row in enumerate(raw, 1):
        question, answer = row.get("question"), row.get("answer")
        if not (isinstance(question, str) and isinstance(answer, str) and valid(question, answer)):
            raise DataError(f"{path}: row {i}: expected {expected}, got {row!r:.200}")
        rows.append({"question": question, "answer": answer})
    if not rows:
        raise DataError(f"{path}: no {kind}rows")
    return rows


def load_local(path) -> list[dict]:
    """Rows of a local exact-answer task from the ``.jsonl`` file ``path``: ``{"question": str, "answer": str}`` each
    (both non-empty), in file order. Raises :class:`DataError` for another suffix, a missing file, no rows or a row
    without the two strings (the message names the row)."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: expected a .jsonl file of {{\"question\": str, \"answer\": str}} rows")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return _question_answer_rows(path, _read_jsonl(path), lambda q, a: bool(q.strip() and a.strip()), "",
                                 "a non-empty 'question' and 'answer' (strings)")


def _task_config(name: str, data_file: Path, max_tokens: int) -> dict:
    common = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "generate_until",
        "num_fewshot": 0,
        # until: [] so lm-eval adds no stop string ("\n\n" by default) that would cut the reasoning
        "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": max_tokens},
        "metadata": {"version": 1.0},
    }
    if name == "gptoss_mmlu":
        common.update({
            "doc_to_text": MMLU_TEMPLATE,
            "doc_to_target": "{{['A', 'B', 'C', 'D'][answer]}}",
            "filter_list": [{"name": "answer-letter", "filter": [
                {"function": "regex", "regex_pattern": MMLU_ANSWER_PATTERN, "group_select": 0},
                {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": True}],
        })
    elif name == "gptoss_local":  # the question as it is; the answer is the whole content, exactly
        common.update({
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "target_delimiter": "",
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        })
    else:  # gptoss_gsm8k: lm-eval's gsm8k_cot_llama prompt, filters and metric, zero-shot
        common.update({
            "doc_to_text": GSM8K_TEMPLATE,
            "doc_to_target": "{{answer.split('####')[-1].strip()}}",
            "target_delimiter": "",
            "filter_list": [
                {"name": "strict-match", "filter": [
                    {"function": "regex", "group_select": -1,
                     "regex_pattern": "The final answer is ((-?[$0-9.,]{2,})|(-?[0-9]+))"},
                    {"function": "take_first"}]},
                {"name": "flexible-extract", "filter": [
                    {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                    {"function": "take_first"}]},
            ],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": True, "ignore_punctuation": False,
                             "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}],
        })
    return common


def prepare(workdir, *, mmlu=None, gsm8k=None, local=None, max_tokens: int = 4096) -> dict[str, int]:
    """Write the converted data (``workdir/data/<task>.jsonl``) and lm-eval task files
    (``workdir/tasks/<task>.yaml``) for the given datasets; returns ``{task name: row count}``.

    Task names: ``gptoss_mmlu`` (from ``mmlu``, see :func:`load_mmlu`), ``gptoss_gsm8k`` (from ``gsm8k``, see
    :func:`load_gsm8k`) and ``gptoss_local`` (from ``local``, see :func:`load_local`). The YAML files are written as
    JSON (a YAML subset). Raises :class:`DataError` for bad data, ``ValueError`` when no dataset is given or
    ``max_tokens`` < 1.
    """
    if mmlu is None and gsm8k is None and local is None:
        raise ValueError("give at least one dataset: --mmlu, --gsm8k and/or --local")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    workdir = Path(workdir).resolve()
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    (workdir / "tasks").mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, source, loader in (("gptoss_mmlu", mmlu, load_mmlu), ("gptoss_gsm8k", gsm8k, load_gsm8k),
                                 ("gptoss_local", local, load_local)):
        if source is None:
            continue
        rows = loader(source)
        data_file = workdir / "data" / f"{name}.jsonl"
        data_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        (workdir / "tasks" / f"{name}.yaml").write_text(
            json.dumps(_task_config(name, data_file, max_tokens), indent=2, ensure_ascii=False) + "\n",
            encoding="utf-8")
        counts[name] = len(rows)
    return counts


def chat_url(server: str) -> str:
    """``http(s)://HOST:PORT[/v1]`` -> ``.../v1/chat/completions``; ``ValueError`` for anything else."""
    from gptoss_patch.tools.server_probe import _base

    return _base(server) + "/chat/completions"


def lm_eval_command(*, server: str, model: str, workdir, tasks, limit: int | None = None, concurrency: int = 8,
                    timeout: float = 600, max_retries: int = 1, reasoning_effort: str | None = None,
                    python: str | None = None) -> list[str]:
    """The ``lm-eval run`` command line (through this module's ``lm-eval`` delegate) for ``tasks`` prepared in
    ``workdir`` by :func:`prepare`. Results go to ``workdir/results`` (with per-sample logs).

    ``concurrency``: concurrent requests; ``timeout``: seconds per request; ``max_retries``: retries per
    request; ``reasoning_effort``: sent as the ``reasoning_effort`` request field (GPT-OSS: low/medium/high;
    None = the server's default). Raises ``ValueError`` for a model name lm-eval's ``key=value,...`` argument
    syntax cannot carry (containing ``,``), or non-positive limits.
    """
    if "," in model or "=" in model:
        raise ValueError(f"model name {model!r} contains ',' or '=', which lm-eval's --model_args cannot carry")
    if concurrency < 1 or timeout <= 0 or max_retries < 0 or (limit is not None and limit < 1):
        raise ValueError("concurrency >= 1, timeout > 0, max_retries >= 0 and limit >= 1 are required")
    workdir = Path(workdir).resolve()
    model_args = (f"model={model},base_url={chat_url(server)},num_concurrent={concurrency},"
                  f"max_retries={max_retries},timeout={int(timeout) if timeout == int(timeout) else timeout}")
    cmd = [python or sys.executable, "-m", "gptoss_patch.tools.eval_accuracy", "lm-eval", "run",
           "--model", "gptoss-chat-completions", "--model_args", model_args,
           "--tasks", ",".join(tasks), "--include_path", str(workdir / "tasks"), "--apply_chat_template",
           "--output_path", str(workdir / "results"), "--log_samples", "--seed", "0"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if reasoning_effort is not None:
        cmd += ["--gen_kwargs", f"reasoning_effort={reasoning_effort}"]
    return cmd


def answer_from_choice(choice: dict) -> tuple[str | None, str]:
    """(answer text, source) of one chat completion ``choice``.

    ``source`` is ``"content"`` (non-blank ``message.content``), ``"reasoning"`` (content blank, text taken from
    ``reasoning_content`` or else ``reasoning``: the vllm#23694 case, or an answer cut off in the analysis
    channel) or ``"none"`` (neither holds text; the text is then ``None``, which lm-eval scores as wrong).
    """
    message = choice.get("message") or {}
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return content, "content"
    for key in ("reasoning_content", "reasoning"):
        text = message.get(key)
        if isinstance(text, str) and text.strip():
            return text, "reasoning"
    return None, "none"


#: Answer-source counts of this process (written to answer_sources.json by the lm-eval delegate).
ANSWER_SOURCES = {"content": 0, "reasoning": 0, "none": 0, "finish_length": 0}


def register_lm_eval_model():
    """Register lm-eval model ``gptoss-chat-completions``: lm-eval's ``local-chat-completions`` client whose
    ``parse_generations`` takes the answer via :func:`answer_from_choice` (content, else reasoning field) and
    counts the sources in :data:`ANSWER_SOURCES`. Returns the class. Needs ``lm-eval[api]``."""
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalChatCompletion
    from lm_eval.models.utils import postprocess_generated_text

    try:
        from lm_eval.api.registry import get_model

        return get_model("gptoss-chat-completions")
    except (ValueError, KeyError):
        pass

    @register_model("gptoss-chat-completions")
    class GptOssChatCompletion(LocalChatCompletion):
        """lm-eval's chat client, reading the reasoning field when ``message.content`` is empty."""

        def parse_generations(self, outputs, **kwargs) -> list[str]:
            res = []
            for out in outputs if isinstance(outputs, list) else [outputs]:
                choices = out.get("choices") or [{}]
                tmp = [None] * len(choices)
                for pos, choice in enumerate(choices):
                    text, source = answer_from_choice(choice)
                    ANSWER_SOURCES[source] += 1
                    ANSWER_SOURCES["finish_length"] += choice.get("finish_reason") == "length"
                    if text is not None:
                        text = postprocess_generated_text(text, stop=None, think_end_token=self.think_end_token)
                    tmp[choice.get("index", pos)] = text
                res += tmp
            return res

    return GptOssChatCompletion


def _lm_eval_delegate(args: list[str]) -> int:
    """``python -m gptoss_patch.tools.eval_accuracy lm-eval ...``: lm-eval's own CLI with our client registered."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    register_lm_eval_model()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        if "--output_path" in args:
            out = Path(args[args.index("--output_path") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "answer_sources.json").write_text(json.dumps(ANSWER_SOURCES) + "\n")
    return 0


def read_results(results_dir) -> dict:
    """The newest lm-eval ``results_*.json`` under ``results_dir`` plus our ``answer_sources.json``:
    ``{"tasks": {task: {"n": int, "scores": {filter: (value, stderr)}}}, "answer_sources": {...}}``.
    Raises ``FileNotFoundError`` when lm-eval wrote no results there."""
    results_dir = Path(results_dir)
    files = sorted(results_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no lm-eval results_*.json under {results_dir}")
    data = json.loads(files[-1].read_text())
    tasks = {}
    for task, metrics in data["results"].items():
        scores = {}
        for key, value in metrics.items():
            if key.startswith("exact_match,"):
                flt = key.split(",", 1)[1]
                stderr = metrics.get(f"exact_match_stderr,{flt}")
                scores[flt] = (value, stderr if isinstance(stderr, (int, float)) else None)
        n = data.get("n-samples", {}).get(task, {}).get("effective")
        tasks[task] = {"n": n, "scores": scores}
    sources_file = results_dir / "answer_sources.json"
    sources = json.loads(sources_file.read_text()) if sources_file.is_file() else {}
    return {"tasks": tasks, "answer_sources": sources, "file": str(files[-1])}


def _report_lines(results: dict) -> list[str]:
    lines = ["accuracy (lm-eval exact_match, measured on this run):"]
    for task, info in sorted(results["tasks"].items()):
        for flt, (value, stderr) in sorted(info["scores"].items()):
            err = f" +- {100 * stderr:.2f}" if stderr is not None else ""
            lines.append(f"  {task:<14} {flt:<17} {100 * value:6.2f} %{err}  (n={info['n']})")
    src = results["answer_sources"]
    if src:
        lines.append(f"  answers read from message.content: {src.get('content', 0)}, from the reasoning field "
                     f"(content empty): {src.get('reasoning', 0)}, from neither: {src.get('none', 0)}; "
                     f"finish_reason 'length': {src.get('finish_length', 0)}")
        if src.get("reasoning", 0) or src.get("none", 0):
            lines.append("  warning: some answers had an empty message.content - vllm#23694 (final answer in the "
                         "reasoning field), a missing --reasoning-parser openai_gptoss, or a token budget too "
                         "small for the analysis channel (raise --max-tokens)")
    lines.append("published reference figures (NOT measured here; different hardware, subsets and harnesses):")
    for task, what, value in REFERENCE_FIGURES:
        lines.append(f"  {task:<6} {value:<22} {what}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """CLI; exit 0 = evaluated (or dry run), 1 = lm-eval failed or timed out, 2 = usage or data error."""
    from gptoss_patch._cli import at_least, parse, positive_float, prog

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:
        return _lm_eval_delegate(argv[1:])
    ap = argparse.ArgumentParser(prog=prog("gptoss-patch-eval", "gptoss_patch.tools.eval_accuracy"),
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="http://HOST:PORT of the OpenAI-compatible server")
    ap.add_argument("--model", required=True, help="served model name (--served-model-name)")
    ap.add_argument("--mmlu", help="MMLU data: dir of *_test.csv (release layout), or cais/mmlu .jsonl/.parquet")
    ap.add_argument("--gsm8k", help="GSM8K data: test.jsonl (release format) or openai/gsm8k .parquet")
    ap.add_argument("--local", help="a local exact-answer task: .jsonl of {\"question\", \"answer\"} rows (e.g. "
                                    "tests/data/harmony/test.jsonl for the trained tiny GPT-OSS)")
    ap.add_argument("--limit", type=at_least(1), help="evaluate only the first N rows of each task (a subset)")
    ap.add_argument("--max-tokens", type=at_least(1), default=4096, help="max_tokens per answer, reasoning included")
    ap.add_argument("--reasoning-effort", choices=["low", "medium", "high"],
                    help="sent as reasoning_effort (default: the server's, medium for GPT-OSS)")
    ap.add_argument("--concurrency", type=at_least(1), default=8, help="concurrent requests")
    ap.add_argument("--timeout", type=positive_float, default=600, help="seconds per request")
    ap.add_argument("--max-retries", type=at_least(0), default=1, help="retries per failed request")
    ap.add_argument("--deadline", type=positive_float, default=6 * 3600, help="seconds before the whole run is killed")
    ap.add_argument("--workdir", default="gptoss-eval", help="where data, task files and results go")
    ap.add_argument("--dry-run", action="store_true",
                    help="check and convert the data, print the command, send nothing and write nothing to --workdir")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        if args.dry_run:  # read and convert the data (errors show) in a scratch directory; --workdir stays untouched
            import tempfile

            with tempfile.TemporaryDirectory(prefix="gptoss-eval-dry-") as scratch:
                counts = prepare(scratch, mmlu=args.mmlu, gsm8k=args.gsm8k, local=args.local,
                                 max_tokens=args.max_tokens)
        else:
            counts = prepare(args.workdir, mmlu=args.mmlu, gsm8k=args.gsm8k, local=args.local,
                             max_tokens=args.max_tokens)
        cmd = lm_eval_command(server=args.server, model=args.model, workdir=args.workdir, tasks=list(counts),
                              limit=args.limit, concurrency=args.concurrency, timeout=args.timeout,
                              max_retries=args.max_retries, reasoning_effort=args.reasoning_effort)
        if args.deadline <= 0:
            raise ValueError("--deadline must be > 0")
    except ValueError as exc:  # DataError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{t}: {min(n, args.limit or n)} of {n} rows" for t, n in counts.items())
    print(f"# {rows}; at most {sum(min(n, args.limit or n) for n in counts.values()) * (1 + args.max_retries)} "
          f"requests, {args.timeout:g} s each, killed after {args.deadline:g} s")
    print(shlex.join(cmd))
    if args.dry_run:
        return 0
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        print("error: lm-eval is not installed in this interpreter: pip install \"lm-eval[api]\"", file=sys.stderr)
        return 2
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.deadline, start_new_session=True)
    except subprocess.TimeoutExpired:
        print(f"error: lm-eval did not finish within --deadline {args.deadline:g} s (killed)", file=sys.stderr)
        return 1
    if proc.returncode:
        print(f"error: lm-eval exited {proc.returncode}", file=sys.stderr)
        return 1
    results = read_results(Path(args.workdir) / "results")
    results["elapsed_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(results, indent=2) if args.json else "\n".join(_report_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
