"""The main job: ``vllm serve`` on a simulated Ascend NPU, asked over HTTP, answers with transformers' tokens.

``python -m gptoss_patch_testkit.jobs.serve_job [--mode PIECEWISE|FULL_DECODE_ONLY|eager] [--workdir DIR] [--json]``, in a
matrix-cell environment (real ``vllm`` + ``vllm-ascend`` wheels). What it runs is what a user runs:

1. a deterministic tiny GPT-OSS checkpoint in the public BF16 layout with the real harmony tokenizer files
   (:mod:`gptoss_patch.selftest.tiny`; per-rank shapes of gpt-oss-120b at TP 8: 8 query heads, 1 KV head, MoE
   intermediate 360);
2. ``vllm serve CHECKPOINT`` as a child process - vLLM's API server, its engine-core process, vllm-ascend's
   ``NPUWorker`` and ``NPUModelRunner`` - with ``GPTOSS_PATCH_SIMULATE_NPU=1`` (the CPU NPU simulator,
   :mod:`gptoss_patch_testkit.npu_sim`, in every process) and the seed deployment's flags scaled down:
   ``--compilation-config {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}`` (or
   FULL_DECODE_ONLY, or ``--enforce-eager``), 128-token KV blocks, prefix caching and chunked prefill on;
3. over HTTP, concurrently: harmony chat completions (the server renders the conversation), and raw completions of
   the same conversations by token ids, one longer than the 128-token window and one sharing a full KV block with
   another (prefix-cache hit), and one longer than the step's token budget (chunked prefill);
4. transformers' ``GptOssForCausalLM`` in float32 generates greedily from the same prompt ids (the ids the server
   reports); every generated token must be equal, and the log-probability the server reports for each token must be
   within :data:`LOGPROB_TOLERANCE` of the reference's;
5. ``python -m gptoss_patch.verify --server URL`` against the running server;
6. the report: processes and their patch activation (the per-process log lines of :mod:`gptoss_patch.evidence`),
   ACL graphs captured and replayed, KV-cache size, tokens matched; exit 0 only when everything matched.

Token equality needs float32 (``--dtype float32``; the simulator accepts float32 where the fused operators take
fp16/bf16, a documented extension): bf16 greedy tokens of a random tiny model differ from a float32 reference at
near-ties, whatever the stack (see :data:`gptoss_patch_testkit.jobs.main_job.LOGIT_TOLERANCE`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

#: |server logprob - reference log_softmax| accepted per generated token (float32 both sides; the measured
#: differences are ~1e-5, summation order; a missing sink, window, bias or rope detail moves them by O(0.1-10)).
LOGPROB_TOLERANCE = 1e-3

MODES = ("PIECEWISE", "FULL_DECODE_ONLY", "eager")

#: The problems ``verify --server`` may report against the tiny model: its random weights never emit harmony's channel
#: structure (``<|channel|>analysis<|message|>...<|end|>`` then ``final``), so the reasoning parser finds neither a
#: reasoning nor a final message and both fields stay empty - in the plain chat and in the ``json_schema`` request
#: alike (the schema applies to a final message that never comes). Every other check of the probe (model echo, the
#: reasoning field present through ``--reasoning-parser openai_gptoss``, usage, the raw completion, streamed = non-
#: streamed) must pass.
RANDOM_WEIGHTS_PROBLEMS = ("chat: empty message.content", "chat: the reasoning_content field is empty",
                           "chat: the reasoning field is empty", "json_schema: empty message.content and reasoning")

#: vLLM log lines the report is read from (vllm 0.11-0.19 wording).
_ACTIVATED = re.compile(r"gptoss-patch: pid (\d+) \(([^)]*)\) activated by ([\w-]+): (\w[\w-]*)")
_FIRST_USE = re.compile(r"gptoss-patch: pid (\d+) \(([^)]*)\) first GPT-OSS (\w+) forward on the (\w+) path")
_BUILT = re.compile(r"gptoss-patch: pid (\d+) \(([^)]*)\) built GPT-OSS with \d+ patches applied: ([\w., ]+)")
_GRAPHS = re.compile(r"NPU simulator: pid (\d+): (\d+) NPU graph (captures|replays)")
_HCCL = re.compile(r"NPU simulator: pid (\d+): NPU graph \d+ holds (\d+) HCCL collective task")
_KV = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_FIRST_OP = re.compile(r"NPU simulator: pid (\d+): first torch_npu\.(\w+) launch")
_CAPTURE = re.compile(r"Capturing (?:ACL|CUDA) graphs \(([^)]*)\).*?(\d+)/(\d+) \[")


@dataclass
class Exchange:
    """One HTTP request and its comparison with the reference."""

    kind: str  # "chat" or "completion"
    label: str
    prompt_tokens: int
    generated: list[int]
    reference: list[int]
    max_logprob_diff: float
    finish_reason: str | None
    prompt: list[int] = field(default_factory=list)  # the prompt's token ids
    logprobs: list[float] = field(default_factory=list)  # the server's log-probability of each generated token

    @property
    def matched(self) -> int:
        return sum(1 for a, b in zip(self.generated, self.reference) if a == b)

    @property
    def ok(self) -> bool:
        return (bool(self.generated) and self.generated == self.reference[:len(self.generated)]
                and self.max_logprob_diff <= LOGPROB_TOLERANCE)


@dataclass
class ServeReport:
    """What the job saw; ``ok`` only when the server came up, every exchange matched and ``verify --server`` passed."""

    mode: str
    checkpoint: str = "bf16"
    command: list[str] = field(default_factory=list)
    started: bool = False
    exchanges: list[Exchange] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)
    first_use: list[dict] = field(default_factory=list)
    #: pid -> the patches in force when that process built GPT-OSS (the guard's evidence line)
    built: dict[int, list[str]] = field(default_factory=dict)
    graph_captures: dict[str, int] = field(default_factory=dict)
    npu_graphs: dict[str, int] = field(default_factory=dict)  # simulator counts of one rank (replays: a lower bound)
    #: pid -> HCCL collective tasks held by the NPU graphs that process captured (tensor parallel > 1)
    hccl_tasks: dict[int, int] = field(default_factory=dict)
    #: simulated operator -> pids that launched it (the MoE communication ops of ``npu_sim.graph.ANNOUNCED``)
    sim_ops: dict[str, set[int]] = field(default_factory=dict)
    kv_cache_tokens: int | None = None
    verify_server_exit: int | None = None
    verify_server_problems: list[str] = field(default_factory=list)
    verify_server_output: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""
    log_path: str = ""
    request_error: str | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def log_text(self) -> str:
        """The server's whole output (all its processes)."""
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""

    @property
    def ok(self) -> bool:
        return self.started and bool(self.exchanges) and all(e.ok for e in self.exchanges) and self.verify_ok

    @property
    def verify_ok(self) -> bool:
        """``verify --server`` found nothing but :data:`RANDOM_WEIGHTS_PROBLEMS`."""
        return self.verify_server_exit in (0, 1) and all(p.startswith(RANDOM_WEIGHTS_PROBLEMS)
                                                         for p in self.verify_server_problems)


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(checkpoint: Path, port: int, mode: str, *, max_num_batched_tokens: int = 256,
                  tensor_parallel_size: int = 1, extra: list[str] | None = None) -> list[str]:
    """``vllm serve`` argv (through this interpreter) for ``mode`` (one of :data:`MODES`) at ``tensor_parallel_size``
    ranks (above 1: vLLM's multiprocessing executor, one worker process per rank, as on an 8-NPU host, unless
    ``extra`` names another ``--distributed-executor-backend``, e.g. ``ray``).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
           "--block-size", "128", "--num-gpu-blocks-override", "48",
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--enable-prefix-caching",
           "--enable-chunked-prefill", "--served-model-name", "gpt-oss-tiny", "--reasoning-parser", "openai_gptoss"]
    if tensor_parallel_size != 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if "--distributed-executor-backend" not in (extra or []):  # default: vLLM's multiprocessing executor
            cmd += ["--distributed-executor-backend", "mp"]
    if mode == "eager":
        cmd.append("--enforce-eager")
    else:
        cmd += ["--compilation-config", json.dumps({"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]})]
        off = npugraph_ex_off()
        if off is not None:
            cmd += ["--additional-config", json.dumps(off)]
    return cmd + list(extra or [])


def npugraph_ex_off() -> dict | None:
    """``--additional-config`` that turns vllm-ascend's torchair ``npugraph_ex`` compile backend off, or None on a
    release without it (0.11-0.14).

    From 0.15.0rc1 vllm-ascend compiles the graph pieces of PIECEWISE/FULL modes with torchair's ``npugraph_ex``
    (``get_npu_backend``, ``reduce-overhead``) by default; the simulator does not emulate torchair's compiler, so graph
    modes there run with it off, and vllm-ascend then captures the pieces with its own ``ACLGraphWrapper`` (the path of
    0.11-0.14, same FX graph). The key moved: ``npugraph_ex_config.enable`` (0.15.0rc1,
    ``vllm_ascend/ascend_config.py`` ``NpugraphExConfig``), ``ascend_compilation_config.enable_npugraph_ex`` (0.16.0rc1+,
    ``AscendCompilationConfig``). Decided from what the installed code has, not from its version.
    """
    import inspect

    try:
        import vllm_ascend.ascend_config as ac
    except ImportError:
        return None
    comp = getattr(ac, "AscendCompilationConfig", None)
    if comp is not None and "enable_npugraph_ex" in inspect.signature(comp.__init__).parameters:
        return {"ascend_compilation_config": {"enable_npugraph_ex": False}}
    ex = getattr(ac, "NpugraphExConfig", None)
    if ex is not None and "enable" in inspect.signature(ex.__init__).parameters:
        return {"npugraph_ex_config": {"enable": False}}
    return None


def serve_env(vocab_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The server's environment: the simulator in every process, the harmony vocabulary offline, one OpenMP thread."""
    env = dict(os.environ, GPTOSS_PATCH_SIMULATE_NPU="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               VLLM_LOGGING_LEVEL="INFO", **vocab_env)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core runs in its own process, as users run it
    env.update(_float32_nz_off())
    env.update(extra)
    return env


def _float32_nz_off() -> dict[str, str]:
    """``VLLM_ASCEND_ENABLE_NZ=0`` on the layouts that cast float32 MoE weights to FRACTAL_NZ, which no NZ grouped
    matmul accepts (:data:`gptoss_patch_testkit.jobs.main_job.FLOAT32_NZ_OFF_LAYOUTS`, 0.12.0rc1); else nothing."""
    from gptoss_patch import environment, matrix
    from gptoss_patch_testkit.jobs.main_job import FLOAT32_NZ_OFF_LAYOUTS

    v = environment.installed_versions()
    layout = getattr(matrix.decide(v.vllm_ascend, v.vllm).row, "layout", None)
    return {"VLLM_ASCEND_ENABLE_NZ": "0"} if layout in FLOAT32_NZ_OFF_LAYOUTS else {}


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_npus: int = 2) -> Iterator[str]:
    """A local Ray head node on loopback for ``--distributed-executor-backend ray``; yields its address.

    Started with ``ray start --head`` (Ray from PyPI, in this interpreter's environment) with ``env`` - Ray's worker
    processes inherit the raylet's environment, so the simulator switch and the vocabulary settings reach them as
    they reach a user's Ray workers - and ``num_npus`` units of the ``NPU`` resource, which vLLM's Ray executor
    reserves one per rank on vllm-ascend (``NPUPlatform.ray_device_key``). Stopped with ``ray stop --force`` on exit
    (which stops every Ray process of this user on the host: run one Ray job at a time).

    Raises:
        RuntimeError: ``ray`` is not installed here, or the head did not start (its output in the message).
    """
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        raise RuntimeError(f"Ray is not installed beside {sys.executable}: pip install ray (the 0.11.0 cell has it)")
    import shutil

    port = free_port()
    temp = f"/tmp/ray-gptoss-{os.getpid()}"  # short: Ray's socket paths live under it
    try:  # whatever happens from here on - a failed or timed-out start too - the head is stopped
        start = subprocess.run([str(ray), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                f"--num-cpus={max(4, num_npus)}", f'--resources={{"NPU": {num_npus}}}',
                                "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                               env=env, capture_output=True, text=True, timeout=300)
        if start.returncode != 0:
            raise RuntimeError(f"ray start failed ({start.returncode}):\n{start.stdout[-2000:]}\n"
                               f"{start.stderr[-2000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        try:
            subprocess.run([str(ray), "stop", "--force"], env=env, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:  # never hide the error that brought us here
            pass
        shutil.rmtree(temp, ignore_errors=True)


class Server:
    """A ``vllm serve`` child process in its own process group, its output in ``log``.

    Use as a context manager; :meth:`stop` sends SIGINT to the group, then SIGKILL after ``grace`` seconds.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, port: int):
        self.cmd, self.env, self.log_path, self.port = cmd, env, log, port
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 600.0) -> bool:
        """True once ``GET /health`` answers 200; False when the process exits first or ``timeout`` (s) passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        return False

    def stop(self, grace: float = 20.0) -> int | None:
        """Stop the server's process group; returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        else:  # reap what the engine core may have left behind
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        """The server's output so far."""
        return self.log_path.read_text(errors="replace")


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    if not isinstance(body, dict) or not body.get("choices"):
        raise RuntimeError(f"POST {url}: no choices in the answer: {json.dumps(body)[:500]}")
    return body


def _token_id(entry: dict) -> int:
    tok = entry["token"]
    if not tok.startswith("token_id:"):
        raise RuntimeError(f"logprob entry {entry!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
    return int(tok.split(":", 1)[1])


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int], list[float], str | None]:
    """One greedy harmony chat completion: (prompt ids, generated ids, their logprobs, finish_reason)."""
    d = _post(url + "/v1/chat/completions", {
        "model": "gpt-oss-tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = d["choices"][0]
    content = (c.get("logprobs") or {}).get("content") or []
    ids = c.get("token_ids") or [_token_id(e) for e in content]
    prompt = d.get("prompt_token_ids") or c.get("prompt_token_ids")
    if prompt is None:
        raise RuntimeError("the chat response has no prompt_token_ids (return_token_ids not supported?)")
    return list(prompt), list(ids), [e["logprob"] for e in content], c.get("finish_reason")


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], str | None]:
    """One greedy completion of token ids: (generated ids, their logprobs, finish_reason)."""
    d = _post(url + "/v1/completions", {
        "model": "gpt-oss-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = d["choices"][0]
    lp = c.get("logprobs") or {}
    ids = c.get("token_ids") or [int(t.split(":", 1)[1]) for t in lp.get("tokens", [])]
    return list(ids), list(lp.get("token_logprobs") or []), c.get("finish_reason")


def _messages(effort_question: tuple[str, str]) -> list[dict]:
    from gptoss_patch_testkit.jobs.main_job import SHARED_DEVELOPER

    return [{"role": "system", "content": SHARED_DEVELOPER}, {"role": "user", "content": effort_question[1]}]


def read_log(report: ServeReport, text: str) -> None:
    """Fill the report's processes, builds (patches in force), first uses, graph captures and KV-cache size from the
    server's output."""
    seen = set()
    for m in _ACTIVATED.finditer(text):
        key = (m.group(1), m.group(2))
        if key not in seen:
            seen.add(key)
            report.processes.append({"pid": int(m.group(1)), "name": m.group(2), "by": m.group(3),
                                     "decision": m.group(4)})
    for m in _FIRST_USE.finditer(text):
        report.first_use.append({"pid": int(m.group(1)), "process": m.group(2), "capability": m.group(3),
                                 "path": m.group(4)})
    for m in _BUILT.finditer(text):
        report.built[int(m.group(1))] = [] if m.group(3).strip() == "none" else m.group(3).strip().split(", ")
    for m in _CAPTURE.finditer(text):
        report.graph_captures[m.group(1)] = max(report.graph_captures.get(m.group(1), 0), int(m.group(2)))
    for m in _GRAPHS.finditer(text):
        report.npu_graphs[m.group(3)] = max(report.npu_graphs.get(m.group(3), 0), int(m.group(2)))
    for m in _HCCL.finditer(text):
        report.hccl_tasks[int(m.group(1))] = report.hccl_tasks.get(int(m.group(1)), 0) + int(m.group(2))
    for m in _FIRST_OP.finditer(text):
        report.sim_ops.setdefault(m.group(2), set()).add(int(m.group(1)))
    kv = _KV.search(text)
    report.kv_cache_tokens = int(kv.group(1).replace(",", "")) if kv else None


def run(workdir: Path, mode: str = "PIECEWISE", max_tokens: int = 16, seed: int = 0,
        startup_timeout: float = 900.0, extra_env: dict[str, str] | None = None,
        checkpoint_format: str = "bf16", tensor_parallel_size: int = 1,
        extra_args: list[str] | None = None, verify_server: bool = True) -> ServeReport:
    """Run the job once; returns the report (never raises for a server that fails: ``report.log_tail`` says why).

    ``extra_env``: more environment for the server (e.g. ``GPTOSS_PATCH_DISABLE=1`` to show the unpatched stack).
    ``tensor_parallel_size``: ranks (one worker process each through vLLM's multiprocessing executor);
    ``extra_args``: more ``vllm serve`` arguments (e.g. ``["--enable-expert-parallel"]``).
    ``verify_server``: also run ``verify --server`` against the running server (False for a negative control, whose
    answers are judged by the caller: the report's ``ok`` is then False).
    ``checkpoint_format``: a key of :data:`gptoss_patch_testkit.jobs.main_job.CHECKPOINTS`: ``"bf16"`` (the public BF16
    layout), ``"bf16-tp2"`` (the same layout, the model whose ranks at TP 2 hold gpt-oss-120b's per-rank shapes at TP
    8) or ``"mxfp4"`` (the official MXFP4 layout, which the patched stack dequantizes while loading; the reference
    dequantizes with transformers' own code).

    Raises:
        ValueError: an unknown ``mode``.
    """
    from gptoss_patch.tools import tokenizer
    from gptoss_patch_testkit.jobs import main_job
    from gptoss_patch_testkit.jobs.runner import reference_generate

    report = ServeReport(mode=mode, checkpoint=checkpoint_format)
    t0 = time.perf_counter()
    checkpoint = main_job.ensure_checkpoint(workdir, seed, checkpoint_format)
    vocab = tokenizer.prepare(workdir / "vocab")
    encoding = main_job.harmony_encoding(workdir / "vocab")
    rendered = main_job.render_prompts(encoding)
    long_prompt = rendered[2] + rendered[4][:40]  # > the step budget of 256 tokens: chunked prefill
    shared = rendered[0][:130] + rendered[3][-24:]  # a full 128-token block shared with conversation 0
    report.seconds["setup"] = round(time.perf_counter() - t0, 1)
    port = free_port()
    cmd = serve_command(checkpoint, port, mode, tensor_parallel_size=tensor_parallel_size, extra=extra_args)
    report.command = cmd
    try:
        import importlib.metadata as md

        report.versions = {d: md.version(d) for d in ("vllm", "vllm-ascend")}
    except Exception:  # noqa: BLE001 - informative only
        pass
    t1 = time.perf_counter()
    tag = "-".join([f"{k.removeprefix('GPTOSS_PATCH_').lower()}" for k in sorted(extra_env or {})]
                   + ([checkpoint_format] if checkpoint_format != "bf16" else [])
                   + ([f"tp{tensor_parallel_size}"] if tensor_parallel_size != 1 and "tp" not in checkpoint_format else [])
                   + [a.lstrip("-") for a in extra_args or [] if a.startswith("--")])
    log_path = workdir / f"serve-{mode}{'-' + tag if tag else ''}-{os.getpid()}.log"
    report.log_path = str(log_path)
    with Server(cmd, serve_env(vocab.env, **(extra_env or {})), log_path, port) as server:
        report.started = server.wait_ready(startup_timeout)
        report.seconds["startup"] = round(time.perf_counter() - t1, 1)
        if not report.started:
            report.log_tail = "\n".join(server.log().splitlines()[-40:])
            read_log(report, server.log())
            return report
        t2 = time.perf_counter()
        results: list = []
        try:
            completions = [("conversation 0", rendered[0]), ("conversation 1", rendered[1]),
                           ("prefix hit on conversation 0", shared), ("chunked prefill", long_prompt)]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                chats = [pool.submit(chat, server.url, _messages(q), max_tokens) for q in main_job.QUESTIONS[:2]]
                first = pool.submit(complete, server.url, completions[0][1], max_tokens).result()  # fills the prefix cache
                rest = [pool.submit(complete, server.url, p, max_tokens) for _, p in completions[1:]]
                results = [("chat", f"chat {i}", *f.result()) for i, f in enumerate(chats)]
                comp = [first] + [f.result() for f in rest]
            for (label, prompt), (ids, lps, fin) in zip(completions, comp):
                results.append(("completion", label, prompt, ids, lps, fin))
        except Exception as exc:  # noqa: BLE001 - a failed request is reported with the server's log, not raised
            report.request_error = f"{type(exc).__name__}: {exc}"
            results = []
        report.seconds["requests"] = round(time.perf_counter() - t2, 1)
        if report.request_error:
            report.log_tail = "\n".join(server.log().splitlines()[-40:])
            read_log(report, server.log())
            return report
        if verify_server:
            t3 = time.perf_counter()
            verify = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--server", server.url,
                                     "--model", "gpt-oss-tiny", "--chat-max-tokens", "32", "--json"],
                                    capture_output=True, text=True, timeout=600)
            report.verify_server_exit = verify.returncode
            report.verify_server_output = (verify.stdout + verify.stderr).strip()
            try:
                probe = json.loads(verify.stdout)
                report.verify_server_problems = list(probe["server"]["problems"])
            except (json.JSONDecodeError, KeyError, TypeError):
                report.verify_server_problems = [f"verify --server printed no JSON: "
                                                 f"{report.verify_server_output[-300:]}"]
            report.seconds["verify --server"] = round(time.perf_counter() - t3, 1)
        read_log(report, server.log())
    t4 = time.perf_counter()
    refs = reference_generate(checkpoint, [r[2] for r in results], max_tokens, cache_dir=workdir / "reference-cache")
    report.seconds["reference"] = round(time.perf_counter() - t4, 1)
    import torch

    for (kind, label, prompt, ids, lps, fin), (ref_ids, ref_logits) in zip(results, refs):
        diffs = [abs(lp - float(torch.log_softmax(lg, -1)[tok])) for lp, tok, lg in zip(lps, ids, ref_logits)]
        report.exchanges.append(Exchange(kind, label, len(prompt), ids, ref_ids, max(diffs, default=float("inf")),
                                         fin, list(prompt), list(lps)))
    report.seconds["total"] = round(time.perf_counter() - t0, 1)
    return report


def _reference_model(checkpoint: str | os.PathLike):
    """transformers' float32 ``GptOssForCausalLM`` of ``checkpoint`` in eval mode; an MXFP4 checkpoint's experts
    dequantized as :func:`gptoss_patch_testkit.jobs.runner.reference_generate` does."""
    import torch
    from transformers import GptOssForCausalLM

    from gptoss_patch_testkit.jobs import runner

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        return runner._transformers_mxfp4_model(checkpoint).eval()
    return GptOssForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32).eval()


def logprob_diff_under(checkpoint: str | os.PathLike, exchanges: list[Exchange], edit) -> float:
    """How far the served log-probabilities are from another model: max over every generated token of
    ``|server logprob - log_softmax|`` of transformers' float32 ``GptOssForCausalLM`` of ``checkpoint`` after
    ``edit(model)`` (in place, under ``torch.no_grad``), teacher-forced on each exchange's prompt and served tokens.

    A negative control for :attr:`Exchange.max_logprob_diff`: with ``edit`` computing what a known fault would (e.g.
    the ``down_proj`` bias doubled - added on both of two tensor-parallel ranks before the all-reduce), a served run
    within :data:`LOGPROB_TOLERANCE` of the reference and far from the edited model did not have the fault.

    Args:
        checkpoint: the served BF16 checkpoint directory (:func:`gptoss_patch_testkit.jobs.main_job.ensure_checkpoint`).
        exchanges: :attr:`ServeReport.exchanges` (their ``prompt``, ``generated`` and ``logprobs``).
        edit: ``callable(model) -> None``.

    Returns:
        The max difference in nats.

    Raises:
        ValueError: no exchange generated a token (nothing to compare: a control must not pass vacuously).
    """
    import torch

    model = _reference_model(checkpoint)
    worst = float("-inf")
    with torch.no_grad():
        edit(model)
        for e in exchanges:
            if not e.generated:
                continue
            full = torch.tensor([list(e.prompt) + list(e.generated[:-1])])
            logits = model(full).logits[0, len(e.prompt) - 1:].float()
            lsm = torch.log_softmax(logits, -1)
            worst = max([worst] + [abs(lp - float(lsm[i, tok])) for i, (lp, tok) in enumerate(zip(e.logprobs,
                                                                                             e.generated))])
    if worst == float("-inf"):
        raise ValueError("logprob_diff_under: no generated token to compare")
    return worst


def greedy_under(checkpoint: str | os.PathLike, exchanges: list[Exchange], edit) -> list[list[int]]:
    """transformers' float32 greedy tokens for each exchange's prompt (as many as the server generated), from the model
    of ``checkpoint`` after ``edit(model)`` - e.g. a sliding window of 129 keys, to compare a release that documents
    that band (docs/upstream.md §4.3) with what it serves. Arguments as :func:`logprob_diff_under`."""
    import torch

    model = _reference_model(checkpoint)
    out = []
    with torch.no_grad():
        edit(model)
        for e in exchanges:
            gen = model.generate(torch.tensor([list(e.prompt)]), max_new_tokens=len(e.generated), do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(e.prompt):].tolist())
    return out


def sliding_window(keys: int):
    """An ``edit`` for :func:`logprob_diff_under` / :func:`greedy_under`: transformers' GPT-OSS with its sliding layers
    attending ``keys`` keys (the config's ``sliding_window`` and each sliding layer's copy of it)."""
    def edit(model) -> None:
        model.config.sliding_window = keys
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = keys
    return edit


def print_report(r: ServeReport) -> None:
    """Human-readable report."""
    print(f"GPT-OSS main job: vllm serve ({r.mode}, {r.checkpoint} checkpoint) on a simulated Ascend NPU, "
          f"vllm {r.versions.get('vllm', '?')} + vllm-ascend {r.versions.get('vllm-ascend', '?')}, "
          "against transformers float32")
    print("  command: " + " ".join(r.command[2:]))
    for p in r.processes:
        print(f"  process {p['name']} (pid {p['pid']}): gptoss-patch activated by {p['by']}: {p['decision']}")
    for pid, names in sorted(r.built.items()):
        print(f"  GPT-OSS built in pid {pid} with {len(names)} patches applied: {', '.join(names)}")
    for u in r.first_use:
        print(f"  first GPT-OSS {u['capability']} forward on the {u['path']} path in {u['process']} (pid {u['pid']})")
    if r.graph_captures:
        print("  ACL graphs captured: " + ", ".join(f"{k}: {v}" for k, v in r.graph_captures.items()))
    if r.npu_graphs:
        print(f"  NPU graphs (simulator, per rank): {r.npu_graphs.get('captures', 0)} captured, at least "
              f"{r.npu_graphs.get('replays', 0)} replayed")
    if r.hccl_tasks:
        print("  HCCL collectives captured in those graphs: "
              + ", ".join(f"{n} in pid {pid}" for pid, n in sorted(r.hccl_tasks.items())))
    if r.sim_ops:
        print("  MoE communication operators launched: "
              + ", ".join(f"{op} in pid {', '.join(map(str, sorted(pids)))}" for op, pids in sorted(r.sim_ops.items())))
    if r.kv_cache_tokens is not None:
        print(f"  KV cache: {r.kv_cache_tokens} tokens ({r.kv_cache_tokens // 128} blocks of 128)")
    if not r.started:
        print("  the server did not come up; last lines of its output:\n" + r.log_tail)
    if r.request_error:
        print(f"  a request failed: {r.request_error}")
    for e in r.exchanges:
        print(f"  {e.kind:10s} {e.label:30s} prompt {e.prompt_tokens:4d} tokens: {e.matched}/{len(e.generated)} tokens "
              f"equal to transformers, max |logprob diff| {e.max_logprob_diff:.1e} "
              f"(tolerance {LOGPROB_TOLERANCE:g}) {'ok' if e.ok else 'MISMATCH'}")
    if r.verify_server_exit is not None:
        print(f"  verify --server: exit {r.verify_server_exit}; problems: {r.verify_server_problems or 'none'} "
              f"({'ok: only those of random weights' if r.verify_ok else 'FAILED'})")
    print(f"  time (s): {r.seconds}")
    print("  result: " + ("OK - every token identical" if r.ok else "FAILED"))


def main(argv: list[str] | None = None) -> int:
    """CLI; exit 0 when the server came up and every token matched, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="python -m gptoss_patch_testkit.jobs.serve_job",
                                 description=__doc__.split("\n\n")[0])
    from gptoss_patch import config

    ap.add_argument("--workdir", type=Path,
                    default=Path(config.path(config.CACHE_DIR, "/tmp/gptoss_patch-cache")) / "main-job")
    ap.add_argument("--mode", default="PIECEWISE", choices=MODES)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--checkpoint", default="bf16", choices=["bf16", "mxfp4"],
                    help="the tiny model's layout: public BF16 (default) or the official MXFP4")
    ap.add_argument("--tensor-parallel-size", type=int, default=None, choices=[1, 2],
                    help="ranks, one worker process each (default: 2 for the BF16 model, the seed's TP 8 scaled "
                    "down, whose every rank has gpt-oss-120b's per-rank shapes at TP 8; 1 for MXFP4, as tested)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="expert parallel across the tensor-parallel ranks (EP size = TP size)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.tensor_parallel_size is None:
        args.tensor_parallel_size = 2 if args.checkpoint == "bf16" else 1
    fmt = "bf16-tp2" if args.tensor_parallel_size == 2 and args.checkpoint == "bf16" else args.checkpoint
    report = run(args.workdir, mode=args.mode, max_tokens=args.max_tokens, checkpoint_format=fmt,
                 tensor_parallel_size=args.tensor_parallel_size,
                 extra_args=["--enable-expert-parallel"] if args.enable_expert_parallel else None)
    from gptoss_patch_testkit.jobs.main_job import emit

    return emit(report, args.json, print_report)


if __name__ == "__main__":
    sys.exit(main())
