"""The ``ms-llm`` model of EleutherAI's lm-evaluation-harness (``pip install ms-llm[eval]``).

``MsLLM`` implements the harness's three request types over ``ModelScorer``:

* ``loglikelihood``: the harness's own context / continuation split (``TemplateLM``: trailing
  spaces of the context move to the continuation, both encoded together), then right-padded
  batches, as its ``hf`` model does, so the numbers agree with ``--model hf`` to rounding;
* ``loglikelihood_rolling``: the harness's disjoint rolling windows of ``max_length`` tokens,
  scored as log-likelihood requests;
* ``generate_until``: left-padded batches decoded with the KV cache, stopped at EOS and at the
  request's ``until`` strings (and cut before them), at most ``max_gen_toks`` new tokens.

lm-eval 0.4.13 finds only its own models, so ``ms-llm lm-eval ARGS...`` registers this class and
runs the harness's command line with ARGS unchanged; in Python, ``register()`` then
``lm_eval.simple_evaluate(model="ms-llm", model_args="pretrained=DIR")`` or pass an instance:
``simple_evaluate(model=MsLLM(pretrained=DIR), ...)``. One process only (no msrun).
"""
from __future__ import annotations

from typing import List, Optional, Union

try:
    from lm_eval.api.model import TemplateLM
except ImportError as e:                   # the optional extra is missing
    raise ImportError("ms-llm lm-eval needs lm-evaluation-harness: pip install "
                      "'ms-llm[eval]' (lm-eval with datasets<4, pyarrow<22)") from e

NAME = "ms-llm"


class MsLLM(TemplateLM):
    """``pretrained``: HF folder, Megatron folder or training checkpoint (or a ready
    ``ModelScorer``). ``tokenizer``: a tokenizer file / folder (default the folder's).
    ``batch_size``: requests per forward. ``max_length``: context (default the model's
    ``max_position_embeddings``). ``add_bos_token``: force the tokenizer's special tokens on or
    off (default: as the ``tokenizer.json`` post-processor says, like HF)."""

    def __init__(self, pretrained, tokenizer: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: Union[int, str] = 1, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, add_bos_token: Optional[bool] = None,
                 vocab_size: Optional[int] = None, max_batch_size: Optional[int] = None,
                 device: Optional[str] = None, **kwargs) -> None:
        super().__init__()
        unknown = sorted(k for k in kwargs if k not in ("trust_remote_code", "parallelize"))
        if unknown:
            raise ValueError(f"--model_args: unknown key(s) {', '.join(unknown)} for ms-llm")
        if str(batch_size).startswith("auto"):
            raise ValueError("--batch_size auto: not built for ms-llm; give a number")
        self._batch_size = int(batch_size)
        if self._batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
        from ms_llm.compat import setup_device
        setup_device()
        from .scorer import ModelScorer
        if isinstance(pretrained, ModelScorer):
            self.scorer = pretrained
        else:
            self.scorer = ModelScorer.from_path(str(pretrained), tokenizer, dtype,
                                                int(max_length) if max_length else None)
        if max_length:
            self.scorer.max_length = int(max_length)
        if vocab_size:
            self.scorer.vocab_size = int(vocab_size)
        self.add_bos_token = None if add_bos_token is None else _flag(add_bos_token)
        self._max_gen_toks = int(max_gen_toks)
        tok = self.scorer.tokenizer
        self._bos = None
        if tok.bos_token and self.scorer.hf_tokenizer is not None:
            self._bos = self.scorer.hf_tokenizer.token_to_id(tok.bos_token)

    # -- what the harness asks of a model ----------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.scorer.tokenizer.eod)

    @property
    def prefix_token_id(self) -> int:
        """HF's choice: BOS if the tokenizer has one, else EOS."""
        return int(self._bos) if self._bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> List[int]:
        special = add_special_tokens
        if special is None:
            special = self.add_bos_token
            prefix = self.tok_decode([self.prefix_token_id])
            if prefix and string.startswith(prefix):     # already carries its BOS
                special = False
        ids = self.scorer.encode(string, add_special_tokens=special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.scorer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        results = self.scorer.loglikelihood(pairs, self._batch_size)
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        from lm_eval import utils
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(w)
                owner.append(k)
        scores = self.scorer.loglikelihood(windows, self._batch_size)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, scores):
            totals[k] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out: List[Optional[str]] = [None] * len(requests)
        groups: dict = {}
        for k, req in enumerate(requests):
            context, gen_kwargs = req.args
            groups.setdefault(_kwargs_key(gen_kwargs), []).append(k)
        for key, members in groups.items():
            kw = dict(key)
            until = kw.pop("until", ())
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            new = int(kw.pop("max_gen_toks", self._max_gen_toks))
            sampling = _sampling(kw)
            order = sorted(members, key=lambda k: -len(requests[k].args[0]))
            for start in range(0, len(order), self._batch_size):
                idx = order[start:start + self._batch_size]
                ctx = [self.tok_encode(requests[k].args[0],
                                       left_truncate_len=max(1, self.max_length - new))
                       for k in idx]
                texts = self.scorer.generate(ctx, new, stop=until, **sampling)
                for k, text in zip(idx, texts):
                    out[k] = text
                    self.cache_hook.add_partial("generate_until", requests[k].args, text)
        return out  # type: ignore[return-value]


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _kwargs_key(gen_kwargs: dict) -> tuple:
    items = []
    for k, v in sorted((gen_kwargs or {}).items()):
        items.append((k, tuple(v) if isinstance(v, list) else v))
    return tuple(items)


def _sampling(kw: dict) -> dict:
    """generate()'s sampling keywords from the harness's ``gen_kwargs`` (greedy unless
    ``do_sample``; ``temperature`` 0 means greedy, as in the hf model)."""
    do_sample = _flag(kw.pop("do_sample", False))
    temperature = float(kw.pop("temperature", 1.0 if do_sample else 0.0))
    top_k, top_p = int(kw.pop("top_k", 0) or 0), float(kw.pop("top_p", 1.0) or 1.0)
    seed = kw.pop("seed", None)
    if not do_sample or temperature == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "seed": seed}


def register() -> None:
    """Make ``--model ms-llm`` known to the harness (idempotent)."""
    from lm_eval.api import registry
    if NAME not in getattr(registry, "MODEL_REGISTRY", {}):
        registry.register_model(NAME)(MsLLM)
