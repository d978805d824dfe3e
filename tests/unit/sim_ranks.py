"""Run a worker script as two ranks of a simulated-NPU job, in two processes (helper of the unit tests that need
cross-process collectives: ``test_sim_collectives.py``, ``test_sim_mc2.py``)."""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(worker: str, **env_extra: str) -> list[dict]:
    """Start ``python -c worker <rank> <port>`` for ranks 0 and 1 (``GPTOSS_PATCH_*`` removed from the environment,
    then ``env_extra`` added) and return each rank's last ``RESULT <json>`` line, parsed.

    Raises:
        AssertionError: a rank exited non-zero or printed no result (its output and error tails in the message).
        subprocess.TimeoutExpired: a rank ran for more than 300 s (both are killed).
    """
    port = str(_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}
    env.update(env_extra)
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:  # read both ranks at once: a rank blocked on a full pipe would leave the other waiting in gloo
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outputs = list(pool.map(lambda p: p.communicate(timeout=300), procs))
    finally:  # a rank that died leaves the other blocked in gloo: never leave it behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"rank exited {p.returncode}:\n{out[-3000:]}\n{err[-6000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results
