"""Per-process evidence: one log line when a process activates (naming the patches it registered), one when it
builds GPT-OSS (naming the patches in force), one when GPT-OSS first takes a patched path.

"Installed" is not "effective": ``vllm serve`` starts an API server, an engine core and one worker per rank,
each its own interpreter. An operator reading the server's output should see, for every one of them, that
gptoss-patch decided and what (:func:`activation`), and for every worker that GPT-OSS's forward really ran
through our code (:func:`first_use`). The lines go to the logger ``vllm.gptoss_patch``: a child of vLLM's
``vllm`` logger, so vLLM's own handler and format print them (``vllm/logger.py`` configures ``vllm`` at
import, level INFO by default); in a process without vLLM's logging they fall to Python's last-resort
handler, which prints WARNING and above only, so ``python -c pass`` stays silent.

The pattern follows per-process patch evidence in vLLM plugin templates (a line with the pid when a patch
is installed and when the patched path first runs).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

LOGGER_NAME = "vllm.gptoss_patch"

_lock = threading.Lock()
_seen: set[str] = set()


def _role() -> str:
    """The process's role as far as it can be told without importing anything: the multiprocessing name
    (vLLM names its workers, e.g. ``VllmWorker-0``; the engine core ``EngineCore_DP0``) or the program."""
    import multiprocessing

    name = multiprocessing.current_process().name
    if name and name != "MainProcess":
        return name
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def activation(source: str, decision, patches: list[str] | tuple[str, ...] = ()) -> None:
    """Log that this process activated: pid, role, who called, decision, layout, the patches registered.

    Args:
        source: the caller recorded by :func:`gptoss_patch.activate` (``import-hook``, ``vllm-plugin``, ...).
        decision: the :class:`gptoss_patch.matrix.Decision`.
        patches: the names of the patches registered (each applies when its module is imported; :func:`built`
            names those in force when GPT-OSS is built).

    Never raises (start-up must not break on logging).
    """
    try:
        layout = decision.row.layout if decision.row is not None and decision.verdict == "apply" else None
        logging.getLogger(LOGGER_NAME).info(
            "gptoss-patch: pid %d (%s) activated by %s: %s%s - %s%s", os.getpid(), _role(), source, decision.verdict,
            f" (layout {layout})" if layout else "", decision.reason,
            f"; {len(patches)} patches registered: {', '.join(patches)}" if patches else "; no patches registered")
    except Exception:  # noqa: BLE001
        pass


def built(applied: list[str]) -> None:
    """Log that this process built a GPT-OSS model, and the patches in force at that moment (the guard has just
    checked them: every one the row needs is applied).

    Args:
        applied: the names of the applied patches (layout, checkpoint, structured-output and guard patches).

    Never raises.
    """
    try:
        logging.getLogger(LOGGER_NAME).info("gptoss-patch: pid %d (%s) built GPT-OSS with %d patches applied: %s",
                                            os.getpid(), _role(), len(applied), ", ".join(applied) or "none")
    except Exception:  # noqa: BLE001
        pass


def first_use(kind: str, detail: str = "") -> None:
    """Log once per process and ``kind`` (``"attention"``, ``"moe"``, ...) that GPT-OSS took the patched path.

    Args:
        kind: the capability whose patched code just ran.
        detail: e.g. the layer name or the operator path.
    """
    if kind in _seen:
        return
    with _lock:
        if kind in _seen:
            return
        _seen.add(kind)
    try:
        logging.getLogger(LOGGER_NAME).info("gptoss-patch: pid %d (%s) first GPT-OSS %s forward on the patched "
                                            "path%s", os.getpid(), _role(), kind, f": {detail}" if detail else "")
    except Exception:  # noqa: BLE001
        pass


def seen() -> frozenset[str]:
    """The kinds :func:`first_use` has logged in this process."""
    return frozenset(_seen)
