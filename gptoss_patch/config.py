"""Every ``GPTOSS_PATCH_*`` environment variable: its name, what it accepts, and the one parser for each kind.

Standard library only (``os``), so the start-up hand-over (:mod:`gptoss_patch._bootstrap`) can use it. The README's
environment table is checked against :data:`VARIABLES` (``tests/unit/test_config.py``). Values are read when asked,
not cached: tests and child processes change the environment.

A malformed value raises ``ValueError`` naming the variable and what it accepts; each caller decides what that means
(``activate()`` turns a bad ``DISABLE``/``FORCE`` into a *refuse* decision with the guard armed, the start-up hook
reports it in one line, the simulator refuses to start).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

#: Boolean spellings (case-insensitive, surrounding blanks ignored); anything else is an error.
TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")

DISABLE = "GPTOSS_PATCH_DISABLE"
ALLOW_UNPATCHED = "GPTOSS_PATCH_ALLOW_UNPATCHED"
FORCE = "GPTOSS_PATCH_FORCE"
ATTENTION_PATH = "GPTOSS_PATCH_ATTENTION_PATH"
MOE_PAD = "GPTOSS_PATCH_MOE_PAD"
CACHE_DIR = "GPTOSS_PATCH_CACHE_DIR"


@dataclass(frozen=True)
class Variable:
    """One variable.

    Attributes:
        name: ``GPTOSS_PATCH_…``.
        kind: ``"bool"``, ``"choice"`` (one of ``choices``; empty = ``default``), ``"soc"`` (an integer of
            ``choices``), ``"path"`` (a directory), ``"bytes"`` (a size, :func:`size_bytes`) or ``"names"``
            (comma-separated ``choices``, :func:`names`).
        choices: accepted values (``choice``/``soc``).
        default: the value when unset or empty (``None``: none).
        readme: listed in the README's environment table (the user-facing ones); the others are developer settings.
    """

    name: str
    kind: str
    choices: tuple[str, ...] = ()
    default: str | None = None
    readme: bool = True


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable(DISABLE, "bool"),
    Variable(ALLOW_UNPATCHED, "bool"),
    Variable(FORCE, "bool"),
    Variable(ATTENTION_PATH, "choice", ("v2", "lse")),
    Variable(MOE_PAD, "choice", ("auto", "always", "never"), default="auto"),
    Variable(CACHE_DIR, "path", readme=False),      # gptoss_patch.tools.tokenizer: prepared tokenizer files
)}


def register(*variables: Variable) -> None:
    """Add another distribution's variables to :data:`VARIABLES`, so the parsers below serve them too
    (gptoss-patch-testkit declares its simulator and cache variables this way: ``gptoss_patch_testkit.config``).

    Raises:
        ValueError: a name that is already declared with a different definition.
    """
    for var in variables:
        known = VARIABLES.get(var.name)
        if known is not None and known != var:
            raise ValueError(f"{var.name} is already declared as {known}")
        VARIABLES[var.name] = var


def _raw(name: str, environ: Mapping[str, str] | None) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a gptoss-patch variable (gptoss_patch.config.VARIABLES)")
    return (os.environ if environ is None else environ).get(name, "")


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean variable: True for ``1/true/yes/on``, False when unset or ``0/false/no/off``.

    Raises:
        ValueError: any other value, naming the variable.
    """
    raw = _raw(name, environ)
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")


def choice(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A choice variable, lower-cased: one of its choices, or its default (None if it has none) when unset/empty.

    Raises:
        ValueError: another value, naming the variable and the choices.
    """
    var = VARIABLES[name]
    raw = _raw(name, environ)
    value = raw.strip().lower()
    if not value:
        return var.default
    if value not in var.choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(var.choices)}")
    return value




def path(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """A directory variable: its value, or ``default`` when unset/empty."""
    if VARIABLES[name].kind != "path":
        raise KeyError(f"{name} is not a path variable")
    return _raw(name, environ) or default


def size_bytes(name: str, environ: Mapping[str, str] | None = None) -> int:
    """A size variable in bytes: a positive integer, optionally with ``KiB``/``MiB``/``GiB``; its default when unset.

    Raises:
        ValueError: naming the variable, for anything else (``8GB``, ``0``, ``lots``).
    """
    import re

    var = VARIABLES[name]
    if var.kind != "bytes":
        raise KeyError(f"{name} is not a size variable")
    raw = _raw(name, environ).strip() or (var.default or "")
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB)?", raw)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"{name}={raw!r}: give a positive number of bytes, optionally with KiB, MiB or GiB "
                         "(e.g. 8GiB)")
    return int(m.group(1)) << {None: 0, "KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)]


def names(name: str, environ: Mapping[str, str] | None = None) -> frozenset:
    """A comma-separated list of ``choices`` (empty when unset).

    Raises:
        ValueError: naming the variable and the unknown entries.
    """
    var = VARIABLES[name]
    if var.kind != "names":
        raise KeyError(f"{name} is not a list variable")
    found = frozenset(x.strip() for x in _raw(name, environ).split(",") if x.strip())
    unknown = sorted(found - set(var.choices))
    if unknown:
        raise ValueError(f"{name}: unknown value(s) {unknown}; known: {list(var.choices)}")
    return found

