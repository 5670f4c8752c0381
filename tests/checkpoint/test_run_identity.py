"""A save folder belongs to one run (issue #41): the first save writes ``run.json`` and every
checkpoint records the run id; a run that resumes nothing refuses a folder holding another
run's checkpoints in one line naming the folder and the flags that would reuse it, and
``resume auto`` refuses a newest checkpoint of another run (two runs mixed)."""
import json
import os

import numpy as np
import pytest
from helpers.parallel_common import TINY_MODEL

from ms_llm.checkpoint import run_identity
from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import DCPError, LocalChunk
from ms_llm.cli.train import main as train_main
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
RUN = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "2",
                    "--training.progress_bar", "false", "--training.jit", "false",
                    "--checkpoint.save_interval", "1"]


def _save(d, step, run_id):
    w = np.ones((2, 2), np.float32)
    return dcp.save_checkpoint(str(d), step, {"w": LocalChunk(w, w.shape)},
                               {"step": step, "run_id": run_id}, rank=0, world_size=1,
                               barrier=lambda: None)


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    assert len(run_identity.run_id_for(str(tmp_path), None, {})) == 32   # empty: a new id
    run_identity.claim(str(tmp_path), "a" * 32)
    _save(tmp_path, 1, "a" * 32)
    with pytest.raises(DCPError, match=rf"checkpoint.save_dir {tmp_path}: holds the checkpoints "
                       rf"of run a{{32}} \(newest iter_0000001\) and this run resumes nothing; "
                       rf"continue it with --training.resume auto, or give this run a new "
                       rf"--checkpoint.save_dir"):
        run_identity.run_id_for(str(tmp_path), None, {})
    with pytest.raises(DCPError, match="this run resumes /elsewhere/iter_0000005"):
        run_identity.run_id_for(str(tmp_path), "/elsewhere/iter_0000005", {})
    with pytest.raises(DCPError, match=r"belongs to run a{32}, not to this run \(b{32}\)"):
        run_identity.claim(str(tmp_path), "b" * 32)


def test_resume_continues_only_the_folders_own_run(tmp_path):
    run_identity.claim(str(tmp_path), "a" * 32)
    own = _save(tmp_path, 1, "a" * 32)
    assert run_identity.run_id_for(str(tmp_path), own, {"run_id": "a" * 32}) == "a" * 32
    other = _save(tmp_path, 2, "b" * 32)
    with pytest.raises(DCPError, match=r"iter_0000002 belongs to run b{32}, the folder to run "
                                       r"a{32} \(two runs mixed\)"):
        run_identity.run_id_for(str(tmp_path), other, {"run_id": "b" * 32})
    # a checkpoint of an older ms-llm (no run id) continues under the folder's id
    assert run_identity.run_id_for(str(tmp_path), own, {}) == "a" * 32


def test_damaged_run_file_is_one_line(tmp_path):
    (tmp_path / "run.json").write_text("[1]")
    with pytest.raises(DCPError, match="run.json: unreadable run identity"):
        run_identity.folder_run_id(str(tmp_path))
    (tmp_path / "run.json").write_text('{"run_id": 3}')
    with pytest.raises(DCPError, match="'run_id' must be a non-empty string, got 3"):
        run_identity.folder_run_id(str(tmp_path))


def test_a_fresh_run_never_mixes_into_another_runs_folder(tmp_path, capsys):
    """The probe of the issue: run A saves steps 1-3; run B (another seed, resume none) into the
    same folder is refused before training and changes nothing; ``resume auto`` continues A."""
    save, out = tmp_path / "ckpt", tmp_path / "out"
    common = [CONFIG, *RUN, "--checkpoint.save_dir", str(save), "--training.output_dir", str(out)]
    assert train_main([*common, "--training.max_steps", "3"]) == 0
    rid = json.loads((save / "run.json").read_text())["run_id"]
    meta = json.loads((save / "iter_0000003" / "metadata.json").read_text())
    assert meta["state"]["run_id"] == rid
    before = {p: os.path.getmtime(os.path.join(save, p)) for p in os.listdir(save)}
    capsys.readouterr()
    assert train_main([*common, "--training.max_steps", "2", "--training.seed", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"checkpoint error: checkpoint.save_dir {save}: "
                                               f"holds the checkpoints of run {rid}"), err
    assert "--training.resume auto" in err[0]
    assert {p: os.path.getmtime(os.path.join(save, p)) for p in os.listdir(save)} == before
    assert train_main([*common, "--training.max_steps", "4", "--training.resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    meta = json.loads((save / "iter_0000004" / "metadata.json").read_text())
    assert meta["state"]["run_id"] == rid
