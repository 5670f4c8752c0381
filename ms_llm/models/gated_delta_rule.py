"""The gated delta rule (Gated DeltaNet's token mixer), as plain differentiable MindSpore ops.

Per value head, with an L2-normalised key ``k_t``, query ``q_t`` (scaled by ``1/sqrt(dk)``),
value ``v_t``, log-decay ``g_t <= 0`` and write strength ``beta_t`` in (0, 1), the state
``S`` ``[dk, dv]`` evolves as::

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

Two forms of the same recurrence:

* ``chunk_gated_delta_rule`` (training, prefill): chunks of ``C`` tokens; inside a chunk the
  ``C`` delta updates are condensed by the UT transform ``(I + A)^-1`` of the strictly lower
  triangular ``A = tril(diag(beta) K K^T * decay, -1)``; chunks are scanned sequentially. The
  inverse is the product ``(I + N)(I + N^2)(I + N^4)...`` with ``N = -A`` (nilpotent, so the
  Neumann series ends after ``C`` terms): ``log2 C`` matmuls instead of a triangular solve,
  which MindSpore has no CPU kernel for, and a backward for free.
* ``recurrent_gated_delta_rule`` (decoding): the step above, token by token.

Both take ``[b, s, h, d]`` tensors (q/k heads already repeated to the value heads) and an
optional initial state ``[b, h, dk, dv]``, and return ``(out [b, s, h, dv], final state)``.
They compute in float32, or float64 when given float64 (the tests' reference comparison).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from mindspore import Tensor, mint, ops
from mindspore.common import dtype as mstype

from ms_llm.compat import F, float32

__all__ = ["l2norm", "chunk_gated_delta_rule", "chunk_gated_delta_rule_segment",
           "recurrent_gated_delta_rule"]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' convention)."""
    return x * F.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta):
    dtype = q.dtype
    work = q.dtype if q.dtype == mstype.float64 else float32   # noqa: E721
    q, k, v = (t.astype(work).swapaxes(1, 2) for t in (q, k, v))      # [b, h, s, d]
    g, beta = (t.astype(work).swapaxes(1, 2) for t in (g, beta))      # [b, h, s]
    # a Tensor, not a Python float: MindSpore would round the scalar to float32
    q = l2norm(q) * Tensor(q.shape[-1] ** -0.5, work)
    k = l2norm(k)
    return dtype, work, q, k, v, g, beta


def _unit_lower_inverse(a: Tensor, chunk: int) -> Tensor:
    """``(I + a)^-1`` for strictly lower triangular ``a`` ``[..., C, C]``."""
    shape = a.shape
    n = -a.reshape(-1, chunk, chunk)
    inv = Tensor(np.eye(chunk), a.dtype) + n
    power, covered = n, 2
    while covered < chunk:
        power = F.matmul(power, power)
        inv = ops.baddbmm(inv, inv, power)           # inv + inv @ power, one op
        covered *= 2
    return inv.reshape(shape)


def _chunk_terms(q, k, v, g, beta, c: int, work):
    """The parallel part of the chunked form over ``[b, h, s, d]`` inputs: per chunk the new
    values ``u``, the decayed keys ``w`` that read the state, the intra-chunk scores, the
    decayed queries and keys and the chunk's total decay. Padding (zero k, v, q, beta, g at the
    end) leaves the state untouched."""
    b, h, s, _ = k.shape
    pad = (c - s % c) % c
    if pad:
        q, k, v = (F.cat([t, mint.zeros((b, h, pad, t.shape[-1]), dtype=work)], 2)
                   for t in (q, k, v))
        g, beta = (F.cat([t, mint.zeros((b, h, pad), dtype=work)], 2) for t in (g, beta))
    n = (s + pad) // c
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(b, h, n, c, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = F.cumsum(g.reshape(b, h, n, c), -1)                      # [b, h, n, C]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)                       # [.., i, j] = cum_i - cum_j
    lower = Tensor(np.tril(np.ones((c, c), dtype=bool)))
    strict = Tensor(np.tril(np.ones((c, c), dtype=bool), -1))
    # where before exp: the masked (j > i) differences are positive and may overflow
    decay = F.exp(F.where(lower, diff, F.zeros_like(diff))) * lower.astype(work)
    kk = F.matmul(k_beta, k.swapaxes(-1, -2)) * decay * strict.astype(work)
    inv = _unit_lower_inverse(kk, c)
    u = F.matmul(inv, v_beta)                                       # new values
    exp_cum = F.exp(cum).unsqueeze(-1)
    w = F.matmul(inv, k_beta * exp_cum)                          # decayed keys reading S
    intra = F.matmul(q, k.swapaxes(-1, -2)) * decay
    q_dec = q * exp_cum
    k_dec = k * F.exp(cum[..., -1:] - cum).unsqueeze(-1)
    chunk_decay = F.exp(cum[..., -1]).unsqueeze(-1).unsqueeze(-1)   # [b, h, n, 1, 1]
    return u, w, intra, q_dec, k_dec, chunk_decay


def _scan(terms, state: Tensor) -> Tuple[Tensor, Tensor]:
    """The sequential part: chunk by chunk, ``v_new = u - w S`` and ``S <- decay S + k_dec^T
    v_new``; the outputs ``q_dec S + intra v_new`` need no state update, so they are one
    batched matmul pair over all chunks afterwards (fewer ops in the serial loop, which
    dominates in PyNative). Returns ``[b, h, n*C, dv]`` and the final state."""
    u, w, intra, q_dec, k_dec, chunk_decay = terms
    b, h, n, c, dv = u.shape
    # one unstack per tensor, not a slice per chunk: a slice's backward writes a zero tensor of
    # the full size (n of them per tensor), unstack's is one stack
    per_chunk = [ops.unstack(t, 2) for t in (u, w, k_dec.swapaxes(-1, -2), chunk_decay)]
    states, news = [], []
    for u_i, w_i, kt_i, decay_i in zip(*per_chunk):
        states.append(state)
        v_new = u_i - F.matmul(w_i, state)
        news.append(v_new)
        state = state * decay_i + F.matmul(kt_i, v_new)
    out = F.matmul(q_dec, F.stack(states, 2)) + F.matmul(intra, F.stack(news, 2))
    return out.reshape(b, h, n * c, dv), state


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           chunk_size: int = 64, initial_state: Optional[Tensor] = None
                           ) -> Tuple[Tensor, Tensor]:
    """The chunked parallel form (see the module docstring)."""
    dtype, work, q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    terms = _chunk_terms(q, k, v, g, beta, chunk_size, work)
    state = initial_state.astype(work) if initial_state is not None else \
        mint.zeros((b, h, dk, dv), dtype=work)
    out, state = _scan(terms, state)
    return out[:, :, :s].swapaxes(1, 2).astype(dtype), state


def chunk_gated_delta_rule_segment(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                   chunk_size: int = 64
                                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One segment of a longer sequence whose initial state ``S0`` is not known yet (context
    parallel: an earlier rank holds the tokens before it). Output and final state are affine in
    ``S0``, so one scan of the augmented state ``[S | M]`` (``M`` starting at the identity, the
    values padded with zeros for it) gives everything::

        out = out0 + P @ S0          (per head: out0 [s, dv], P [s, dk])
        S_end = M @ S0 + B           (M [dk, dk], B [dk, dv])

    Returns ``(out0, P, B, M)``, ``out0`` / ``P`` as ``[b, h, s, *]``, in the working dtype."""
    _, work, q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    u, *rest = _chunk_terms(q, k, v, g, beta, chunk_size, work)
    u = F.cat([u, mint.zeros(tuple(u.shape[:-1]) + (dk,), dtype=work)], -1)
    eye = Tensor(np.eye(dk), work).reshape(1, 1, dk, dk).broadcast_to((b, h, dk, dk))
    state = F.cat([mint.zeros((b, h, dk, dv), dtype=work), eye], -1)
    out, state = _scan((u, *rest), state)
    out = out[:, :, :s]
    return out[..., :dv], out[..., dv:], state[..., :dv], state[..., dv:]


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The token-by-token form (decoding; see the module docstring)."""
    dtype, work, q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = initial_state.astype(work) if initial_state is not None else \
        mint.zeros((b, h, dk, v.shape[-1]), dtype=work)
    outs = []
    for t in range(s):
        state = state * F.exp(g[:, :, t]).reshape(b, h, 1, 1)
        k_t = k[:, :, t].unsqueeze(-1)                                  # [b, h, dk, 1]
        read = (state * k_t).sum(-2)                                    # [b, h, dv]
        delta = (v[:, :, t] - read) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    out = F.stack(outs, 2)
    return out.swapaxes(1, 2).astype(dtype), state
