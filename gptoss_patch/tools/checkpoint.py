"""Checkpoint checks for GPT-OSS on vllm-ascend: config, quantization, tensor names and shapes, TP split.

``check_checkpoint(directory, tp=1)`` reads ``config.json`` and the safetensors *headers* only (through
:func:`gptoss_patch.checkpoints.safetensors_header`, which parses the JSON header and validates the layout against the
file size as the safetensors library does, without reading tensor data), so it runs in seconds even on the 120b
checkpoint. What it checks:

* ``config.json`` exists, is JSON, ``model_type == "gpt_oss"``;
* quantization: none (the BF16 releases ``unsloth/gpt-oss-20b-BF16`` / ``unsloth/gpt-oss-120b-BF16``), or MXFP4
  (``quantization_config.quant_method == "mxfp4"``, the official ``openai/gpt-oss-*`` weights, whose experts are
  ``*_blocks``/``*_scales``): vllm-ascend cannot run FP4 (vllm-ascend#7131), so gptoss-patch dequantizes the experts
  to BF16 while loading (:mod:`gptoss_patch.patches.checkpoint_mxfp4`); their shapes, partners and shard lengths are checked by
  :func:`gptoss_patch.checkpoints.check_files`. Any other method is a problem;
* the per-rank BF16 weight bytes (:func:`rank_bf16_bytes`, an MXFP4 checkpoint counted as dequantized) and whether
  they leave room for the KV cache on a 64 GB Atlas 800T A2 (910B3) card at vLLM's default
  ``gpu_memory_utilization`` 0.9;
* every tensor GPT-OSS needs is present with the shape the config implies (the layout of transformers'
  ``GptOssForCausalLM``, see :mod:`gptoss_patch.selftest.tiny`): attention ``sinks [Nq]``,
  ``{q,k,v,o}_proj`` weights and biases, ``router.{weight,bias}``, experts ``gate_up_proj [E, H, 2I]``,
  ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, norms, embeddings;
* sharded checkpoints through ``model.safetensors.index.json`` (every shard it names must exist and hold
  the tensors the index assigns to it);
* the tensor-parallel size splits the model: ``num_attention_heads % tp == 0``; KV heads either split
  (``num_key_value_heads % tp == 0``) or, when ``tp`` exceeds them, are replicated
  (``tp % num_key_value_heads == 0``) - vLLM's ``QKVParallelLinear`` rule; ``intermediate_size % tp == 0``
  (vLLM's fused MoE splits the expert intermediate dimension across ranks). The per-rank sizes are
  reported as facts, with the per-rank MoE intermediate size, its FRACTAL_NZ padding and whether the installed
  vllm-ascend needs it (:func:`moe_padding_facts`; 2880 / 8 = 360 is padded to 368 where the release NZ-casts).

Command line: ``python -m gptoss_patch.tools.checkpoint DIR [--tensor-parallel-size N] [--json]`` (exit 0 ok,
1 problems, 2 usage error); ``python -m gptoss_patch.verify --model DIR`` includes the same report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gptoss_patch.tools import Findings
from gptoss_patch.checkpoints import REQUIRED_CONFIG, expected_tensors, mismatched, read_headers

__all__ = ["CheckReport", "check_checkpoint", "moe_padding_facts", "main", "BF16_RELEASES", "rank_bf16_bytes",
           "CARD_BYTES"]

#: HBM of one Atlas 800T A2 910B3 card (64 GB) and vLLM's default share of it (``gpu_memory_utilization`` 0.9).
CARD_BYTES = 64 * 2**30
CARD_UTILIZATION = 0.9

#: Where to get weights vllm-ascend can run, by ``num_hidden_layers`` of the official configs (24 / 36).
BF16_RELEASES = {24: "unsloth/gpt-oss-20b-BF16", 36: "unsloth/gpt-oss-120b-BF16"}

#: How many missing/mismatched tensors to list by name before summarising.
_LIST_LIMIT = 8


@dataclass
class CheckReport(Findings):
    """Result of :func:`check_checkpoint`.

    ``problems``: reasons the checkpoint cannot be served (each names the file and, for tensors, the
    tensor); ``warnings``: things that work but deserve attention; ``facts``: model geometry and the
    per-rank split. ``ok`` is True when there are no problems.
    """

    directory: str
    tp: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Human-readable report lines."""
        out = [f"checkpoint {self.directory} at tensor-parallel size {self.tp}:"]
        for key, value in self.facts.items():
            if value is not None:  # e.g. intermediate_padded_to when the size needs no padding
                out.append(f"  {key.replace('_', ' ')}: {value}")
        return out + self.closing_lines()


def _bf16_hint(config: dict) -> str:
    release = BF16_RELEASES.get(config.get("num_hidden_layers"))
    choice = release or " or ".join(BF16_RELEASES.values())
    example = release or BF16_RELEASES[36]
    return f"download the BF16 release instead ({choice}; e.g. 'modelscope download --model={example} --local_dir DIR')"


def _tp_facts(config: dict, tp: int, report: CheckReport) -> None:
    nq, nkv, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    if nq % tp:
        report.problems.append(f"tensor-parallel size {tp} does not divide num_attention_heads {nq}; use a divisor "
                               f"of {nq} (e.g. {', '.join(str(t) for t in (1, 2, 4, 8) if nq % t == 0)})")
    else:
        report.facts["attention_heads_per_rank"] = nq // tp
    if tp <= nkv:
        if nkv % tp:
            report.problems.append(f"tensor-parallel size {tp} does not divide num_key_value_heads {nkv}")
        else:
            report.facts["kv_heads_per_rank"] = nkv // tp
    elif tp % nkv:
        report.problems.append(f"tensor-parallel size {tp} is above num_key_value_heads {nkv} but not a multiple of "
                               "it, so the KV heads can be neither split nor replicated")
    else:
        report.facts["kv_heads_per_rank"] = f"1 (each of the {nkv} KV heads replicated on {tp // nkv} ranks)"
    if inter % tp:
        report.problems.append(f"tensor-parallel size {tp} does not divide intermediate_size {inter} (the expert "
                               "intermediate dimension is split across ranks)")
    else:
        try:
            report.facts.update(moe_padding_facts(config, tp))
        except ValueError as exc:  # a bad environment variable: named, the rest of the report kept
            report.problems.append(f"MoE padding cannot be judged: {exc}")


def moe_padding_facts(config: dict, tp: int) -> dict:
    """The per-rank MoE intermediate size at tensor-parallel size ``tp`` and whether gptoss-patch pads it.

    One answer for ``verify --model``, ``gptoss-patch-checkpoint`` and the serve recipes. The per-rank size is vLLM's
    split (:func:`gptoss_patch.kernels.padding.moe_rank_layout`: ``intermediate_size / tp``, 2880 / 8 = 360 for
    gpt-oss-120b). It is padded to the next multiple of 16 (FRACTAL_NZ's fractal; 368) only where the installed
    vllm-ascend is a row whose layout carries ``nz_padding.pad_moe_intermediate`` (0.11 - 0.14, layouts B, C, E, F:
    :data:`gptoss_patch.matrix.LAYOUT_PATCHES`) and that release casts bf16 MoE weights to FRACTAL_NZ
    (:data:`gptoss_patch.matrix.NZ_RULES`, read with ``VLLM_ASCEND_ENABLE_NZ``) or ``GPTOSS_PATCH_MOE_PAD``
    forces it (:mod:`gptoss_patch.patches.nz_padding`). The row is the one the runtime decides on
    (:func:`gptoss_patch.pairing.judge`): an untested build run as the nearest tested row is answered "decided at
    start-up" (the patch asks that build's own ``is_enable_nz``), not from its version string. A native release that NZ-casts an unaligned intermediate is
    named as such: nothing pads it there (docs/upstream.md for the per-release NZ rules). Needs no torch.

    Args:
        config: the parsed ``config.json`` (``num_local_experts``, ``hidden_size``, ``intermediate_size``).
        tp: the tensor-parallel size (>= 1, dividing ``intermediate_size``).

    Returns:
        ``{"intermediate_size_per_rank": int, "intermediate_padded_to": int | None, "intermediate_padding": str}``:
        ``intermediate_padded_to`` is set only when the answer is yes; ``intermediate_padding`` says yes/no/needed
        and why.

    Raises:
        KeyError: a missing config key. ValueError: ``tp`` does not divide ``intermediate_size``; an unparsable
            ``VLLM_ASCEND_ENABLE_NZ`` or ``GPTOSS_PATCH_MOE_PAD`` (the message names the variable).
    """
    from gptoss_patch import environment, matrix, pairing
    from gptoss_patch.kernels.padding import moe_rank_layout
    from gptoss_patch.matrix import nz_rule
    from gptoss_patch.patches.nz_padding import ALWAYS, NEVER, POLICY_ENV, pad_policy

    lay = moe_rank_layout(config["num_local_experts"], config["hidden_size"], config["intermediate_size"], tp)
    raw = os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1") or "1"
    try:
        env_nz = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_ASCEND_ENABLE_NZ={raw!r} is not an integer (vllm-ascend reads 0, 1 or 2)") from None
    policy = pad_policy()
    # the runtime's own decision (pairing.judge, as activate() takes it): an untested build such as
    # 0.11.0rc1.dev449+g... runs as the nearest tested apply row when structurally compatible - and pads there
    _, decision = pairing.judge()
    va = environment.installed_versions().vllm_ascend
    row = decision.row if decision.verdict == matrix.APPLY else None
    pads = row is not None and "nz_padding.pad_moe_intermediate" in matrix.LAYOUT_PATCHES.get(row.layout or "", ())
    rule = nz_rule(va) if va else None
    untested = pads and row.vllm_ascend != va
    casts = rule is not None and rule.casts(env_nz, eagle=False)
    nz = f"VLLM_ASCEND_ENABLE_NZ={env_nz}"
    yes = False
    if lay.padded is None:
        applies = "no: already a multiple of 16"
    elif va is None:
        applies = ("unknown: vllm-ascend is not installed here (gptoss-patch pads it to "
                   f"{lay.padded} on vllm-ascend 0.11 - 0.14 where the release casts the experts to FRACTAL_NZ)")
    elif not pads:
        if casts:
            applies = (f"NEEDED BUT NOT DONE: vllm-ascend {va} casts bf16 MoE weights to FRACTAL_NZ ({rule.text}; "
                       f"{nz}) and gptoss-patch pads only on 0.11 - 0.14; unset VLLM_ASCEND_ENABLE_NZ or use a "
                       "tensor-parallel size whose per-rank intermediate is a multiple of 16")
        else:
            why = f"keeps bf16 MoE weights in ND with {nz}" if rule is not None else "has no recorded NZ rule"
            applies = f"no (vllm-ascend {va} {why}; gptoss-patch does not pad on this release)"
    elif policy in (ALWAYS, NEVER):
        yes = policy == ALWAYS
        applies = ("yes" if yes else "no") + f" ({POLICY_ENV}={policy})"
    elif untested:
        near = nz_rule(row.vllm_ascend)
        applies = (f"decided at start-up: vllm-ascend {va} is an untested build that gptoss-patch runs as "
                   f"{row.vllm_ascend}; it pads to {lay.padded} if this build casts bf16 MoE weights to FRACTAL_NZ "
                   f"(asked of the build's own is_enable_nz when the weights load, {nz}; on {row.vllm_ascend}: "
                   f"{near.text if near else 'no recorded NZ rule'}). Set {POLICY_ENV}=always or never to fix it")
    elif rule is None:
        applies = f"unknown (vllm-ascend {va}: no recorded NZ rule)"
    elif casts:
        yes = True
        applies = f"yes (vllm-ascend {va} casts bf16 MoE weights to FRACTAL_NZ: {rule.text}; {nz})"
    elif rule.casts(env_nz, eagle=True):
        applies = (f"only with eagle/eagle3 speculative decoding (then vllm-ascend {va} casts bf16 MoE weights to "
                   f"FRACTAL_NZ; {nz})")
    else:
        applies = f"no (vllm-ascend {va} keeps bf16 MoE weights in ND with {nz}: {rule.text})"
    return {"intermediate_size_per_rank": lay.intermediate, "intermediate_padded_to": lay.padded if yes else None,
            "intermediate_padding": applies}


def rank_bf16_bytes(config: dict, tp: int, intermediate_per_rank: int | None = None) -> int:
    """Bytes of one tensor-parallel rank's weights in BF16 (an MXFP4 checkpoint counted after dequantization).

    ``intermediate_per_rank``: the experts' per-rank intermediate after padding (e.g. 368 where
    :func:`moe_padding_facts` says yes); default ``ceil(intermediate_size / tp)``.

    vLLM's GPT-OSS splits across ranks: embeddings and ``lm_head`` by vocabulary, q/o projections and sinks by heads,
    k/v by KV heads (replicated, one head per rank, when ``tp`` exceeds them), experts and their ``gate_up`` bias by
    the intermediate dimension; norms, router and the ``down_proj`` bias are whole on every rank
    (``vllm/model_executor/models/gpt_oss.py``). ``config``: the parsed ``config.json`` (keys of
    :func:`gptoss_patch.checkpoints.expected_tensors`). Raises ``KeyError`` naming a missing key."""
    h, i, e, v = (config["hidden_size"], config["intermediate_size"], config["num_local_experts"],
                  config["vocab_size"])
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nq
    kv = max(nkv // tp, 1) * d
    heads = math.ceil(nq / tp) * d
    inter = intermediate_per_rank or math.ceil(i / tp)
    vocab = math.ceil(v / tp) * h * (1 if config.get("tie_word_embeddings", False) else 2)
    layer = (2 * h + heads * h + heads + 2 * (kv * h + kv) + h * heads + h + math.ceil(nq / tp)
             + e * h + e + e * h * 2 * inter + e * 2 * inter + e * inter * h + e * h)
    return 2 * (vocab + h + config["num_hidden_layers"] * layer)


def _rank_facts(config: dict, tp: int, report: CheckReport, mxfp4: bool) -> None:
    try:
        per_rank = rank_bf16_bytes(config, tp, report.facts.get("intermediate_padded_to"))
    except KeyError:
        return
    budget = CARD_BYTES * CARD_UTILIZATION
    what = " (after dequantizing the MXFP4 experts)" if mxfp4 else ""
    if report.facts.get("intermediate_padded_to"):
        what += f", experts padded to {report.facts['intermediate_padded_to']}"
    report.facts["bf16_weights_per_rank"] = f"{per_rank / 2**30:.2f} GiB{what}"
    if per_rank < budget:
        report.facts["fits_910b3_64gb"] = (f"yes: {(budget - per_rank) / 2**30:.1f} GiB left for the KV cache and "
                                           f"activations at gpu_memory_utilization {CARD_UTILIZATION}")
    else:
        report.problems.append(f"the weights need {per_rank / 2**30:.1f} GiB per rank at tensor-parallel size {tp}, "
                               f"more than {budget / 2**30:.1f} GiB of a 64 GB 910B3 card at gpu_memory_utilization "
                               f"{CARD_UTILIZATION}; use a larger --tensor-parallel-size")


def check_checkpoint(directory, tp: int = 1) -> CheckReport:
    """Check a GPT-OSS checkpoint directory for serving on vllm-ascend at tensor-parallel size ``tp``.

    ``directory``: the checkpoint (``config.json`` + ``*.safetensors`` [+ index]). ``tp``: int >= 1.
    Reads only ``config.json``, the index and the safetensors headers. Returns a :class:`CheckReport`;
    a malformed checkpoint (bad config, MXFP4, missing/misshaped tensor, truncated header, missing
    shard) yields problems naming the file (and tensor), not an exception.
    Raises ``ValueError`` for ``tp`` not an int >= 1, ``FileNotFoundError`` when ``directory`` is not a
    directory, ``ImportError`` when the ``safetensors`` package is missing (``pip install safetensors``).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp (tensor-parallel size) must be an int >= 1, got {tp!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist or is not a directory")
    report = CheckReport(directory=str(directory), tp=tp)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        report.problems.append(f"{config_path}: missing (every Hugging Face checkpoint has one)")
        return report
    except ValueError as exc:
        report.problems.append(f"{config_path}: not valid JSON ({exc})")
        return report
    if not isinstance(config, dict):
        report.problems.append(f"{config_path}: the top level is a {type(config).__name__}, not an object of config "
                               "keys")
        return report
    model_type = config.get("model_type")
    if model_type != "gpt_oss":
        report.problems.append(f"{config_path}: model_type is {model_type!r}, expected 'gpt_oss' (a GPT-OSS "
                               "checkpoint such as unsloth/gpt-oss-20b-BF16)")
    quant = config.get("quantization_config")
    if quant and not isinstance(quant, dict):
        report.problems.append(f"{config_path}: quantization_config is {quant!r}, not an object with quant_method "
                               "(the official MXFP4 config.json has {\"quant_method\": \"mxfp4\", ...})")
    elif quant:
        method = str(quant.get("quant_method", "?"))
        if method.lower() == "mxfp4":
            report.facts["quantization"] = ("MXFP4 experts (official openai/gpt-oss-* layout): Ascend NPUs cannot run "
                                            "FP4 (vllm-ascend#7131); gptoss-patch dequantizes them to BF16 while "
                                            "loading, each rank its own slice")
        else:
            report.problems.append(f"{config_path}: quantization_config.quant_method {method!r}; gptoss-patch "
                                   f"supports the unquantized BF16 checkpoints only: {_bf16_hint(config)}")
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype not in (None, "bfloat16"):
        report.warnings.append(f"{config_path}: torch_dtype {dtype!r}; the tested releases are bfloat16")
    missing_keys = [k for k in REQUIRED_CONFIG if not isinstance(config.get(k), int) or config.get(k) < 1]
    if missing_keys:
        report.problems.append(f"{config_path}: missing or non-positive {', '.join(missing_keys)}")
        return report
    nq = config["num_attention_heads"]
    report.facts.update(
        model_type=model_type, layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        attention_heads=nq, kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // nq,
        experts=config["num_local_experts"], experts_per_token=config.get("num_experts_per_tok"),
        intermediate_size=config["intermediate_size"], sliding_window=config.get("sliding_window"),
        vocab_size=config["vocab_size"], tensor_parallel_size=tp,
    )
    _tp_facts(config, tp, report)

    expected = expected_tensors(config)
    is_mxfp4 = bool(quant) and isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4"
    if is_mxfp4:  # experts as *_blocks/*_scales: checked by checkpoints.check_files
        expected = {k: v for k, v in expected.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    _rank_facts(config, tp, report, is_mxfp4)
    headers = read_headers(directory, report.problems)
    if headers is None:
        return report
    found, unavailable, assignment = headers
    mxfp4 = sorted(k for k in found if k.endswith(("_blocks", "_scales")))
    if mxfp4 and not is_mxfp4:
        report.problems.append(f"{directory / found[mxfp4[0]][0]}: tensor {mxfp4[0]} (and {len(mxfp4) - 1} more "
                               f"*_blocks/*_scales) are MXFP4 expert weights; {_bf16_hint(config)}")
    if is_mxfp4:
        from gptoss_patch.checkpoints import Mxfp4CheckpointError, check_files

        try:
            report.problems += [f"{directory}: {p}" for p in check_files(str(directory), config)]
        except (Mxfp4CheckpointError, KeyError, ValueError) as exc:
            report.problems.append(f"{directory}: MXFP4 experts cannot be checked: {exc}")
    where = "model.safetensors.index.json" if (directory / "model.safetensors.index.json").is_file() else None
    # tensors of a missing or unreadable file are covered by that file's problem; list the others
    if assignment is None:
        missing = [] if unavailable else [k for k in expected if k not in found]
    else:
        missing = [k for k in expected if k not in found and assignment.get(k) not in unavailable]
    for key in missing[:_LIST_LIMIT]:
        report.problems.append(f"{directory / (where or _guess_file(found))}: tensor {key} missing "
                               f"(expected shape {list(expected[key])})")
    if len(missing) > _LIST_LIMIT:
        report.problems.append(f"{directory}: {len(missing) - _LIST_LIMIT} more expected tensors missing")
    wrong = mismatched(expected, found)
    for key in wrong[:_LIST_LIMIT]:
        report.problems.append(f"{directory / found[key][0]}: tensor {key} has shape {list(found[key][1])}, expected "
                               f"{list(expected[key])}" + _shape_hint(key, found[key][1], expected[key]))
    if len(wrong) > _LIST_LIMIT:
        report.problems.append(f"{directory}: {len(wrong) - _LIST_LIMIT} more tensors with a wrong shape")
    dtypes = sorted({found[k][2] for k in expected if k in found})
    if dtypes and dtypes != ["BF16"]:
        report.warnings.append(f"tensor dtypes {dtypes}; the BF16 releases hold BF16 only")
    extra = sorted(set(found) - set(expected) - set(mxfp4))
    if extra:
        report.warnings.append(f"{len(extra)} tensors GPT-OSS does not use (e.g. {extra[0]}); vLLM may reject them")
    report.facts["tensors"] = f"{len(found)} in {len({f for f, _, _ in found.values()})} file(s), " \
                              f"{sum(math.prod(s) for _, s, _ in found.values()) / 1e9:.3g} G elements"
    return report


def _guess_file(found: dict) -> str:
    names = sorted({f for f, _, _ in found.values()})
    return names[0] if len(names) == 1 else "model.safetensors"


def _shape_hint(key: str, got: tuple, want: tuple) -> str:
    if key.endswith("gate_up_proj") and len(got) == 3 and got == (want[0], want[2], want[1]):
        return " (transposed: [E, 2I, H]; GPT-OSS stores gate_up_proj as [E, H, 2I])"
    return ""


def main(argv: list[str] | None = None) -> int:
    """CLI: ``DIR [--tensor-parallel-size N] [--json]``; exit 0 ok, 1 problems, 2 usage error."""
    from gptoss_patch._cli import parse, prog

    ap = argparse.ArgumentParser(prog=prog("gptoss-patch-checkpoint", "gptoss_patch.tools.checkpoint"),
                                 description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        report = check_checkpoint(args.directory, tp=args.tensor_parallel_size)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return report.emit(args.json)


if __name__ == "__main__":
    sys.exit(main())
