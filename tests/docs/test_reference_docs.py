"""docs/reference/ is generated from the code (scripts/gen_reference.py) and must be current:
every config key of the schema, every flag of the MindSpeed flag table (with the key it maps
to, or its no-op / refusal reason) and every environment variable the sources read is on its
page."""
import dataclasses
import glob
import os
import re
import subprocess
import sys
import typing

import ms_llm
from ms_llm.compat.environment import SETTINGS, VARIABLES
from ms_llm.config import RunConfig
from ms_llm.mindspeed.flag_table import TABLE, Map, Noop, Post, Refuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ms_llm.__file__)))   # the checkout
PAGES = os.path.join(ROOT, "docs", "reference")


def _page(name: str) -> str:
    with open(os.path.join(PAGES, name), encoding="utf-8") as f:
        return f.read()


def _generate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOG_v="3",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_reference.py"),
                           *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_pages_are_what_the_generator_writes():
    r = _generate("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_pages_hold_nothing_of_this_machine():
    for name in sorted(os.listdir(PAGES)):
        page = _page(name)
        for local in (ROOT, os.path.expanduser("~"), sys.executable):
            assert len(local) < 2 or local not in page, (name, local)


def test_check_names_a_stale_page(tmp_path):
    r = _generate("--check", "--out", str(tmp_path))
    assert r.returncode == 1 and "config.md" in r.stderr and "environment.md" in r.stderr, \
        r.stdout + r.stderr
    assert not os.listdir(tmp_path)   # --check writes nothing


def _config_keys():
    hints = typing.get_type_hints(RunConfig)
    keys = ["model.family"]
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(hints[f.name])]
    return keys


def test_every_config_key_is_in_the_config_reference():
    page = _page("config.md")
    keys = _config_keys()
    assert len(keys) > 200
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"config keys missing from docs/reference/config.md: {missing}"


def _flag_rows():
    rows = {}
    for line in _page("mindspeed_flags.md").splitlines():
        m = re.match(r"^\| `(--[^`]+)` \|", line)
        if m:
            rows[m.group(1)] = " ".join(line.split())
    return rows


def test_every_mindspeed_flag_is_in_the_glossary_with_its_key_or_reason():
    rows = _flag_rows()
    assert set(rows) == set(TABLE), set(rows) ^ set(TABLE)
    for flag, entry in TABLE.items():
        row = rows[flag]
        if isinstance(entry, Map):
            assert f"| mapped | `{entry.key}`" in row, row
        elif isinstance(entry, Noop):
            assert f"| no-op | {' '.join(entry.reason.split())}" in row, row
        elif isinstance(entry, Refuse):
            assert f"| refused | {' '.join(entry.reason.split())}" in row, row
        else:
            assert isinstance(entry, Post) and f"| derived | {' '.join(entry.means.split())}" \
                in row, row


def _sources(*patterns: str):
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield path, f.read()


def test_every_ms_llm_variable_the_sources_name_is_documented():
    found = set()
    for _, text in _sources("ms_llm/**/*.py", "ms_llm/**/*.cpp", "ms_llm/**/*.h",
                            "scripts/**/*.sh", "scripts/**/*.py", "*.py"):
        found |= set(re.findall(r"\bMS_LLM_[A-Z0-9_]+", text))
    assert {"MS_LLM_CACHE", "MS_LLM_DISABLE_AOT"} <= found
    tables = set(VARIABLES) | {s.alias for s in SETTINGS.values()}
    assert found <= tables, f"not in ms_llm.compat.environment: {sorted(found - tables)}"
    page = _page("environment.md")
    assert not [v for v in found if f"| `{v}` |" not in page]


def test_every_other_variable_the_sources_read_is_documented():
    read = set()
    for _, text in _sources("ms_llm/**/*.py"):
        read |= set(re.findall(r'os\.environ(?:\.get|\.setdefault|\.pop)?[(\[]\s*"(\w+)"', text))
        read |= set(re.findall(r'"(\w+)" in os\.environ', text))
    for _, text in _sources("scripts/*.sh"):
        read |= set(re.findall(r"\$\{(\w+):?-", text))
    read = {v for v in read if not v.startswith("MS_LLM_")}
    assert {"MS_WORKER_NUM", "MS_ROLE", "NPROC", "MASTER_ADDR"} <= read, read
    page = _page("environment.md")
    missing = sorted(v for v in read if f"| `{v}` |" not in page)
    assert not missing, f"environment variables missing from docs/reference/environment.md: " \
                        f"{missing}"
