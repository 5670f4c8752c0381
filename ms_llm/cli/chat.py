"""``ms-llm chat``: a conversation on stdin / stdout (the session itself is
``inference.chat``); model flags and sampling as for ``ms-llm generate``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, TextIO

from ms_llm.cli.generate import add_common_args, load_from_args, sampling_args


def main(argv: List[str], stdin: Optional[TextIO] = None, out: Optional[TextIO] = None) -> int:
    """``ms-llm chat --load PATH``: a conversation on stdin / stdout with the tokenizer's chat
    template; each line is a user turn; EOF or ``exit`` ends it."""
    p = argparse.ArgumentParser(prog="ms-llm chat", description=main.__doc__)
    add_common_args(p, max_new_tokens=512)
    p.add_argument("--system", default=None, help="system prompt")
    args = p.parse_args(argv)
    stdin, out = stdin or sys.stdin, out or sys.stdout
    from ms_llm.data.chat_template import TemplateError
    from ms_llm.inference.chat import ChatSession, ContextTooLong
    from ms_llm.inference.streamer import TextStreamer
    from ms_llm.validation import check_utf8
    try:
        sampling = sampling_args(args)
        if args.system is not None:
            check_utf8("--system", args.system)
        model, tokenizer, eos, context = load_from_args(args)
        if not tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer.path} has no chat_template "
                             f"(tokenizer_config.json)")
        session = ChatSession(model, tokenizer, eos, context, system=args.system,
                              max_new_tokens=args.max_new_tokens,
                              sampling=dict(sampling, vocab_size=tokenizer.vocab_size),
                              seed=args.seed,
                              say=lambda m: print(f"ms-llm chat: {m}", file=sys.stderr))
    except (ValueError, FileNotFoundError) as e:
        print(f"ms-llm chat: {e}", file=sys.stderr)
        return 2
    interactive = stdin.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        try:
            line = check_utf8("stdin", stdin.readline())
        except UnicodeDecodeError as e:   # a strict UTF-8 stdin
            print(f"ms-llm chat: stdin is not valid UTF-8 (byte 0x{e.object[e.start]:02x})",
                  file=sys.stderr)
            return 2
        except ValueError as e:   # a surrogate-escaped stdin (check_utf8)
            print(f"ms-llm chat: {e}", file=sys.stderr)
            return 2
        if not line or line.strip() == "exit":
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        try:
            session.send(text, streamer=TextStreamer(tokenizer, skip_token_ids=eos, out=out))
        except ContextTooLong as e:
            print(f"ms-llm chat: {e}; start a new chat", file=sys.stderr)
            return 2
        except (TemplateError, ValueError) as e:   # a template over its bounds, raising, ...
            print(f"ms-llm chat: {e}", file=sys.stderr)
            return 2
