"""Write the generated reference pages of docs/reference/ (config keys, CLI commands, MindSpeed
flags, environment variables) from the code they document:

    python scripts/gen_reference.py           # (re)write the pages
    python scripts/gen_reference.py --check   # exit 1 naming each stale page, write nothing
    python scripts/gen_reference.py --out DIR # write (or --check) DIR instead

The renderers are in ``scripts/reference_pages``; tests/docs/test_reference_docs.py runs the check."""
import argparse
import os
import sys

from reference_pages import PAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "reference")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="compare instead of writing; exit 1 if a page is stale or missing")
    p.add_argument("--out", default=OUT, help="the pages' folder (default docs/reference)")
    args = p.parse_args(argv)
    stale = []
    for name, render in PAGES.items():
        path = os.path.join(args.out, name)
        text = render()
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        stale.append(os.path.relpath(path, ROOT))
        if not args.check:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (run: python scripts/gen_reference.py)",
              file=sys.stderr)
        return 1
    for page in stale:
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
