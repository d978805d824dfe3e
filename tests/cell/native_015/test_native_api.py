"""The OpenAI API with real answers (issue 29), native cells: the same tests as the patched cells'
(tests/cell/test_api.py describes them; they live in tests/cell/api_cases.py), through upstream's own GPT-OSS code
with the row's patches: the sliding layers routed to our call (layouts H, G) or built with GPT-OSS's 128-key band
(layout I, where unpatched they attend 129 keys and the decoy at distance 128 costs answers: docs/harmony-model.md)."""

from api_cases import *  # noqa: F401,F403 - the shared fixture and tests (one server per cell answers them all)
