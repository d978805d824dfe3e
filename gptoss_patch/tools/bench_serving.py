"""Performance runner: fixed-length serving benchmarks of an OpenAI-compatible server through ``evalscope perf``.

    gptoss-patch-bench --server http://HOST:8000 --model NAME --tokenizer CHECKPOINT_DIR \\
        [--scenario 128/128 --scenario 1024/1024] [--concurrency 1,10,64] [--prompts-per-level 5] [--dry-run]

For each scenario ``IN/OUT`` (prompt tokens / output tokens; default 128/128 and 1024/1024) it runs one
``evalscope perf`` sweep over the concurrency levels - the command the seed deployment write-up and
vllm-ascend PR #4467 measured with: ``--api openai`` on ``/v1/completions`` (raw completions: the chat path
renders harmony and ends early, vllm perf-eval PR #77), ``--dataset random`` prompts of exactly IN tokens of the
given tokenizer (read from a local directory; nothing is downloaded), ``--min-tokens OUT --max-tokens OUT`` and
``--extra-args '{"ignore_eos": true}'`` so every request generates OUT tokens, streaming on (TTFT and ITL need
the token stream), temperature 0. Then it prints per level what users compare: output tokens/s (and total
tokens/s), TTFT, TPOT and ITL (mean, median, p99), and the published reference figures beside them, labelled
as not measured here. The metrics are evalscope's (``benchmark_summary.json`` / ``benchmark_percentile.json``
of each level); this module builds the command and reads those files.

It also checks what makes such figures meaningless: failed requests, and an average output length other than
OUT (a server that ignores ``ignore_eos`` or ``min_tokens`` stops early and looks fast) - both make the exit
code 1.

Why evalscope and not ``vllm bench serve``: the figures to compare with were measured with evalscope, and
``vllm bench serve`` needs vLLM importable with a device platform on the client - on a host without an
accelerator vLLM 0.11's CLI stops with "Failed to infer device type".

Requests are bounded: per level ``prompts-per-level x concurrency`` requests plus evalscope's one connection
test, each bounded by ``--request-timeout`` seconds (evalscope ``--total-timeout``, which also bounds the
connection test's retries), and each scenario's process is killed after ``--deadline`` seconds.
``--dry-run`` prints the exact commands and sends nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["Scenario", "parse_scenario", "evalscope_command", "read_level", "REFERENCE_FIGURES", "main"]

#: Published figures printed beside the measured ones; none was measured by this project.
REFERENCE_FIGURES = [
    "vllm-ascend PR #4467 (vLLM 0.12.0, gpt-oss, 10 concurrent, 128/128, evalscope): TTFT 810 ms (small ops) -> "
    "228 ms (FIA eager) -> 217 ms (PIECEWISE ACL graph); TPOT 512 -> 79 -> 20 ms",
    "seed write-up (gpt-oss-20b BF16, one 910B3): the small-op baseline it improved on, 10 concurrent, 128/128: "
    "TTFT 319 ms, TPOT 136 ms, mean latency 17.61 s; reported gains TTFT -31.97 %, TPOT -85.29 %, TPS x6.48",
    "seed write-up (gpt-oss-120b BF16, 910B3 x 8, TP 8, PIECEWISE): TTFT -36.58 %, TPOT -99.04 %, TPS x67 versus "
    "the same baseline; its command: evalscope perf 1024/1024, --parallel 417 833, --number 1000 2000, ignore_eos",
    "SemiAnalysis InferenceX #828 (H100, vLLM, gpt-oss-120b MXFP4, TP 2, concurrency 64, probably 1k/1k): "
    "2061.5 output tok/s per GPU, TPOT 15.21 ms",
]


class Scenario(tuple):
    """``(input_len, output_len)`` in tokens, e.g. ``Scenario((128, 128))``; ``label`` is ``in128_out128``."""

    @property
    def label(self) -> str:
        return f"in{self[0]}_out{self[1]}"


def parse_scenario(text: str) -> Scenario:
    """``"IN/OUT"`` -> :class:`Scenario`; ``ValueError`` unless both are integers >= 1."""
    parts = text.split("/")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 1:
        raise ValueError(f"scenario must be IN/OUT token counts like 128/128, got {text!r}")
    return Scenario(values)


def completions_url(server: str) -> str:
    """``http(s)://HOST:PORT[/v1]`` -> ``.../v1/completions``; ``ValueError`` for anything else."""
    from gptoss_patch.tools.server_probe import _base

    return _base(server) + "/completions"


def default_evalscope() -> str:
    """``evalscope`` next to this interpreter (a venv's ``bin``), else the one on ``PATH``, else ``"evalscope"``."""
    beside = Path(sys.executable).with_name("evalscope")
    if beside.is_file():
        return str(beside)
    return shutil.which("evalscope") or "evalscope"


def evalscope_command(*, server: str, model: str, tokenizer, scenario: Scenario, concurrency: list[int],
                      prompts_per_level: int, output_dir, request_timeout: int = 1800, seed: int = 0,
                      evalscope: str | None = None) -> list[str]:
    """The ``evalscope perf`` command of one scenario swept over ``concurrency`` levels.

    Level ``c`` sends ``prompts_per_level * c`` requests; results go to
    ``output_dir/<scenario label>/parallel_<c>_number_<n>/``. ``evalscope`` is a command prefix (split with
    shell rules; default :func:`default_evalscope`). Raises ``ValueError`` for a URL that is not http(s),
    empty or non-positive levels, or non-positive counts.
    """
    if not concurrency or min(concurrency) < 1 or prompts_per_level < 1 or request_timeout < 1:
        raise ValueError("concurrency levels, prompts_per_level and request_timeout must be >= 1")
    if not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer!r} is not a directory (give the checkpoint or tokenizer "
                         "directory: evalscope builds the random prompts with it, offline)")
    prefix = shlex.split(evalscope) if evalscope else [default_evalscope()]
    in_len, out_len = scenario
    return [
        *prefix, "perf",
        "--model", model, "--url", completions_url(server), "--api", "openai",
        "--dataset", "random", "--tokenizer-path", str(Path(tokenizer).resolve()),
        "--min-prompt-length", str(in_len), "--max-prompt-length", str(in_len), "--prefix-length", "0",
        "--min-tokens", str(out_len), "--max-tokens", str(out_len),
        "--extra-args", json.dumps({"ignore_eos": True}),
        "--parallel", *[str(c) for c in concurrency],
        "--number", *[str(prompts_per_level * c) for c in concurrency],
        "--stream", "--temperature", "0", "--seed", str(seed), "--total-timeout", str(request_timeout),
        "--outputs-dir", str(Path(output_dir).resolve()), "--name", scenario.label, "--no-timestamp",
    ]


def _percentiles(rows: list[dict], metric: str) -> dict:
    out = {}
    for row in rows:
        if row.get("Percentiles") in ("50%", "99%"):
            out["p" + row["Percentiles"].rstrip("%")] = row.get(metric)
    return out


def read_level(level_dir) -> dict:
    """One level's figures from evalscope's ``benchmark_summary.json`` and ``benchmark_percentile.json``.

    Returns ``{"concurrency", "requests", "succeeded", "failed", "output_tok_s", "total_tok_s", "avg_input_tokens",
    "avg_output_tokens", "ttft_ms": {"mean", "p50", "p99"}, "tpot_ms": {...}, "itl_ms": {...}}``.
    Raises ``FileNotFoundError`` when evalscope wrote no summary there.
    """
    level_dir = Path(level_dir)
    summary = json.loads((level_dir / "benchmark_summary.json").read_text())
    pct_file = level_dir / "benchmark_percentile.json"
    pct = json.loads(pct_file.read_text()) if pct_file.is_file() else []
    return {
        "concurrency": summary.get("Concurrency"),
        "requests": summary.get("Total Requests"),
        "succeeded": summary.get("Success Requests"),
        "failed": summary.get("Failed Requests"),
        "output_tok_s": summary.get("Output Throughput (tok/s)"),
        "total_tok_s": summary.get("Total Throughput (tok/s)"),
        "avg_input_tokens": summary.get("Avg Input Tokens"),
        "avg_output_tokens": summary.get("Avg Output Tokens"),
        "ttft_ms": {"mean": summary.get("Avg TTFT (ms)"), **_percentiles(pct, "TTFT (ms)")},
        "tpot_ms": {"mean": summary.get("Avg TPOT (ms)"), **_percentiles(pct, "TPOT (ms)")},
        "itl_ms": {"mean": summary.get("Avg ITL (ms)"), **_percentiles(pct, "ITL (ms)")},
    }


def check_level(level: dict, scenario: Scenario, requested: int) -> list[str]:
    """Problems of one level: missing or failed requests, output length other than the scenario's."""
    problems = []
    if level["succeeded"] != requested or level["failed"]:
        problems.append(f"{level['succeeded']} of {requested} requests succeeded ({level['failed']} failed)")
    out = level["avg_output_tokens"]
    if out is None or abs(out - scenario[1]) > 0.5:
        problems.append(f"average output {out} tokens, requested {scenario[1]}: the server did not honour "
                        "ignore_eos/min_tokens, so throughput and latency are not comparable")
    return problems


def _fmt(stats: dict) -> str:
    return "/".join("-" if stats.get(k) is None else f"{stats[k]:.1f}" for k in ("mean", "p50", "p99"))


def report_lines(results: list[dict]) -> list[str]:
    """Human-readable table of measured levels, then the published figures."""
    lines = ["serving benchmark (evalscope perf, /v1/completions, ignore_eos; measured on this run):",
             f"  {'scenario':<15}{'conc':>5}{'reqs ok':>9}{'out tok/s':>11}{'total tok/s':>12}"
             f"  {'TTFT ms mean/p50/p99':<24}{'TPOT ms mean/p50/p99':<24}{'ITL ms mean/p50/p99':<24}"]
    for res in results:
        for lv in res["levels"]:
            ok = f"{lv['succeeded']}/{lv['requests']}"
            lines.append(f"  {res['scenario']:<15}{lv['concurrency']:>5}{ok:>9}{lv['output_tok_s']:>11.2f}"
                         f"{lv['total_tok_s']:>12.2f}  {_fmt(lv['ttft_ms']):<24}{_fmt(lv['tpot_ms']):<24}"
                         f"{_fmt(lv['itl_ms']):<24}")
        lines += [f"  PROBLEM: {res['scenario']}: {p}" for p in res["problems"]]
    lines.append("published reference figures (NOT measured here; other hardware, models and versions):")
    lines += [f"  - {ref}" for ref in REFERENCE_FIGURES]
    return lines


def main(argv: list[str] | None = None) -> int:
    """CLI; exit 0 = every level ran cleanly (or dry run), 1 = a run failed or a check failed, 2 = usage error."""
    from gptoss_patch._cli import at_least, int_list, parse, positive_float, prog

    ap = argparse.ArgumentParser(prog=prog("gptoss-patch-bench", "gptoss_patch.tools.bench_serving"),
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="http://HOST:PORT of the OpenAI-compatible server")
    ap.add_argument("--model", required=True, help="served model name (--served-model-name)")
    ap.add_argument("--tokenizer", required=True, help="local checkpoint/tokenizer directory of the served model")
    ap.add_argument("--scenario", action="append", help="IN/OUT token counts (repeatable; default 128/128 and "
                    "1024/1024)")
    ap.add_argument("--concurrency", type=int_list(1), default="1,10,64",
                    help="comma-separated concurrency levels")
    ap.add_argument("--prompts-per-level", type=at_least(1), default=5,
                    help="requests per level = this x concurrency")
    ap.add_argument("--request-timeout", type=at_least(1), default=1800, help="seconds per request")
    ap.add_argument("--deadline", type=positive_float, default=4 * 3600,
                    help="seconds before one scenario's run is killed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="gptoss-bench", help="where evalscope writes its results")
    ap.add_argument("--evalscope", help="evalscope command (default: the one beside this python, else on PATH)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, send nothing")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        scenarios = [parse_scenario(s) for s in (args.scenario or ["128/128", "1024/1024"])]
        levels = args.concurrency
        if args.deadline <= 0:
            raise ValueError("--deadline must be > 0")
        commands = [(sc, evalscope_command(server=args.server, model=args.model, tokenizer=args.tokenizer,
                                           scenario=sc, concurrency=levels, prompts_per_level=args.prompts_per_level,
                                           output_dir=args.output_dir, request_timeout=args.request_timeout,
                                           seed=args.seed, evalscope=args.evalscope)) for sc in scenarios]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    per_run = sum(args.prompts_per_level * c + 1 for c in levels)
    print(f"# {len(commands)} scenario(s) x levels {levels}: at most {per_run * len(commands)} requests "
          f"({args.request_timeout} s each), each scenario killed after {args.deadline:g} s")
    for _, cmd in commands:
        print(shlex.join(cmd))
    if args.dry_run:
        return 0
    program = commands[0][1][0]
    if shutil.which(program) is None:
        print(f"error: {program!r} cannot be run: install evalscope with its perf extra (pip install "
              "\"evalscope[perf]\") or pass --evalscope", file=sys.stderr)
        return 2
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    results, status = [], 0
    for scenario, cmd in commands:
        res = {"scenario": scenario.label, "levels": [], "problems": []}
        results.append(res)
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.deadline, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            res["problems"].append(f"evalscope did not finish within --deadline {args.deadline:g} s (killed)")
            status = 1
            continue
        if proc.returncode:
            res["problems"].append(f"evalscope exited {proc.returncode}: {proc.stdout[-1500:]}")
            status = 1
        for c in levels:
            level_dir = Path(args.output_dir) / scenario.label / f"parallel_{c}_number_{args.prompts_per_level * c}"
            try:
                level = read_level(level_dir)
            except (FileNotFoundError, ValueError) as exc:
                res["problems"].append(f"concurrency {c}: no evalscope results ({exc})")
                status = 1
                continue
            res["levels"].append(level)
            problems = [f"concurrency {c}: {p}" for p in check_level(level, scenario, args.prompts_per_level * c)]
            res["problems"] += problems
            status = status or int(bool(problems))
    print(json.dumps({"results": results, "reference_figures": REFERENCE_FIGURES}, indent=2) if args.json
          else "\n".join(report_lines(results)))
    return status


if __name__ == "__main__":
    sys.exit(main())
