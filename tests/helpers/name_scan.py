"""Where ``ms_llm``'s source writes a registered name as a string constant: the check that generic
code asks a registry (token mixers, optimizers) instead of testing a name."""
import ast
import os
from typing import Iterable, List, Tuple

from .paths import ROOT

PKG = os.path.join(ROOT, "ms_llm")


def names_written(names: Iterable[str], owners: Tuple[str, ...]) -> List[str]:
    """``"<path>:<line> '<name>'"`` for every string constant in ``names`` in a module of
    ``ms_llm`` whose path (relative to the package, ``/``-separated) starts with none of
    ``owners`` (the registrations and the modules allowed to name them)."""
    names = set(names)
    found = []
    for root, _, files in os.walk(PKG):
        for f in files:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, PKG).replace(os.sep, "/")
            if not f.endswith(".py") or rel.startswith(owners):
                continue
            with open(path, encoding="utf-8") as src:
                tree = ast.parse(src.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{rel}:{node.lineno} {node.value!r}")
    return found
