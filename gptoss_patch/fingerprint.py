"""Reading an installed or released module's source without importing it, and fingerprinting its defs.

The layer below :mod:`gptoss_patch.registry` (structural checks) and :mod:`gptoss_patch.drift` (fingerprints vs the
releases): it imports nothing of gptoss-patch. A *target* is ``"package.module:Qualified.name"``
(:data:`gptoss_patch.matrix.LAYOUTS`). A fingerprint is the sha256 of ``ast.get_source_segment`` of the target's
``def``/``class`` (``docs/upstream.md`` §6).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys


def split_target(target: str) -> tuple[str, str]:
    """Split ``"module:Qual.name"`` into ``("module", "Qual.name")``; ValueError when malformed."""
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"patch target {target!r} is not of the form 'package.module:Qualified.name'")
    return module, qualname


def module_source_path(module: str) -> str | None:
    """Path of ``module``'s ``.py`` file, found without importing ``module`` or its parents.

    Only the top-level package's spec is asked for (which does not execute it); the rest of the
    dotted path is followed on disk. Returns None when not found.
    """
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top) if top not in sys.modules else sys.modules[top].__spec__
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not rest:
        return spec.origin
    parts = rest.split(".")
    for root in roots:
        base = os.path.join(root, *parts)
        for cand in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(cand):
                return cand
    return None


def _find_def(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        found = None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child  # last definition wins, as at run time
            elif isinstance(child, ast.If):  # defs inside module-level if/else
                for sub in ast.walk(child):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.name == part:
                        found = sub
        if found is None:
            return None
        node = found
    return node


def _ast_params(node: ast.AST) -> tuple[set[str], bool]:
    args = node.args  # type: ignore[attr-defined]
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    if args.vararg:
        names.add("*" + args.vararg.arg)
    return names, args.kwarg is not None


_SOURCE_CACHE: dict[str, tuple[str, ast.AST]] = {}


def _parsed(path: str) -> tuple[str, ast.AST]:
    hit = _SOURCE_CACHE.get(path)
    if hit is None:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        hit = (source, ast.parse(source, filename=path))
        _SOURCE_CACHE[path] = hit
    return hit


def fingerprint(target: str) -> str | None:
    """sha256 of the target's source segment (the method of ``upstream_fingerprints.json``), or None if absent."""
    module, qualname = split_target(target)
    path = module_source_path(module)
    if path is None:
        return None
    return fingerprint_in_file(path, qualname)


def fingerprint_in_file(path: str | os.PathLike, qualname: str) -> str | None:
    """sha256 of ``ast.get_source_segment`` of ``qualname``'s def/class in the Python file ``path`` (no import).

    Decorators are excluded (the segment starts at ``def``/``class``), later lines keep their indentation
    (``docs/upstream.md`` §6). None when ``qualname`` is not defined there.
    """
    source, tree = _parsed(str(path))
    node = _find_def(tree, qualname)
    if node is None:
        return None
    segment = ast.get_source_segment(source, node) or ""
    return hashlib.sha256(segment.encode("utf-8")).hexdigest()
