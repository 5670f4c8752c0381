"""Criterion (d)'s family fault launch (``ms_llm.qualify.fault``) without launching: the per-run
fault arming of the worker (first attempt only, per rank), the relaunch skipping recorded runs,
and the per-cell verdicts read from the supervisor's log and the runs' ``metrics.jsonl``. The
real launches are what ``ms-llm qualify`` runs (published in docs/support)."""
import json
import os

from ms_llm.qualify import worker
from ms_llm.qualify.fault import check_cell, fault_run
from ms_llm.qualify.matrix import FAMILIES, FEATURES, Cell
from ms_llm.training import faults

CELL = Cell(FAMILIES["qwen3"], FEATURES["dp"])
REF = {"loss": [3.0, 2.5, 2.0, 1.5], "grad_norm": [1.0, 0.9, 0.8, 0.7], "error": None}


def test_fault_is_armed_once_per_run_and_rank(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    run = fault_run(CELL, "c.yaml", ["--x", "1"], str(tmp_path), steps=4)
    assert run["fault"] == [3, 1] and "--training.resume" in run["args"]
    worker.arm_fault(run, 1)
    assert faults.fault_target() == (3, 1)              # first attempt: armed
    worker.arm_fault(run, 1)
    assert faults.fault_target() is None                # relaunch: disarmed, the run resumes
    worker.arm_fault(run, 0)
    assert faults.fault_target() == (3, 1)              # another rank's own marker
    worker.arm_fault({"name": "plain"}, 0)
    assert os.environ.get(faults.FAULT_ENV) is None     # a run without a fault: none


def _launch(tmp_path, steps_trained, metrics, failed=((-9, 41.0),), rc=0):
    run = fault_run(CELL, "c.yaml", [], str(tmp_path), steps=4)
    os.makedirs(run["out"], exist_ok=True)
    with open(os.path.join(run["out"], "metrics.jsonl"), "w") as f:
        for step, loss in metrics:
            f.write(json.dumps({"step": step, "loss": loss,
                                "grad_norm": REF["grad_norm"][step - 1]}) + "\n")
    rec = {"name": run["name"], "error": None, "steps": steps_trained}
    return run, {"runs": {run["name"]: rec}, "failed": list(failed), "rc": rc, "log": ""}


def test_cell_verdicts(tmp_path):
    # killed in step 3, checkpoint at 2: the relaunch trains 3-4; step 3's record is replayed
    good = [(1, 3.0), (2, 2.5), (3, 9.9), (1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)]
    run, launch = _launch(tmp_path / "a", [3, 4], good)
    chk = check_cell(CELL, run, 0, launch, REF, 4, 600)
    assert chk.state == "ok" and "resumed from step 2" in chk.detail, chk.detail
    # the kill did not end the launch
    assert "did not end the launch" in check_cell(CELL, run, 1, launch, REF, 4, 600).detail
    # the relaunch started over instead of resuming
    run, launch = _launch(tmp_path / "b", [1, 2, 3, 4], good)
    assert "expected 3-4" in check_cell(CELL, run, 0, launch, REF, 4, 600).detail
    # a restarted curve off the uninterrupted one
    run, launch = _launch(tmp_path / "c", [3, 4], good[:-1] + [(4, 1.6)])
    assert "restarted curve: loss step 4" in check_cell(CELL, run, 0, launch, REF, 4, 600).detail
    # the uninterrupted run is missing: nothing to compare with
    assert check_cell(CELL, run, 0, launch, dict(REF, error="x"), 4, 600).state == "unmet"


def test_fault_launch_command_runs_the_worker_under_the_supervisor(tmp_path):
    """The supervisor builds each attempt's msrun command from ``-- ENTRY ARGS``
    (``ms_llm.training.restart``); handing it a whole msrun command made msrun start
    ``python msrun`` and every cell's (d) fail. A real 2-worker launch of a job with no runs:
    the workers start, record nothing and exit 0, with no failed attempt."""
    from ms_llm.qualify.fault import WORKER, run_fault_launch, supervisor_command
    from ms_llm.qualify.plan import Job
    cmd = supervisor_command(Job("x", 2, [{"name": "r"}]), "/j", "/j/job.json", 1234)
    tail = cmd[cmd.index("--"):]
    assert tail == ["--", WORKER, "/j/job.json"] and "msrun" not in cmd
    assert cmd[cmd.index("--worker-num") + 1] == "2"
    launch = run_fault_launch(Job("empty", 2, []), str(tmp_path), 300, say=lambda m: None)
    assert launch["rc"] == 0 and launch["failed"] == [], launch["log"][-2000:]


def test_a_run_that_fails_before_its_kill_ends_no_attempt(tmp_path):
    """Three cells in one launch, the first failing at its step-2 save (recorded, the job goes
    on): the second cell's kill ended attempt 1, the third's attempt 2 (not 2 and 3, which
    read "did not end the launch" for the last cell)."""
    from ms_llm.qualify.fault import attempt_indices
    runs = []
    for k, (last, error) in enumerate([(2, "ValueError: save"), (4, None), (4, None)]):
        run = fault_run(CELL, "c.yaml", [], str(tmp_path / str(k)), steps=6)
        run["name"] += str(k)
        os.makedirs(run["out"], exist_ok=True)
        with open(os.path.join(run["out"], "metrics.jsonl"), "w") as f:
            for step in range(1, last + 1):
                f.write(json.dumps({"step": step, "loss": 1.0, "grad_norm": 1.0}) + "\n")
        runs.append((run, {"name": run["name"], "error": error, "steps": [5, 6]}))
    launch = {"runs": {r["name"]: rec for r, rec in runs}}
    assert attempt_indices([r for r, _ in runs], launch) == [0, 0, 1]
    launch["runs"][runs[0][0]["name"]]["error"] = None          # killed like the others
    assert attempt_indices([r for r, _ in runs], launch) == [0, 1, 2]
