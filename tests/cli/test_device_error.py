"""A device that cannot be used stops every command that selects one with one line
``device error: ...`` and exit code 2 (``ms_llm.cli.run_command``): the model-running commands,
``train`` and the MindSpeed entries. The failure is real: Ascend asked for (``MS_LLM_DEVICE`` /
``training.device``) on this CPU build of MindSpore, whose Ascend plugin does not load."""
import os
import subprocess
import sys

import pytest

from helpers.fake_ascend import no_device_chosen
from helpers.parallel_common import CONFIG
from helpers.paths import ROOT
from ms_llm import cli
from ms_llm.compat.environment import configure


@pytest.fixture
def ascend_asked(monkeypatch):
    monkeypatch.setenv("MS_LLM_DEVICE", "Ascend")
    chosen = no_device_chosen(monkeypatch)
    yield chosen
    configure({})   # train configures the process's settings from its run config


def _one_device_line(stderr: str, prefix: str = "") -> str:
    lines = [line for line in stderr.splitlines() if line.strip()
             and "MS_LLM_DEVICE is deprecated" not in line]   # the variable's own notice
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prefix}device error: device Ascend asked for"), lines[0]
    assert "libmindspore_ascend" in lines[0]   # the plugin's own load error
    return lines[0]


COMMANDS = {
    "generate": ["--load", "{tmp}", "--prompt", "hi"],
    "chat": ["--load", "{tmp}"],
    "evaluate": ["--task", "mmlu", "--task-data-path", "{tmp}", "--load", "{tmp}"],
    "lm-eval": ["--model", "ms-llm", "--tasks", "boolq"],
    "train": [CONFIG, "--training.device", "ascend", "--training.output_dir", "{tmp}/out"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_that_selects_a_device_says_why_in_one_line(ascend_asked, capsys,
                                                                  tmp_path, command):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]]
    assert cli.main([command, *argv]) == 2
    _one_device_line(capsys.readouterr().err)
    assert ascend_asked == []    # never handed to MindSpore
    assert not (tmp_path / "out").exists()


def test_the_commands_that_select_a_device_are_all_checked():
    assert set(cli.RUNS_A_MODEL) | {"train"} == set(COMMANDS)


def test_other_errors_are_not_turned_into_device_errors():
    def broken():
        raise RuntimeError("not a device problem")
    with pytest.raises(RuntimeError, match="not a device problem"):
        cli.run_command(broken)


# the fewest MindSpeed flags that make a model ms-llm builds (Megatron's defaults are refused)
MINIMAL = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
           "--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.mark.parametrize("entry", ["pretrain_gpt.py", "posttrain_gpt.py"])
def test_mindspeed_entries_say_why_in_one_line(tmp_path, entry):
    env = dict(os.environ, MS_LLM_DEVICE="Ascend", GLOG_v="3")
    r = subprocess.run([sys.executable, os.path.join(ROOT, entry), *MINIMAL],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    _one_device_line(r.stderr, prefix=f"{entry}: ")
