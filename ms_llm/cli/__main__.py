"""``python -m ms_llm.cli COMMAND ...``: the ``ms-llm`` console entry, without the installed
script."""
import sys

from ms_llm.cli import main

sys.exit(main())
