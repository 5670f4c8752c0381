"""``--help`` through the installed ``ms-llm`` entry point: every command prints its usage and exits
0, and ``train --help`` lists every config key of the schema with its default."""
import dataclasses
import subprocess

import pytest
from helpers.cli import run_ms_llm

from ms_llm.cli import COMMANDS
from ms_llm.config.schema import _SECTIONS
from ms_llm.models import TransformerConfig


def ms_llm(*args: str) -> subprocess.CompletedProcess:
    return run_ms_llm(*args, timeout=120)


def test_top_level_help_lists_the_commands():
    r = ms_llm("--help")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"\n  {name} " in r.stdout


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_help_exits_zero(command, flag):
    r = ms_llm(command, flag)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"usage: ms-llm {command}"), r.stdout[:200]
    assert r.stderr.strip() == ""


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)


def test_train_help_lists_every_section_key_and_default():
    r = ms_llm("train", "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    sections = {"model": TransformerConfig, **_SECTIONS}
    for section, cls in sections.items():
        start = lines.index(next(ln for ln in lines if ln.startswith(f"{section}:")))
        block = []
        for ln in lines[start + 1:]:
            if not ln.startswith("  "):
                break
            block.append(ln.split())
        rows = {row[0]: row for row in block}
        for f in dataclasses.fields(cls):
            assert f.name in rows, f"{section}.{f.name} missing from train --help"
            assert _default(f) in rows[f.name], (section, f.name, rows[f.name])
        assert set(rows) - {"family"} == {f.name for f in dataclasses.fields(cls)}
    assert "[> 0]" in r.stdout and "[one of cosine, linear, constant, inverse-square-root, WSD]" in r.stdout


def test_train_help_wins_over_other_arguments():
    # Even with a config and overrides, --help only prints (no training, no config error).
    r = ms_llm("train", "configs/does_not_exist.yaml", "--training.lr", "-1", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: ms-llm train"), r.stderr
