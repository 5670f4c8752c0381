"""docs/reference/cli.md: every ``ms-llm`` command (``ms_llm.cli.COMMANDS``) with the
``--help`` its argument parser prints, then the MindSpeed-style entry scripts at the
repository root and the launch scripts under ``scripts/``."""
import ast
import os
import re
from typing import List

from .capture import printed
from .markdown import page

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTRO = """`ms-llm COMMAND --help` prints each command's options; the text below is that output.
MindSpeed-LLM users can also keep their scripts' `pretrain_gpt.py` / `posttrain_gpt.py` command
lines (see [the flag glossary](mindspeed_flags.md))."""

# Where a command's help stops being its own: the rest is documented elsewhere or belongs to
# another program (and would make the page depend on what is installed).
HELP_ENDS = {
    "train": "config keys (",                     # the schema: config.md
    "lm-eval": "The harness's options follow.",   # lm-evaluation-harness's own options
}
SEE_ALSO = {"train": "Every config key it accepts: [config.md](config.md).",
            "lm-eval": "The harness's own options: `lm_eval --help` (the harness comes with "
                       "`pip install 'ms-llm[eval]'`)."}
ENTRY_SCRIPTS = ("pretrain_gpt.py", "posttrain_gpt.py")
SHELL_SCRIPTS = ("scripts/pretrain.sh", "scripts/convert_ckpt.sh")


def _help(argv: List[str]) -> str:
    from ms_llm.cli import main
    text = printed(main, argv + ["--help"])
    end = HELP_ENDS.get(argv[0])
    if end is not None:
        if end not in text:
            raise RuntimeError(f"ms-llm {argv[0]} --help no longer holds {end!r}: update "
                               f"HELP_ENDS in {__file__}")
        text = text[:text.index(end)].rstrip()
    return text


def _subcommands(text: str) -> List[str]:
    """A command's own subcommands (``ms-llm checkpoint {verify} ...``), from its usage line."""
    m = re.match(r"usage: ms-llm \S+ (?:\[-h\] )?\{([a-z_,-]+)\} \.\.\.", text)
    return m.group(1).split(",") if m else []


def _fenced(text: str) -> str:
    return f"```text\n{text}\n```"


def _command_block(name: str, summary: str) -> str:
    text = _help([name])
    parts = [f"## ms-llm {name}", summary[:1].upper() + summary[1:] + ".", _fenced(text)]
    for sub in _subcommands(text):
        parts += [f"### ms-llm {name} {sub}", _fenced(_help([name, sub]))]
    if name in SEE_ALSO:
        parts.append(SEE_ALSO[name])
    return "\n\n".join(parts)


def _docstring(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _header_comment(path: str) -> str:
    """The comment block at the top of a shell script (after the ``#!`` line)."""
    lines = []
    with open(os.path.join(ROOT, path)) as f:
        for line in f.read().splitlines()[1:]:
            if not line.startswith("#"):
                break
            lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines)


def _entry_block(script: str) -> str:
    from ms_llm.mindspeed.entry import main
    usage = printed(lambda argv: main(argv, entry=script), ["--help"])
    return "\n\n".join([f"### {script}", _fenced(_docstring(script)), "`--help`:",
                        _fenced(usage)])


def render() -> str:
    from ms_llm.cli import COMMANDS
    contents = " · ".join(f"[{name}](#ms-llm-{name})" for name in COMMANDS)
    blocks = [_command_block(name, summary) for name, summary in COMMANDS.items()]
    blocks.append("## Scripts\n\nMindSpeed-LLM's training entries, run under msrun with the "
                  "flags of a MindSpeed-LLM example script unchanged:")
    blocks += [_entry_block(script) for script in ENTRY_SCRIPTS]
    blocks.append("Launchers (their environment variables: [environment.md](environment.md)):")
    blocks += [f"### {script}\n\n" + _fenced(_header_comment(script)) for script in SHELL_SCRIPTS]
    return page("Command-line reference", INTRO, "Commands: " + contents, *blocks)
