"""The operations kit: what an operator deploying GPT-OSS on Ascend runs around ``vllm serve``.

Apart from the runtime patch (:mod:`gptoss_patch._activation`, :mod:`gptoss_patch.patches`), which never imports
this package. Each tool is a console script of the wheel (``[project.scripts]`` in pyproject.toml) and a module
runnable with ``python -m``:

=============================  ======================================  ==================================================
console script                 module                                  job
=============================  ======================================  ==================================================
``gptoss-patch-serve``         :mod:`gptoss_patch.ops.serve`           serve recipes (``120b-tp8``: the seed's 910B3 x 8
                                                                       deployment; ``20b-tp1``), refusing to start when
                                                                       ``verify`` or the checkpoint check fails
``gptoss-patch-checkpoint``    :mod:`gptoss_patch.ops.checkpoint`      checkpoint report: tensors from the safetensors
                                                                       headers, per-rank split, FRACTAL_NZ padding, bytes
                                                                       per card (also ``verify --model DIR``)
``gptoss-patch-tokenizer``     :mod:`gptoss_patch.ops.tokenizer`       the harmony vocabulary offline (``prepare DIR``)
``gptoss-patch-probe``         :mod:`gptoss_patch.ops.server_probe`    one chat and one completion against a running
                                                                       server (also ``verify --server URL``)
``gptoss-patch-eval``          :mod:`gptoss_patch.ops.eval_accuracy`   MMLU / GSM8K from local files, scored by lm-eval
``gptoss-patch-bench``         :mod:`gptoss_patch.ops.bench_serving`   fixed-length serving benchmarks (evalscope perf)
=============================  ======================================  ==================================================

``gptoss-patch-verify`` (:mod:`gptoss_patch.verify`) is the stack check; it hands ``--model`` and ``--server`` to
this package.
"""
