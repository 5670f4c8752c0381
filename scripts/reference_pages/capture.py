"""Run a command-line ``main`` in this process and keep what it prints, the way a user sees it
in a terminal 100 columns wide (argparse wraps to ``$COLUMNS``: fixed, so pages are the same on
every machine and Python version)."""
import contextlib
import io
import os
from typing import Callable, List

WIDTH = "100"


def printed(main: Callable[[List[str]], int], argv: List[str]) -> str:
    """What ``main(argv)`` prints on stdout; it must succeed (exit status 0)."""
    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(out):
            try:
                status = main(argv)
            except SystemExit as e:   # argparse's --help exits
                status = e.code
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    if status not in (0, None):
        raise RuntimeError(f"{argv}: exit status {status}")
    lines = (line.rstrip() for line in out.getvalue().strip("\n").splitlines())
    # Python < 3.10 argparse titles the options section "optional arguments:"
    return "\n".join("options:" if line == "optional arguments:" else line for line in lines)
