"""``ms-llm lm-eval`` with a task that does not exist or data that does not parse (issue #41):
exit code 2 and the error as one line (with the error it was raised from), no traceback. The
harness's own log lines before it are its own."""
import os

import pytest

from helpers import eval_fixtures
from ms_llm.cli.lm_eval import main

pytest.importorskip("lm_eval")
TASK = ("task: bad_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\n"
        "doc_to_choice: \"{{{{choices}}}}\"\ndoc_to_target: \"{{{{label}}}}\"\n"
        "metric_list:\n  - metric: acc\n")


def test_the_error_line_names_the_cause(monkeypatch, capsys):
    """Fast: the wrapper's line for a chained error, as ``datasets`` raises it."""
    import json
    import lm_eval.__main__ as harness

    def fails():
        try:
            json.loads("{not json")
        except ValueError as e:
            raise RuntimeError("An error occurred while generating the dataset") from e
    monkeypatch.setattr(harness, "cli_evaluate", fails)
    assert main(["--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ms-llm lm-eval: RuntimeError: An error occurred while generating the dataset (from "
        "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1))")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return eval_fixtures.make_model(str(tmp_path_factory.mktemp("lm_err_model")))


def run(model, tasks, task, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    rc = main(["--model", "ms-llm", "--model_args", f"pretrained={model}", "--tasks", task,
               "--include_path", str(tasks), "--batch_size", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("ms-llm lm-eval:")]


@pytest.mark.slow   # ~45 s: the harness's command line indexes all of its own tasks first
def test_missing_task_and_malformed_data(model, tmp_path, capsys, monkeypatch):
    """One test: the harness binds its log handler to the first captured stderr."""
    assert run(model, tmp_path, "nope_task", capsys, monkeypatch) == [
        "ms-llm lm-eval: ValueError: Tasks not found: nope_task"]
    (tmp_path / "data.json").write_text("{not json")
    (tmp_path / "bad_mc.yaml").write_text(TASK.format(data=tmp_path / "data.json"))
    lines = run(model, tmp_path, "bad_mc", capsys, monkeypatch)
    assert len(lines) == 1 and lines[0].startswith(
        "ms-llm lm-eval: DatasetGenerationError: An error occurred while generating the dataset "
        "(from ArrowInvalid: JSON parse error"), lines
