"""Shared pytest setup for ms-llm tests."""
import os
import sys

# tests/ helpers (hf_reference, hf_fixtures) import as plain modules.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from ms_llm.compat import setup_device  # noqa: E402

# PyNative errors are sticky without synchronous execution: a failing op would otherwise
# re-raise its stale error from the next unrelated op and poison later tests.
setup_device("CPU", synchronize=True)
