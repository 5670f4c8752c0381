"""A fake Ascend device on the CPU build of MindSpore, for the Ascend branches ms-llm has never run.

``fake_ascend(monkeypatch)`` makes ms_llm believe the device is Ascend (``compat.device``'s state,
every dispatch-table entry ``native``) and replaces the Ascend-only kernels it calls --
``ops.flash_attention_score``, ``ops.rms_norm``, ``ops.swiglu``, ``ops.rotary_position_embedding``,
``mint.nn.functional.cross_entropy``, ``mint.bincount`` and the grouped matmul ``gmm`` -- by fakes that first assert the documented input contract of
MindSpore 2.10 (dtypes, layouts, the limits ms-llm relies on), record their arguments, and then
compute the result with ms-llm's composed forms (differentiable, so a training step runs through
them). The real kernels are checked separately against their signatures
(tests/ops/test_ascend_contracts.py); what runs here is ms-llm's side of each call.
"""
from __future__ import annotations

import importlib
import sys
from collections import defaultdict

import numpy as np
from mindspore import Tensor, mint, ops

from ms_llm.compat import bfloat16, bool_, float16, float32, int32, int64
from ms_llm.ops import _dispatch

# the modules (ms_llm.ops re-exports functions under some of these names)
attention, cross_entropy, moe, rms_norm, rope, swiglu = (
    importlib.import_module(f"ms_llm.ops.{m}")
    for m in ("attention", "cross_entropy", "moe", "rms_norm", "rope", "swiglu"))


class RecordingPaths(dict):
    """The dispatch table with every op ``native``, remembering which entries were read."""

    def __init__(self):
        super().__init__({op: "native" for op in _dispatch.OPS})
        self.read = set()

    def __getitem__(self, op):
        self.read.add(op)
        return super().__getitem__(op)


def _flash(calls):
    def fake(q, k, v, head_num, attn_mask=None, scalar_value=1.0, input_layout="BSH",
             sparse_mode=0, **rest):
        assert not rest, rest
        assert q.dtype in (float16, bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
        assert input_layout == "BNSD" and head_num == q.shape[1] and q.ndim == 4
        d = q.shape[-1]
        assert d % 16 == 0 and d <= 512, d
        assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
        assert attn_mask.dtype == bool_
        b, _, s, _ = q.shape
        sk = k.shape[2]
        if sparse_mode == 2:
            assert attn_mask.shape == (2048, 2048) and s == sk
            mask = None
        else:
            assert sparse_mode == 0
            assert attn_mask.shape in ((s, sk), (b, 1, s, sk)), attn_mask.shape
            mask = attn_mask.reshape(-1, 1, s, sk)
        calls["flash_attention_score"].append((tuple(q.shape), tuple(k.shape), sparse_mode))
        out = attention.causal_attention_composed(q.astype(float32), k.astype(float32),
                                                  v.astype(float32), scalar_value, mask)
        return out.astype(q.dtype)
    return fake


def _rms_norm(calls):
    def fake(x, gamma, epsilon=1e-6):
        assert gamma.dtype == x.dtype, (gamma.dtype, x.dtype)   # "same dtype as x"
        assert gamma.shape == (x.shape[-1],)
        calls["rms_norm"].append((tuple(x.shape), x.dtype))
        return rms_norm.rms_norm_composed(x, gamma, epsilon), None   # (y, rstd)
    return fake


def _swiglu(calls):
    def fake(x, dim=-1):
        assert dim == -1 and x.shape[-1] % 2 == 0
        calls["swiglu"].append(tuple(x.shape))
        return swiglu.swiglu_composed(x)
    return fake


def _rope(calls):
    def fake(x, cos, sin, mode=0):
        assert mode == 0 and x.ndim == 4 and cos.ndim == 4
        assert cos.dtype == x.dtype and sin.dtype == x.dtype
        b, n, s, d = x.shape
        assert cos.shape == (1, 1, s, d) and sin.shape == cos.shape   # 11SD for BNSD x
        assert not rope.native_rope_refusal(tuple(x.shape), x.dtype)
        calls["rotary_position_embedding"].append(tuple(x.shape))
        return rope.apply_rope_composed(x, cos.reshape(s, d), sin.reshape(s, d))
    return fake


def _cross_entropy(calls):
    def fake(logits, target, weight=None, ignore_index=-100, reduction="mean",
             label_smoothing=0.0):
        assert logits.ndim == 2 and logits.dtype == float32 and target.dtype == int32
        assert weight is None and reduction == "none" and label_smoothing == 0.0
        assert target.shape == (logits.shape[0],)
        calls["cross_entropy"].append(tuple(logits.shape))
        return cross_entropy.cross_entropy_composed(logits, target, ignore_index)
    return fake


def _bincount(calls):
    def fake(input, weights=None, minlength=0):
        assert input.ndim == 1 and input.dtype in (int32, int64) and weights is None
        calls["bincount"].append((tuple(input.shape), minlength))
        return ops.bincount(input, minlength=minlength)
    return fake


def _gmm(calls):
    def fake(x, weight, bias=None, group_list=None, group_type=0, group_list_type=0):
        assert bias is None and group_type == 0 and group_list_type == 0
        assert len(x) == 1 and len(weight) == 1
        x, w = x[0], weight[0]
        assert isinstance(group_list, Tensor) and group_list.dtype == int64
        ends = group_list.asnumpy()
        assert ends.ndim == 1 and len(ends) <= moe.GMM_MAX_GROUPS
        assert np.all(np.diff(ends) >= 0) and ends[-1] == x.shape[0]
        assert w.ndim == 3 and w.shape[0] == len(ends) and w.shape[1] == x.shape[1]
        assert x.dtype == w.dtype
        calls["gmm"].append((tuple(x.shape), tuple(w.shape)))
        starts = np.concatenate([[0], ends[:-1]])
        x32, w32 = x.astype(float32), w.astype(float32)   # the CPU build has no bf16 MatMul
        outs = [mint.matmul(x32[int(a):int(e)], w32[i])
                for i, (a, e) in enumerate(zip(starts, ends)) if e > a]
        return [mint.cat(outs, 0).astype(x.dtype)]
    return fake


def _recording(name, fake, calls):
    """``fake`` that also keeps each call's exact arguments in ``calls.raw[name]`` (the
    contract tests bind them to the real kernel's signature)."""
    def call(*args, **kwargs):
        calls.raw[name].append((args, kwargs))
        return fake(*args, **kwargs)
    return call


class Calls(defaultdict):
    """The fakes' records: ``calls[kernel]`` what each fake noted, ``calls.raw[kernel]`` the
    ``(args, kwargs)`` ms-llm passed."""

    def __init__(self):
        super().__init__(list)
        self.raw = defaultdict(list)


def fake_ascend(monkeypatch):
    """Switch this test to the fake Ascend device; returns ``(calls, paths)``: the fakes'
    recorded calls by kernel name, and the dispatch table (``paths.read``: entries reached)."""
    calls = Calls()
    paths = RecordingPaths()
    # the module: ms_llm.compat re-exports its device() under the same name
    monkeypatch.setitem(sys.modules["ms_llm.compat.device"]._STATE, "device", "Ascend")
    monkeypatch.setattr(_dispatch, "_PATHS", paths)
    # ms_llm.compat.functional keeps its CPU forms: on Ascend they are plain mint calls, whose
    # kernels the CPU build lacks (bf16 compute, Embedding, ...); the model code above it and
    # every ms_llm.ops dispatch see Ascend.
    monkeypatch.setattr(importlib.import_module("ms_llm.compat.functional"), "is_cpu",
                        lambda: True)
    for owner, name, make in ((ops, "flash_attention_score", _flash), (ops, "rms_norm", _rms_norm),
                              (ops, "swiglu", _swiglu),
                              (ops, "rotary_position_embedding", _rope),
                              (mint.nn.functional, "cross_entropy", _cross_entropy),
                              (mint, "bincount", _bincount)):
        monkeypatch.setattr(owner, name, _recording(name, make(calls), calls))
    gmm = _recording("gmm", _gmm(calls), calls)
    monkeypatch.setattr(moe, "grouped_matmul_kernel", lambda: gmm)
    return calls, paths


def no_device_chosen(monkeypatch) -> list:
    """``setup_device`` as in a new process where no device is chosen yet (MindSpore's runtime
    not started); ``mindspore.set_device`` and ``launch_blocking`` are recorded in the returned
    list instead of run."""
    import mindspore as ms
    device = sys.modules["ms_llm.compat.device"]
    chosen = []
    monkeypatch.setitem(device._STATE, "device", None)
    monkeypatch.setattr(device, "_running_device", lambda: None)
    monkeypatch.setattr(ms, "set_device", chosen.append)
    monkeypatch.setattr(ms, "set_context", lambda **_: None)
    monkeypatch.setattr(ms.runtime, "launch_blocking", lambda: chosen.append("sync"))
    return chosen
