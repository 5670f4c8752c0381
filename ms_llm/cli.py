"""``ms-llm`` console entry: ``train``, ``plot``, ``convert``, ``preprocess`` (``generate`` is
announced and refuses to run until it is built)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

_LATER = {"generate": "text generation"}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ms-llm", description=__doc__)
    parser.add_argument("command", choices=["train", "plot", "convert", "preprocess", *_LATER])
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from ms_llm.train import main as train_main
        return train_main(rest)
    if command == "plot":
        p = argparse.ArgumentParser(prog="ms-llm plot")
        p.add_argument("output_dir")
        p.add_argument("--out", default=None, help="PNG path (default <output_dir>/loss.png)")
        args = p.parse_args(rest)
        from ms_llm.training.plot import plot_loss
        try:
            print(plot_loss(args.output_dir, args.out))
        except (FileNotFoundError, ValueError) as e:
            print(f"ms-llm plot: {e}", file=sys.stderr)
            return 2
        return 0
    if command == "preprocess":
        from ms_llm.data.preprocess import main as preprocess_main
        return preprocess_main(rest)
    if command == "convert":
        from ms_llm.checkpoint.convert import main as convert_main
        return convert_main(rest)
    if command in _LATER:
        print(f"ms-llm {command}: not available yet ({_LATER[command]} is not implemented)",
              file=sys.stderr)
        return 2
    parser.parse_args(argv)  # prints the choices error
    return 2


if __name__ == "__main__":
    sys.exit(main())
