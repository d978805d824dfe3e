"""The OpenAI API with real answers (issue 29), native cells: the same tests as the patched cells'
(tests/cell/test_api.py describes them; they live in tests/cell/api_cases.py), through upstream's own GPT-OSS code.

On the rows whose sliding layers attend 129 keys (the matrix's *deviates*, vllm-ascend >= 0.19.1rc1) the server must
answer as transformers with that band, and the band visibly costs answers (``test_the_129_key_band_costs_answers``)."""

from api_cases import *  # noqa: F401,F403 - the shared fixture and tests (one server per cell answers them all)
