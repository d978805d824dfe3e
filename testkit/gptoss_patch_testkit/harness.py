"""Test-only helpers around the product's self-test harnesses (never in the runtime wheel)."""

from __future__ import annotations


def importable_model_runner() -> None:
    """Make ``vllm_ascend.worker.model_runner_v1`` importable in a cell venv (for tests that only import it).

    Its import needs ``numba`` (vLLM's n-gram proposer), not installed beside the cell's CPU torch: a stub module
    with the names it imports (decorators returning the function) stands in. It also runs vllm-ascend's worker patch
    package (:func:`gptoss_patch.selftest.worker.adapt_worker_patches`), whose vision-model patches need
    ``torchvision`` in 0.12.0rc1 / 0.13.0 (the testkit's loader skips those statements: docs/simulator.md §6).
    Call it before importing the model runner, never in a process that runs the n-gram proposer.
    """
    import sys
    import types

    from gptoss_patch.selftest import worker

    if "numba" not in sys.modules:
        numba = types.ModuleType("numba")
        numba.jit = numba.njit = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
        numba.prange, numba.get_num_threads, numba.set_num_threads = range, (lambda: 1), (lambda n: None)
        sys.modules["numba"] = numba
    worker.adapt_worker_patches()


def cell_layout() -> str | None:
    """The layout of the matrix cell named by ``GPTOSS_CELL`` (for parametrising at collection, and in the children
    a test starts, which have no ``conftest``), or None outside a cell."""
    import os

    from gptoss_patch import matrix

    cell = os.environ.get("GPTOSS_CELL")
    row = next((r for r in matrix.ROWS if r.vllm_ascend == cell), None)
    return row.layout if row is not None else None
