"""Per-process evidence: every process that activates logs one line through vLLM's logger, and the first GPT-OSS
forward through our code logs one more - in a spawned worker as in the process that started it."""

import os
import subprocess
import sys

SPAWN = """
import multiprocessing as mp, os

def worker(q):
    import vllm  # vLLM configures its "vllm" logger (stdout, INFO) at import
    import vllm_ascend  # first import: the .pth finder activates here
    import gptoss_patch
    q.put((os.getpid(), gptoss_patch.status().decision))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,), name="VllmWorker-0")
    p.start()
    pid, decision = q.get(timeout=600)
    p.join(60)
    print(f"CHILD {pid} {decision}", flush=True)
"""


def test_a_spawned_worker_logs_its_activation_through_vllms_logger(tmp_path, layout):
    script = tmp_path / "spawn_evidence.py"
    script.write_text(SPAWN)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    child = next(line for line in proc.stdout.splitlines() if line.startswith("CHILD "))
    _, pid, decision = child.split()
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if f"gptoss-patch: pid {pid} (VllmWorker-0) activated by import-hook: {decision}" in line]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"(layout {layout})" in lines[0]
    from gptoss_patch import matrix  # the line names every patch the worker registered: the layout's, the guard

    registered = lines[0].split(" patches registered: ", 1)[1].split(", ")
    assert {*matrix.LAYOUT_PATCHES[layout], "guard.gpt_oss_model"} <= set(registered), lines[0]
    assert "INFO" in lines[0]  # vLLM's own format: the line went through its handler, not Python's last resort
