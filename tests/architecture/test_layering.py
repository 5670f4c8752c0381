"""Packages of ``ms_llm`` import one way: a declared order of layers, checked on every import.

The import-cycle test (test_import_cycles.py) sees module cycles; it cannot see two packages
that import each other through different modules (``parallel.parallelize`` -> ``training`` and
``training.trainer`` -> ``parallel``), which is how a capability leaks across packages. This test
reads every module's source (nothing is imported), collects EVERY ``import`` / ``from ... import``
-- relative ones, those inside functions (lazy imports) and under ``if TYPE_CHECKING:`` included:
a lazy import is still a dependency -- and fails on:

* an import of a package in a higher layer (or of another package in the same layer);
* a private name (``_x``: an imported name, or a module on the imported path) taken from another
  package: what a package keeps private may change without notice;
* a top-level package or module missing from ``LAYERS`` (a new one must say where it sits).

There is no exception list: a violation is fixed, not recorded.

The order, bottom to top (a package may import only from layers below its own):

* the package ``__init__`` (only ``__version__``), ``compat`` (the PyTorch-shaped shims over
  MindSpore) and ``launch`` (the msrun launcher: the standard library only, so a light
  supervisor process and any package can use it) and ``validation`` (one-line checks of external
  JSON/YAML inputs: the standard library and yaml only, so every reader can use it);
* ``ops`` (kernels), ``models`` (Megatron-Core-shaped modules and their config);
* ``quant`` and ``lora``: module conversions of a built model, independent of each other;
* ``parallel`` (it shards whatever modules the conversions produced, LoRA adapters included);
* ``optim`` (optimizers; the distributed optimizer is a wrapper that needs ``parallel``);
* ``checkpoint`` (formats, conversions, LoRA merge/export: files of models and optimizers);
* ``data`` (datasets, tokenizers; imports none of the above);
* ``inference`` (generation on a loaded model), then ``evaluation`` (benchmarks scored through
  it, data/tensor parallel under msrun);
* ``config`` (the run schema, its parsing, value and cross-key rules, ``--help`` text and
  pretrained-folder adoption: its cross-key rules may ask the packages below, e.g. pipeline
  stages or a checkpoint folder's architecture);
* ``planning`` (per-rank memory plan, model FLOPs, the CPU GEMM peak: what a run will need,
  read from its config before it starts);
* ``training`` (the loop, composing everything below);
* ``mindspeed`` (MindSpeed-LLM's script flags onto the run config, then a training run) and
  ``qualify`` (the support matrix: runs training jobs);
* the entry points: ``cli`` (one module per ``ms-llm`` command).
"""
from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Tuple
from helpers.paths import ROOT


PACKAGE = "ms_llm"

# Bottom to top; members of one tuple are one layer (and may not import each other).
LAYERS: List[Tuple[str, ...]] = [
    ("__init__", "compat", "launch", "validation"),
    ("ops",),
    ("models",),
    ("quant", "lora"),
    ("parallel",),
    ("optim",),
    ("checkpoint",),
    ("data",),
    ("inference",),
    ("evaluation",),
    ("config",),
    ("planning",),
    ("training",),
    ("mindspeed", "qualify"),
    ("cli",),
]


def layer_of(unit: str) -> int:
    for i, members in enumerate(LAYERS):
        if unit in members:
            return i
    raise KeyError(unit)


def _modules() -> Dict[str, str]:
    """Module name -> source path, for every .py file in ``ms_llm``'s package tree."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        parts = os.path.relpath(folder, ROOT).split(os.sep)
        for f in sorted(files):
            if f.endswith(".py"):
                out[".".join(parts if f == "__init__.py" else parts + [f[:-3]])] = \
                    os.path.join(folder, f)
    return out


def top(module: str) -> str:
    """The top-level package or module of ``ms_llm.a.b`` (``a``; the root package is
    ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str, path: str) -> Iterator[Tuple[int, str, List[str]]]:
    """``(line, imported module path, [names taken from it])`` for every ms_llm import in
    ``module``, at any depth of its code."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == PACKAGE:   # ``from ms_llm import training``: the name is the package
                for a in node.names:
                    yield node.lineno, f"{PACKAGE}.{a.name}", []
            elif source.startswith(PACKAGE + "."):
                yield node.lineno, source, [a.name for a in node.names]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations() -> Tuple[List[str], List[str], List[str]]:
    """(undeclared units, imports against the order, private names across packages)."""
    undeclared, upward, private = set(), [], []
    for module, path in _modules().items():
        src = top(module)
        try:
            src_layer = layer_of(top(module))
        except KeyError:
            undeclared.add(top(module))
            continue
        where = f"{os.path.relpath(path, ROOT)}"
        for line, target, names in imports(module, path):
            dst = top(target)
            if dst == src:
                continue
            try:
                dst_layer = layer_of(top(target))
            except KeyError:
                undeclared.add(top(target))
                continue
            what = f"{where}:{line}: {src} -> {target}" + (f" ({', '.join(names)})" if names
                                                            else "")
            if dst_layer >= src_layer:
                upward.append(what)
            hidden = [p for p in target.split(".")[1:] if _private(p)] + \
                [n for n in names if _private(n)]
            if hidden:
                private.append(f"{what}: private {', '.join(hidden)}")
    return sorted(undeclared), upward, private


def test_import_parser_sees_lazy_relative_and_type_checking_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from . import sib\nfrom ..x import _y\nif TYPE_CHECKING:\n"
                   "    from ms_llm.training import z\n"
                   "def f():\n    import ms_llm.parallel.state\n    from ms_llm import data\n")
    got = sorted(imports("ms_llm.checkpoint.m", str(src)))
    assert got == [(1, "ms_llm.checkpoint", ["sib"]), (2, "ms_llm.x", ["_y"]),
                   (4, "ms_llm.training", ["z"]), (6, "ms_llm.parallel.state", []),
                   (7, "ms_llm.data", [])]


def test_every_package_is_declared_once():
    names = [u for layer in LAYERS for u in layer]
    assert len(names) == len(set(names))
    on_disk = {top(m) for m in _modules()}
    assert not on_disk - set(names), f"declare where these sit in LAYERS: {on_disk - set(names)}"


def test_packages_import_only_downwards_and_no_private_names():
    undeclared, upward, private = violations()
    problems = [f"not in LAYERS: {', '.join(undeclared)}"] if undeclared else []
    if upward:
        problems += ["imports against the layer order (a package may import only from the "
                     "layers below it):"] + [f"  {v}" for v in upward]
    if private:
        problems += ["private names imported across packages:"] + [f"  {v}" for v in private]
    assert not problems, "\n".join(problems)
