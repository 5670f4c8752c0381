"""``ModelScorer``: the two primitives every benchmark reduces to, over a ``GPTModel``.

* ``loglikelihood``: for (context ids, continuation ids) pairs, the summed log-probability of the
  continuation given the context and whether it is the greedy continuation. Rows of a batch are
  right-padded, as lm-evaluation-harness's HF backend does: under the causal mask a padding token
  at the end changes nothing before it, so no attention mask or position shift is needed and a
  padded row computes exactly what it computes alone. Only the logits from the first
  continuation position of the batch onwards are computed (``logits_to_keep``): a 150k
  vocabulary times a 4k context would not fit otherwise.
* ``generate``: greedy (or sampled) continuation of left-padded prompts with the KV cache
  (``ms_llm.inference.generate``), cut at the first stop string. Decoding runs in chunks that
  continue the same cache, so a batch stops as soon as every row has met a stop string or EOS
  instead of always running ``max_new_tokens``.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.compat import no_grad
from ms_llm.data.tokenizer import Tokenizer
from .prompts import cut_at_stop

Pair = Tuple[Sequence[int], Sequence[int]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the reference lm-eval takes is fp32 torch; float64
    here keeps our side's rounding far below the 1e-4 comparison)."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class ModelScorer:
    """A model and its tokenizer, ready to score. ``max_length`` is the longest sequence fed to
    the model (longer inputs lose tokens on the left, as lm-eval does); ``vocab_size`` limits the
    softmax to the first that many logits (a Megatron folder's padded vocabulary). ``tokenizer``
    may be None for id-only use (``loglikelihood`` / ``generate`` on ids, benchmarks)."""

    def __init__(self, model, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 max_length: int, vocab_size: Optional[int] = None, add_special_tokens=True):
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.max_length = int(max_length)
        self.vocab_size = vocab_size
        self.add_special_tokens = add_special_tokens
        self.hf_tokenizer = None
        if tokenizer is not None and tokenizer.path.endswith(".json"):
            from tokenizers import Tokenizer as HFTokenizer
            self.hf_tokenizer = HFTokenizer.from_file(tokenizer.path)

    @classmethod
    def from_path(cls, path: str, tokenizer: Optional[str] = None, dtype: Optional[str] = None,
                  max_length: Optional[int] = None, model=None) -> "ModelScorer":
        """An HF folder, a Megatron folder or a training checkpoint (``--tokenizer`` then names
        the tokenizer); ``model`` replaces the loaded one (a tensor-parallel copy)."""
        from ms_llm.inference.loading import eos_token_ids, load_model, load_tokenizer_for
        tok = load_tokenizer_for(path, tokenizer)
        model = model if model is not None else load_model(path, dtype)
        return cls(model, tok, eos_token_ids(path, tok),
                   max_length or model.config.max_position_embeddings,
                   vocab_size=real_vocab_size(path, tok, model.config.padded_vocab_size))

    # -- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: Optional[bool] = None) -> List[int]:
        """Ids of ``text`` as HF's ``tokenizer.encode`` gives them: with the special tokens the
        ``tokenizer.json`` post-processor adds unless told otherwise; sentencepiece as is."""
        special = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        if self.hf_tokenizer is not None:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=bool(special)).ids)
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    # -- log-likelihood -----------------------------------------------------------------------
    def loglikelihood(self, pairs: Sequence[Pair], batch_size: int = 1
                      ) -> List[Tuple[float, bool]]:
        """``(sum of log p(continuation | context), continuation is greedy)`` per pair, in the
        input order. Batches group pairs of similar length (longest first) to limit padding."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for i, (ctx, cont) in enumerate(pairs):
            if not len(cont):
                raise ValueError(f"request {i}: empty continuation")
            if not len(ctx):
                raise ValueError(f"request {i}: empty context (give a BOS / EOS token)")
            if len(cont) > self.max_length:
                raise ValueError(f"request {i}: continuation of {len(cont)} tokens is longer "
                                 f"than max_length {self.max_length}")
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        out: List[Optional[Tuple[float, bool]]] = [None] * len(pairs)
        was_training = self.model.training
        self.model.set_train(False)
        try:
            with no_grad():
                for start in range(0, len(order), batch_size):
                    idx = order[start:start + batch_size]
                    for i, res in zip(idx, self._batch([pairs[i] for i in idx])):
                        out[i] = res
        finally:
            self.model.set_train(was_training)
        return out  # type: ignore[return-value]

    def _batch(self, pairs: Sequence[Pair]) -> List[Tuple[float, bool]]:
        rows, conts = [], []
        for ctx, cont in pairs:
            whole = [int(t) for t in ctx] + [int(t) for t in cont]
            rows.append(whole[-(self.max_length + 1):][:-1])   # the last token is only a target
            conts.append([int(t) for t in cont])
        s = max(len(r) for r in rows)
        ids = np.zeros((len(rows), s), dtype=np.int32)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = r
        first = min(len(r) - len(c) for r, c in zip(rows, conts))   # earliest predicting slot
        keep = s - first
        logits = self.model(Tensor(ids), logits_to_keep=keep).asnumpy()   # [b, keep, V]
        if self.vocab_size:
            logits = logits[..., :self.vocab_size]
        results = []
        for b, (r, c) in enumerate(zip(rows, conts)):
            lo = len(r) - len(c) - first
            lp = log_softmax(logits[b, lo:lo + len(c)])
            target = np.asarray(c)
            total = float(lp[np.arange(len(c)), target].sum())
            results.append((total, bool((lp.argmax(axis=-1) == target).all())))
        return results

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop: Sequence[str] = (), chunk: int = 32, **sampling) -> List[str]:
        """Text continuing each prompt (ids; longer than ``max_length - max_new_tokens`` loses
        tokens on the left), ending before EOS and before the first stop string."""
        from ms_llm.inference.generate import generate, left_pad
        from ms_llm.models.kv_cache import KVCache
        keep = max(1, self.max_length - max_new_tokens)
        rows = [[int(t) for t in p][-keep:] for p in prompts]
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        ids, mask = left_pad(rows, None, pad)
        b = ids.shape[0]
        cache = KVCache.for_model(self.model, b, ids.shape[1] + max_new_tokens)
        new = [[] for _ in range(b)]
        done = np.zeros(b, dtype=bool)
        texts = [""] * b
        produced, step, seed = 0, 0, sampling.pop("seed", None)
        while produced < max_new_tokens and not done.all():
            n = min(chunk, max_new_tokens - produced)
            out = generate(self.model, ids, n, attention_mask=mask, kv_cache=cache,
                           eos_token_id=self.eos_token_ids, pad_token_id=pad,
                           seed=None if seed is None else seed + step, **sampling)
            fresh = out[:, ids.shape[1]:]
            for r in range(b):
                if done[r]:
                    continue
                for t in fresh[r]:
                    if int(t) in self.eos_token_ids:
                        done[r] = True
                        break
                    new[r].append(int(t))
                texts[r] = self.decode(new[r])
                if any(s and s in texts[r] for s in stop):
                    done[r] = True
            ids = out
            mask = np.concatenate([mask, np.ones(fresh.shape, bool)], axis=1)
            produced += fresh.shape[1]
            step += 1
            if fresh.shape[1] < n:      # every row met EOS inside generate
                break
        return [cut_at_stop(t, stop) for t in texts]


def real_vocab_size(path: str, tokenizer: Tokenizer, padded: int) -> Optional[int]:
    """The vocabulary without Megatron's padding rows (``--make-vocab-size-divisible-by``), so
    they stay out of the softmax: ``config.json``'s ``vocab_size`` (an HF folder's equals its
    rows; ms-llm writes the HF one beside a Megatron folder), else the tokenizer's size (a
    training checkpoint). None when nothing is padded."""
    import json
    vocab = None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        vocab = None
    vocab = int(vocab) if isinstance(vocab, int) else tokenizer.vocab_size
    return vocab if vocab < padded else None
