"""The pages of docs/reference/, each rendered from the code it documents (the run schema, the
``ms-llm`` argument parsers, the MindSpeed flag table, the environment tables), so a page
cannot drift from what the code accepts. ``scripts/gen_reference.py`` writes them and
``--check``s them; ``tests/docs/test_reference_docs.py`` fails when one is stale.

Only public names of ``ms_llm`` are used (the CLI is run in-process, ``--help`` captured), so
the pages survive modules moving inside the package."""
from typing import Callable, Dict

from .cli_page import render as _cli
from .config_page import render as _config
from .environment_page import render as _environment
from .flags_page import render as _flags

# file name under docs/reference/ -> its renderer
PAGES: Dict[str, Callable[[], str]] = {
    "config.md": _config,
    "cli.md": _cli,
    "mindspeed_flags.md": _flags,
    "environment.md": _environment,
}
