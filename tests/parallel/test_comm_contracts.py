"""Every ``mindspore.mint.distributed`` call ms-llm makes (all go through
``ms_llm.parallel.comm.backend.dist()``) bound to the installed MindSpore's signature: the call
sites are read from the source, so a new or changed call is checked without running a
collective. On Ascend these are the HCCL calls; on CPU the same calls run over MindSpore's CPU
backend in the msrun tests, which covers their values but not the Ascend-only ones."""
import ast
import inspect
import pathlib

import mindspore.mint.distributed as mdist
import pytest

import ms_llm.parallel.comm as comm

COMM_DIR = pathlib.Path(comm.__file__).parent


def dist_calls():
    """(file:line, op name, positional count, keyword names) of every ``dist().op(...)``."""
    found = []
    for path in sorted(COMM_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Call)
                    and getattr(node.func.value.func, "id", None) == "dist"):
                assert not any(isinstance(a, ast.Starred) for a in node.args), path
                found.append((f"{path.name}:{node.lineno}", node.func.attr, len(node.args),
                              [k.arg for k in node.keywords]))
    return found


CALLS = dist_calls()


def test_the_call_sites_are_found():
    ops = {op for _, op, _, _ in CALLS}
    assert {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_to_all_single", "broadcast", "send", "recv", "scatter"} <= ops, ops


@pytest.mark.parametrize("where,op,npos,keywords", CALLS, ids=[c[0] for c in CALLS])
def test_dist_call_binds_to_mint_distributed(where, op, npos, keywords):
    fn = getattr(mdist, op, None)
    assert fn is not None, f"{where}: mindspore.mint.distributed has no {op}"
    inspect.signature(fn).bind(*range(npos), **{k: None for k in keywords})
