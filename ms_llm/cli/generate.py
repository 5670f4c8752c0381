"""``ms-llm generate``, and the model flags, sampling and loading ``ms-llm chat`` shares.

Sampling follows the common CLI convention: greedy unless a sampling flag is given
(``--temperature`` > 0, ``--top-k`` > 0 or ``--top-p`` < 1); ``--temperature 0`` is greedy.
The output is the generated text only (not the prompt), identical with and without ``--stream``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, TextIO


def add_common_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--load", required=True,
                   help="HF folder, Megatron folder or training checkpoint (save_dir / iter_*)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file or folder (default: the --load folder's); 'embedded' "
                        "for the default corpus tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, dest="max_new_tokens")
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=None, dest="top_k", help="sample among the k "
                   "most likely tokens")
    p.add_argument("--top-p", type=float, default=None, dest="top_p",
                   help="sample from the smallest set of tokens holding this probability")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--max-context", type=int, default=None, dest="max_context",
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default=None,
                   help="parameter dtype: float32 (default), bfloat16 or float16")


def sampling_args(args: argparse.Namespace) -> dict:
    """generate()'s sampling keywords from the flags (see the module docstring), after the
    flags' ranges are checked (``ms_llm.validation.check_generation_flags``)."""
    from ms_llm.validation import check_generation_flags
    check_generation_flags(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.max_context, args.seed)
    if args.dtype is not None:   # before any model is loaded
        from ms_llm.compat.dtypes import param_dtype
        try:
            param_dtype(args.dtype)
        except ValueError as e:
            raise ValueError(f"--dtype {args.dtype}: {e}") from None
    sample = ((args.temperature is not None and args.temperature > 0)
              or (args.top_k or 0) > 0 or (args.top_p is not None and args.top_p < 1.0))
    if args.temperature == 0:
        sample = False
    if not sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature or 1.0,
            "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}


def load_from_args(args: argparse.Namespace):
    from ms_llm.inference.loading import eos_token_ids, load_model, load_tokenizer_for
    tokenizer = load_tokenizer_for(args.load, args.tokenizer)
    model = load_model(args.load, args.dtype)
    context = args.max_context or model.config.max_position_embeddings
    return model, tokenizer, eos_token_ids(args.load, tokenizer), context


def main(argv: List[str], out: Optional[TextIO] = None) -> int:
    """``ms-llm generate --load PATH --prompt TEXT``: continue one prompt."""
    p = argparse.ArgumentParser(prog="ms-llm generate", description=main.__doc__)
    add_common_args(p, max_new_tokens=128)
    p.add_argument("--prompt", required=True)
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    args = p.parse_args(argv)
    out = out or sys.stdout
    from ms_llm.inference.generate import generate
    from ms_llm.inference.loading import encode_prompt
    from ms_llm.inference.streamer import TextStreamer
    from ms_llm.validation import check_utf8
    try:
        sampling = sampling_args(args)
        check_utf8("--prompt", args.prompt)
        model, tokenizer, eos, context = load_from_args(args)
        ids = encode_prompt(tokenizer, args.prompt)
        if len(ids) > context:
            raise ValueError(f"the prompt is {len(ids)} tokens, longer than the model's "
                             f"context of {context} tokens")
        budget = min(args.max_new_tokens, context - len(ids))
        if budget < args.max_new_tokens:   # said, not silently shortened
            if budget < 1:
                raise ValueError(f"the prompt is {len(ids)} tokens and fills the model's "
                                 f"context of {context} tokens: no room to generate")
            print(f"ms-llm generate: --max-new-tokens {args.max_new_tokens} capped at {budget} "
                  f"(prompt {len(ids)} tokens, context {context})", file=sys.stderr)
        streamer = TextStreamer(tokenizer, skip_token_ids=eos, out=out) if args.stream else None
        result = generate(model, [ids], budget, eos_token_id=eos, seed=args.seed,
                          streamer=streamer, vocab_size=tokenizer.vocab_size, **sampling)
    except (ValueError, FileNotFoundError) as e:
        print(f"ms-llm generate: {e}", file=sys.stderr)
        return 2
    if streamer is None:
        new = [int(t) for t in result[0, len(ids):] if int(t) not in eos]
        out.write(tokenizer.decode(new) + "\n")
        out.flush()
    return 0
