"""gptoss-patch-testkit: what the tests of gptoss-patch need and a production server never does.

* :mod:`gptoss_patch_testkit.npu_sim` - the CPU simulator of ``torch_npu``/``torchair`` (docs/simulator.md). A venv
  with the testkit installed serves it for ``import torch_npu`` while ``GPTOSS_PATCH_SIMULATE_NPU=1``
  (``_gptoss_patch_testkit_startup``, run by ``gptoss_patch_testkit.pth``), in every interpreter and child;
* :mod:`gptoss_patch_testkit.jobs` - the main job (``vllm serve`` on simulated NPUs against transformers,
  :mod:`~gptoss_patch_testkit.jobs.serve_job`), the in-process main job and its runner;
* :mod:`gptoss_patch_testkit.verify` - ``python -m gptoss_patch_testkit.verify``: ``gptoss_patch.verify`` on the
  simulated NPU, plus the main job;
* :mod:`gptoss_patch_testkit.lifecycle`, :mod:`~gptoss_patch_testkit.mxfp4_case`,
  :mod:`~gptoss_patch_testkit.release_source` - checks the cells run, and the PyPI reader of released sources;
* :mod:`gptoss_patch_testkit.config` - the testkit's own environment variables (simulator, caches).

The product (``gptoss_patch``) never imports this package, not even lazily (tests/unit/test_import_graph.py).
"""
