"""``python -m gptoss_patch.verify --report FILE``: one Markdown file to attach to a bug report.

It holds what :func:`gptoss_patch.verify.collect` found (versions, decision, capabilities, each patch's state and
drift, activation in this process and in a fresh / spawn / forkserver child, the harmony vocabulary, problems and
warnings), the self-test table (:mod:`gptoss_patch.selftest`), the interpreter, how activation is wired (the
``gptoss_patch.pth`` in site-packages, the ``vllm.general_plugins`` entry point) and the environment variables that
steer gptoss-patch and vLLM - only names starting with ``GPTOSS_PATCH_`` or ``VLLM_``, and never the value of one that
looks like a secret (:func:`safe_environment`). Nothing else from the environment is written.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import Any, Mapping

#: Variable names written to the report (prefixes).
PREFIXES = ("GPTOSS_PATCH_", "VLLM_")
#: A name containing one of these words holds a secret: its value is never written.
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SIGNATURE", re.IGNORECASE)
#: A value that looks like a credential whatever its name (API-key prefixes, bearer tokens, URLs with a user:password,
#: long unbroken base64/hex strings).
_SECRET_VALUE = re.compile(r"^(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA|eyJ)|Bearer\s|://[^/\s:@]+:[^/\s@]+@"
                           r"|^[A-Za-z0-9+/_=-]{32,}$")
REDACTED = "(set; value not shown)"


def safe_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``GPTOSS_PATCH_*`` / ``VLLM_*`` variables of ``env`` (default :data:`os.environ`), sorted by name, each
    value replaced by :data:`REDACTED` when the name or the value looks like a secret (``VLLM_API_KEY``, a
    ``sk-...`` token, a URL with credentials). Other variables are left out entirely."""
    env = os.environ if env is None else env
    out = {}
    for name in sorted(env):
        if not name.startswith(PREFIXES):
            continue
        value = env[name]
        out[name] = REDACTED if _SECRET_NAME.search(name) or _SECRET_VALUE.search(value.strip()) else value
    return out


def activation_wiring() -> dict[str, Any]:
    """How gptoss-patch gets activated in this environment: the ``gptoss_patch.pth`` files on ``sys.path`` (each
    site-packages directory that holds one), the ``vllm.general_plugins`` entry point(s) named ``gptoss_patch``, and
    the installed distribution's version (``importlib.metadata``; never raises)."""
    from importlib import metadata

    pth = sorted({os.path.join(p, "gptoss_patch.pth") for p in sys.path
                  if p and os.path.isfile(os.path.join(p, "gptoss_patch.pth"))})
    try:
        eps = [f"{ep.name} = {ep.value}" for ep in metadata.entry_points(group="vllm.general_plugins")
               if ep.name == "gptoss_patch"]
    except Exception:  # noqa: BLE001 - a broken metadata file must not stop the report
        eps = []
    try:
        dist = metadata.version("gptoss-patch")
    except metadata.PackageNotFoundError:
        dist = None
    return {"pth_files": pth, "plugin_entry_points": eps, "distribution": dist}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def render(report: Mapping[str, Any], argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> str:
    """The Markdown text of ``report`` (the dict of :func:`gptoss_patch.verify.collect`, with ``selftest`` when the
    self-test ran). ``argv``: the verify arguments, shown as the command; ``env``: see :func:`safe_environment`."""
    st = report.get("status", {})
    v = st.get("versions", {})
    lines = ["# gptoss-patch verify report", ""]
    if argv is not None:
        lines += [f"Command: `python -m gptoss_patch.verify {' '.join(argv)}`", ""]
    lines += [f"Result: **{'OK' if report.get('ok') else 'NOT OK'}**", ""]
    lines += ["## Versions", ""]
    lines += _table(["package", "version"], [
        ["vllm-ascend", v.get("vllm_ascend")], ["vllm", v.get("vllm")], ["torch", v.get("torch")],
        ["torch-npu", v.get("torch_npu") or ("simulated" if v.get("simulated_npu") else None)],
        ["CANN", v.get("cann")], ["Python", v.get("python")],
        ["gptoss-patch", activation_wiring()["distribution"]]])
    lines += ["", "## Decision", "",
              f"`{st.get('decision')}`{' (FORCED)' if st.get('forced') else ''} - {st.get('reason')}", ""]
    caps = st.get("capabilities") or {}
    if caps:
        lines += ["## Capabilities", ""]
        lines += _table(["capability", "state", "note"], [[n, c["state"], c["note"]] for n, c in caps.items()])
        lines.append("")
    lines += ["## Patches", ""]
    if st.get("patches"):
        lines += _table(["patch", "state", "target", "drift / reason"],
                        [[p["name"], p["state"], p["target"], p.get("drift") if p["state"] == "applied"
                          else p.get("reason")] for p in st["patches"]])
    else:
        lines.append("none registered (decision is not *apply*)")
    lines += ["", "## Self-test", ""]
    sf = report.get("selftest")
    if sf and not sf["cases"]:
        lines.append("not run: " + "; ".join(sf["not_covered"]))
    elif sf:
        lines += [f"On {sf['device']} ({sf['rows']}); reference: transformers GPT-OSS in float32; "
                  f"{'passed' if sf['ok'] else 'FAILED: ' + ', '.join(sf['failed'])} ({sf['seconds']} s)", ""]
        lines += _table(["case", "max error", "tolerance", "result", "note"], [
            [c["case"], "-" if c["max_error"] is None else f"{c['max_error']:.3e}",
             "-" if c["tolerance"] is None else f"{c['tolerance']:.3e}",
             "skip" if c["skipped"] else ("PASS" if c["ok"] else "FAIL"), c["error"] or c["note"]]
            for c in sf["cases"]])
        lines += [""] + [f"- not covered: {n}" for n in sf["not_covered"]]
    else:
        lines.append("not run")
    lines += ["", "## Activation per process kind", ""]
    rows = [["this process (verify)", st.get("decision"), ", ".join(st.get("sources") or []) or "-",
             sum(p["state"] == "applied" for p in st.get("patches", [])), "ok" if st.get("ok") else "NOT ok"]]
    for label, d in (report.get("children") or {}).items():
        ok = "error" not in d and d.get("ok") and not d.get("import_error")
        rows.append([label.replace("_", " "), d.get("decision"), ", ".join(d.get("sources") or []) or "-",
                     sum(p["state"] == "applied" for p in d.get("patches", [])),
                     "ok" if ok else f"FAILED: {d.get('error') or d.get('import_error') or d.get('reason')}"])
    if not report.get("children"):
        rows.append(["fresh interpreter / spawn / forkserver", "-", "-", "-", "not checked (--no-children)"])
    lines += _table(["process", "decision", "activated by", "patches applied", "result"], rows)
    wiring = activation_wiring()
    lines += ["", f"- `gptoss_patch.pth`: {', '.join(wiring['pth_files']) or 'not found on sys.path'}",
              f"- `vllm.general_plugins` entry point: {', '.join(wiring['plugin_entry_points']) or 'not registered'}"]
    vocab = report.get("harmony_vocabulary")
    if vocab:
        lines += [f"- harmony vocabulary: {'ok' if vocab['ok'] else 'NOT usable'} ({vocab['file']}, "
                  f"{vocab['variable'] or 'default cache'})"]
    lines += ["", "## Interpreter", ""]
    serving = report.get("serving_interpreter") or {}
    lines += [f"- executable: `{sys.executable}` (prefix `{sys.prefix}`)",
              f"- Python {sys.version.split()[0]} ({platform.python_implementation()}), {platform.platform()}, "
              f"{platform.machine()}",
              f"- `vllm` on PATH: {serving.get('script') or 'not found'}"
              + (f" (runs {serving['python']})" if serving.get("python") else "")]
    lines += ["", "## Environment (GPTOSS_PATCH_*, VLLM_* only; secrets not shown)", ""]
    envs = safe_environment(env)
    lines += _table(["variable", "value"], [[k, f"`{val}`"] for k, val in envs.items()]) if envs else ["none set"]
    for title, key in (("Problems", "problems"), ("Warnings", "warnings")):
        lines += ["", f"## {title}", ""]
        lines += [f"- {x}" for x in report.get(key, [])] or ["none"]
    return "\n".join(lines) + "\n"


def write(path: str, report: Mapping[str, Any], argv: list[str] | None = None) -> None:
    """Write :func:`render` of ``report`` to ``path`` (UTF-8). Raises ``OSError`` when it cannot be written."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render(report, argv))
