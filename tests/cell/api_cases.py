"""The API tests of tests/cell/test_api.py (patched cells) and tests/cell/native_015/test_native_api.py (native
cells): one ``vllm serve`` of the trained harmony model per cell answers them all (see those modules)."""


import os
from pathlib import Path

import pytest
from conftest import ROW

from gptoss_patch_testkit import openai_reference
from gptoss_patch_testkit.jobs import api_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"
#: One server answers every test here: all of them on one xdist worker.
pytestmark = pytest.mark.xdist_group("api")


@pytest.fixture(scope="session")
def report():
    r = api_job.run(WORKDIR, "PIECEWISE")
    api_job.print_report(r)
    return r


@pytest.mark.expensive(60)
@pytest.mark.parametrize("prop", api_job.PROPERTIES)
def test_api(report, prop):
    problems = report.problems(prop)
    assert problems == [], "\n".join(problems)  # in full: a truncated diff hides which piece differs


if openai_reference.available():  # gpt-oss: in the 0.11.0 cell only (the demo's; noxfile OPENAI_REFERENCE_STEP)
    def test_openais_reference_answers_as_the_server(report):
        """The second oracle (OpenAI's ``gpt_oss/torch/model.py``, float32,
        :mod:`gptoss_patch_testkit.openai_reference`): on the same prompts, greedy, it answers every item with the
        server's tokens, so the accuracy through the patched server = transformers' = OpenAI's reference's."""
        assert [r.openai for r in report.items] == [r.server for r in report.items]
        assert report.accuracy("server") == report.accuracy("reference") == report.accuracy("openai") >= \
            api_job.MIN_ACCURACY
