"""Shared argparse helpers of the command-line tools (verify and the operations kit): range checks, the program name, parse.

The range checks (:func:`at_least`, :func:`positive_float`, :func:`int_list`) return argparse ``type=`` callables, so a
value out of range is a usage error (exit 2) whose message names the one option that holds it (argparse: ``argument
--limit: must be >= 1, got 0``), not a combined message about several. :func:`prog` names the program as the user
typed it; :func:`parse` turns argparse's exit into the status ``main`` returns.
"""

from __future__ import annotations

import argparse
from typing import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """``type=`` for an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """``type=`` for a finite number ``> 0`` (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """``type=`` for comma-separated integers, each ``>= minimum`` (e.g. concurrency levels ``1,10,64``)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
        low = [v for v in values if v < minimum]
        if low:
            raise argparse.ArgumentTypeError(f"every level must be >= {minimum}, got {low[0]} in {text!r}")
        return values

    return parse


def prog(script: str, module: str) -> str:
    """argparse ``prog=`` for a tool reachable both as the console script ``script`` (``[project.scripts]`` of
    pyproject.toml) and as ``python -m module``: the name the user typed, so usage lines and errors repeat it."""
    import os
    import sys

    return script if os.path.basename(sys.argv[0] if sys.argv else "") == script else f"python -m {module}"


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """``ap.parse_args(argv)``, or the exit status argparse chose when it stopped: 0 after ``--help``, 2 after a usage
    error (its message already printed). The tools' ``main`` returns an int in that case instead of raising
    ``SystemExit``, so they can be called in-process and from their console scripts alike."""
    try:
        return ap.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
