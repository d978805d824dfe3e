"""Matrix-cell tests: the real vllm + vllm-ascend wheels of one release, on the CPU NPU simulator.

``GPTOSS_CELL`` names the release (set by the nox session). The simulator is switched on
process-wide (``GPTOSS_PATCH_SIMULATE_NPU=1``) so that every child interpreter - fresh ``python``,
``multiprocessing`` spawn children, vLLM's own helpers - gets it through the ``.pth`` start-up hook.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# tests/cell/api_cases.py holds the tests test_api.py and native_015/test_native_api.py import: rewrite its asserts too
pytest.register_assert_rewrite("api_cases")

os.environ["GPTOSS_PATCH_SIMULATE_NPU"] = "1"
for _k in ("GPTOSS_PATCH_DISABLE", "GPTOSS_PATCH_FORCE"):
    os.environ.pop(_k, None)

from gptoss_patch_testkit import npu_sim  # noqa: E402

npu_sim.install()

CELL = os.environ.get("GPTOSS_CELL")


from gptoss_patch import matrix  # noqa: E402

#: The cell's matrix row (None outside a cell). Rows whose vllm-ascend has GPT-OSS support of its own (0.15.0rc1 on:
#: layouts H and G, and the stand-down rows; :func:`gptoss_patch.matrix.native_sinks`) run the calibration suite
#: tests/cell/native_015; the other apply rows run the rest of tests/cell against their layout (``ROW.layout``).
ROW = next((r for r in matrix.ROWS if r.vllm_ascend == CELL), None)
NATIVE_CELL = "0.15.0rc1"
NATIVE_DIR = Path(__file__).resolve().parent / "native_015"


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: a long sweep (many replay steps / examples) that `nox -s soak` runs and "
                                       "`nox -s tests` leaves out; the default run keeps a shorter case of it")
    config.addinivalue_line("markers", "expensive(seconds): the test's rough cost on CI's machine (a `vllm serve` "
                                       "start, a `verify` run with its children); scheduling only: after the xdist "
                                       "groups (which pytest-xdist hands out first, largest first), such tests go "
                                       "out before the other single tests, longest first; they may not use a "
                                       "module- or class-scoped fixture")


def _cost(item) -> float:
    mark = item.get_closest_marker("expensive")
    return float(mark.args[0]) if mark else 0.0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook turns the xdist_group marks into node ids
def pytest_collection_modifyitems(config, items):
    # Every test of the shared testkit `verify` run (fixture verify_simulate, ~60 s) goes to one xdist worker;
    # one test without the mark used to start a second run on the other worker.
    for item in items:
        if "_verify_simulate_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("verify"))
    # Longest first (list scheduling): pytest-xdist hands out the single tests in collection order, so a `vllm serve`
    # test collected last ran alone at the end while the other worker sat idle (0.16.0rc1: 271 s wall for 405 s of
    # tests). Stable: everything unmarked keeps its order, and no marked test uses a module-scoped fixture (moving
    # one would set that fixture up twice on a worker).
    for item in items:
        if _cost(item):
            scoped = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                            if defs and defs[-1].scope in ("module", "class", "package"))
            if scoped:
                raise pytest.UsageError(f"{item.nodeid} is marked expensive but uses the {scoped[0]!r} fixture of "
                                        f"scope {item._fixtureinfo.name2fixturedefs[scoped[0]][-1].scope!r}: moved "
                                        "ahead of its module it would set that fixture up twice on a worker; drop "
                                        "the mark or make the fixture function- or session-scoped")
    items.sort(key=lambda i: -_cost(i))
    if CELL is None:
        raise pytest.UsageError("tests/cell runs inside a matrix cell: use `nox -s cell-<release>` "
                                "(GPTOSS_CELL is not set)")
    if ROW is None or not ROW.tested:
        raise pytest.UsageError(f"GPTOSS_CELL={CELL!r} is not a tested row of gptoss_patch.matrix.ROWS")
    # noxfile.CELLS[release]["tests"] chooses the paths per cell; a mix-up fails here instead of running (or
    # skipping) another cell's suite.
    native = {i.nodeid for i in items if Path(i.path).resolve().is_relative_to(NATIVE_DIR)}
    stand_down = matrix.native_sinks(ROW)  # 0.15.0rc1 on (layouts H, G and stand-down): upstream's own GPT-OSS
    wrong = [i.nodeid for i in items if (i.nodeid in native) != stand_down]
    if wrong:
        where = "only tests/cell/native_015" if stand_down else "tests/cell without native_015"
        raise pytest.UsageError(f"cell {CELL} runs {where}; collected {len(wrong)} test(s) of another cell, "
                                f"e.g. {wrong[0]}")


@pytest.fixture(scope="session")
def cell():
    """The vllm-ascend release of this cell (``GPTOSS_CELL``)."""
    return CELL


@pytest.fixture(scope="session")
def layout():
    """The cell's module-layout family (``gptoss_patch.matrix.LAYOUTS`` key: "B", "C", "E", "F")."""
    return ROW.layout


#: Secrets set in the environment of the shared `testkit `verify`` run: its ``--report`` file must not show them
#: (test_selftest.py ``test_the_report_of_the_shared_run_shows_the_stack_and_no_secrets``).
REPORT_SECRETS = {"VLLM_API_KEY": "sk-do-not-print-1234567890", "HF_TOKEN": "hf_do_not_print"}


@pytest.fixture(scope="session")
def _verify_simulate_run(tmp_path_factory):
    """``python -m gptoss_patch_testkit.verify --selftest --json --report FILE``, run once per test process (with
    :data:`REPORT_SECRETS` and ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in its environment):
    ``(CompletedProcess, report, Markdown report text or None if verify wrote no file)``.

    Raises:
        AssertionError: verify printed no JSON document."""
    import json

    path = tmp_path_factory.mktemp("verify") / "report.md"
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn", **REPORT_SECRETS)
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch_testkit.verify", "--selftest", "--json",
                           "--report", str(path)], capture_output=True, text=True, env=env, timeout=2400)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"testkit verify --json printed no JSON (rc {proc.returncode}): "
                             f"{proc.stdout[-2000:]} {proc.stderr[-3000:]}") from None
    return proc, report, (path.read_text() if path.is_file() else None)


@pytest.fixture(scope="session")
def verify_simulate(_verify_simulate_run):
    """``python -m gptoss_patch_testkit.verify --selftest --json`` (with ``--report``: :func:`verify_simulate_md`),
    run once per test process: ``(CompletedProcess, report)``.

    Shared by test_main_job (its ``main_job`` part), test_activation (status and children: what ``verify --json``
    reports, since the cell already simulates the NPU; the testkit's verify adds the main job only) and test_selftest (its
    ``selftest`` part and the report file). ``pytest_collection_modifyitems`` gives every test that uses it the
    ``xdist_group("verify")`` mark, so under ``pytest -n --dist loadgroup`` one worker runs it once."""
    return _verify_simulate_run[:2]


@pytest.fixture(scope="session")
def verify_simulate_md(_verify_simulate_run):
    """The Markdown ``--report`` file of the :func:`verify_simulate` run (``str``).

    Raises:
        AssertionError: verify wrote no report file (only the tests that read the report fail)."""
    proc, _, text = _verify_simulate_run
    assert text is not None, f"verify --report wrote no file (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return text


def run_python(code: str, **env_overrides) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this cell's venv (activation only through the installed .pth)."""
    env = dict(os.environ)
    for k, v in env_overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


_QUERY_ON_HOST = """
import dataclasses, json
import vllm_ascend  # noqa: F401 - activation through the .pth
from gptoss_patch import selftest
from gptoss_patch.selftest import attention as attention_case
from gptoss_patch.selftest import native as native_015


def left_on_host(build):
    def build_case(*args, **kwargs):
        case = build(*args, **kwargs)
        return dataclasses.replace(case, query=case.query.cpu())  # as if the harness had no .to("npu") for it
    return build_case


attention_case.build_case = left_on_host(attention_case.build_case)
native_015.build_case = left_on_host(native_015.build_case)
print("SELFTEST " + json.dumps(selftest.run().as_dict()))
"""


def selftest_with_query_on_host() -> dict:
    """``gptoss_patch.selftest.run()`` on the simulator in a fresh interpreter of this cell's venv, its attention
    harnesses (``attention_case.build_case``, ``native_015.build_case``) made to leave the query in host memory - the
    placement a missing ``.to("npu")`` would leave on an Ascend host. Returns ``SelfTest.as_dict()``.

    Raises:
        AssertionError: the child printed no result line.
    """
    import json

    proc = run_python(_QUERY_ON_HOST, GPTOSS_PATCH_SIMULATE_NPU="1", GPTOSS_PATCH_SIM_FAULT=None)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SELFTEST ")), None)
    assert line is not None, f"no self-test result (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    return json.loads(line.removeprefix("SELFTEST "))


def run_selftest(fault: str | None = None, *extra: str, **env_overrides: str) -> tuple[subprocess.CompletedProcess,
                                                                                       dict]:
    """``python -m gptoss_patch.verify --selftest --json --no-children EXTRA`` in a fresh interpreter of this cell's
    venv (the simulator through ``GPTOSS_PATCH_SIMULATE_NPU=1``, no main job), with the operator deviation ``fault``
    injected into the simulator (``GPTOSS_PATCH_SIM_FAULT``; docs/simulator.md) and ``env_overrides`` set. The
    children are checked by the shared run (:func:`_verify_simulate_run`). Returns ``(CompletedProcess, report)``.

    Raises:
        AssertionError: verify printed no JSON document.
    """
    import json

    env = dict(os.environ)
    env.pop("GPTOSS_PATCH_SIM_FAULT", None)
    if fault:
        env["GPTOSS_PATCH_SIM_FAULT"] = fault
    env.update(env_overrides)
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--selftest", "--json", "--no-children", *extra],
                          capture_output=True, text=True, env=env, timeout=1200)
    try:
        return proc, json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"verify --selftest --json printed no JSON (rc {proc.returncode}): "
                             f"{proc.stdout[-2000:]} {proc.stderr[-3000:]}") from None


def selftest_without_torch_npu(report_path) -> tuple[subprocess.CompletedProcess, dict, str]:
    """``verify --selftest --json --no-children --report REPORT_PATH`` with no ``torch_npu`` to import (the simulator
    switched off: ``GPTOSS_PATCH_SIMULATE_NPU`` unset), as on an Ascend host whose CANN environment was not sourced.
    Returns ``(CompletedProcess, report, the report file's text)``.

    Raises:
        AssertionError: verify printed no JSON document or wrote no report file.
    """
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("GPTOSS_PATCH_SIMULATE_NPU", "GPTOSS_PATCH_SIM_FAULT")}
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--selftest", "--json", "--no-children",
                           "--report", str(report_path)], capture_output=True, text=True, env=env, timeout=600)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"verify printed no JSON (rc {proc.returncode}): {proc.stdout[-2000:]} "
                             f"{proc.stderr[-3000:]}") from None
    assert os.path.exists(report_path), f"no report file written (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return proc, report, open(report_path, encoding="utf-8").read()


def check_selftest_without_torch_npu(report_path) -> None:
    """The self-test fails with one ``bring-up`` line carrying the hint, exit 1, no traceback, the report written."""
    from gptoss_patch.selftest.device import NO_NPU_HINT

    proc, report, text = selftest_without_torch_npu(report_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    st = report["selftest"]
    assert st["ok"] is False and [c["case"] for c in st["cases"]] == ["bring-up"], st
    assert NO_NPU_HINT in st["cases"][0]["error"], st["cases"][0]
    assert any(p.startswith("self-test failed: bring-up") for p in report["problems"]), report["problems"]
    assert "Result: **NOT OK**" in text and "bring-up" in text
