"""The OpenAI API with real answers (issue 29), patched cells: the trained harmony GPT-OSS
(:mod:`gptoss_patch.selftest.harmony`) behind ``vllm serve`` on the simulated NPU, one server with
``--reasoning-parser openai_gptoss --tool-call-parser openai --enable-auto-tool-choice`` answering every test
(:mod:`gptoss_patch_testkit.jobs.api_job`, tests in tests/cell/api_cases.py): the task's tokens and accuracy equal
transformers', chat answers split into reasoning and content, tool calls (auto, required, named) with valid JSON
arguments and the answer after the tool's result, ``response_format: json_schema`` (also a schema only an applied
grammar satisfies), streaming equal to the non-streamed answer, ``reasoning_effort`` in the rendered system message,
``verify --server``, and a constrained request batched with plain ones.

That last one kills the engine where :func:`gptoss_patch.pairing.structured_outputs` says so (vllm-ascend 0.13.0 with
the xgrammar 0.1.27 its vLLM pins): there the test shows upstream's crash and ``verify`` naming the fix; the product
does not yet avoid it at run time (issue 29). The native cells run the same tests: tests/cell/native_015/test_native_api.py."""

from api_cases import *  # noqa: F401,F403 - the shared fixture and tests (one server per cell answers them all)
