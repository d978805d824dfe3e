"""The operations kit: what an operator deploying GPT-OSS on Ascend runs around ``vllm serve``.

Apart from the runtime patch (:mod:`gptoss_patch._activation`, :mod:`gptoss_patch.patches`), which never imports
this package. Each tool is a console script of the wheel (``[project.scripts]`` in pyproject.toml) and a module
runnable with ``python -m``:

=============================  ======================================  ==================================================
console script                 module                                  job
=============================  ======================================  ==================================================
``gptoss-patch-serve``         :mod:`gptoss_patch.tools.serve`           serve recipes (``120b-tp8``: the seed's 910B3 x 8
                                                                       deployment; ``20b-tp1``), refusing to start when
                                                                       ``verify`` or the checkpoint check fails
``gptoss-patch-checkpoint``    :mod:`gptoss_patch.tools.checkpoint`      checkpoint report: tensors from the safetensors
                                                                       headers, per-rank split, FRACTAL_NZ padding, bytes
                                                                       per card (also ``verify --model DIR``)
``gptoss-patch-tokenizer``     :mod:`gptoss_patch.tools.tokenizer`       the harmony vocabulary offline (``prepare DIR``)
``gptoss-patch-probe``         :mod:`gptoss_patch.tools.server_probe`    one chat and one completion against a running
                                                                       server (also ``verify --server URL``)
``gptoss-patch-eval``          :mod:`gptoss_patch.tools.eval_accuracy`   MMLU / GSM8K from local files, scored by lm-eval
``gptoss-patch-bench``         :mod:`gptoss_patch.tools.bench_serving`   fixed-length serving benchmarks (evalscope perf)
=============================  ======================================  ==================================================

``gptoss-patch-verify`` (:mod:`gptoss_patch.verify`) is the stack check; it hands ``--model`` and ``--server`` to
this package.
"""


class Findings:
    """What the reports of the operations kit share (the checkpoint report's ``CheckReport``, the server probe's
    ``ProbeReport``): a dataclass with ``problems`` and ``warnings`` lists mixes this in for ``ok``, ``as_dict`` and
    the closing lines of its human report."""

    problems: list
    warnings: list

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def as_dict(self) -> dict:
        """JSON-ready dict of the dataclass fields, with ``ok``."""
        from dataclasses import asdict

        d = asdict(self)
        d["ok"] = self.ok
        return d

    def closing_lines(self) -> list[str]:
        """``  warning: ...`` and ``  PROBLEM: ...`` lines, then ``  result: OK | NOT OK``."""
        out = [f"  warning: {w}" for w in self.warnings]
        out += [f"  PROBLEM: {p}" for p in self.problems]
        out.append("  result: " + ("OK" if self.ok else "NOT OK"))
        return out

    def emit(self, as_json: bool) -> int:
        """Print the report (one JSON document, or the human lines of the subclass's ``lines()``); returns the exit
        status of the console scripts: 0 ok, 1 problems."""
        import json

        print(json.dumps(self.as_dict(), indent=2) if as_json else "\n".join(self.lines()))
        return 0 if self.ok else 1
