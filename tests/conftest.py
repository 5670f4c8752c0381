"""Shared pytest setup for ms-llm tests."""
import os
import sys

os.environ.setdefault("MS_LLM_TEST", "1")

# tests/ helpers (hf_reference, hf_fixtures) import as plain modules.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import mindspore as ms  # noqa: E402

ms.set_device("CPU")
# PyNative errors are sticky without synchronous execution: a failing op would otherwise
# re-raise its stale error from the next unrelated op and poison later tests.
ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
