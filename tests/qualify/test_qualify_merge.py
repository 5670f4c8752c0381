"""One published table from several ``ms-llm qualify`` runs (``qualify.merge``): fake out
folders (a table written before runs were recorded, and newer ones), merged through the CLI's
``--merge-from`` and through ``write(..., merge=True)`` (what ``--cells ... --merge`` calls after
its run). No job runs: the merge logic is pure JSON and file copies."""
import json

from ms_llm.qualify import report
from ms_llm.cli.qualify import main
from ms_llm.qualify.merge import load

VERSIONS = {"Python": "3.11.7", "MindSpore": "2.10.0", "NumPy": "1.26.4",
            "device": "CPU (x86_64, 2 cores)", "CANN": "not present"}


def cell(family, feature, status, unmet=(), log=True):
    slug = f"{family}__{feature}".replace("+", "_").replace(" ", "_")
    return {"family": family, "feature": feature, "status": status, "unmet": list(unmet),
            "log": f"logs/{slug}.log" if log else None, "criteria": {}}


def old_folder(path, commit, generated, cells):
    """A support.json as qualify wrote it before runs were recorded (one run, top-level keys)."""
    (path / "logs").mkdir(parents=True)
    for c in cells:
        if c["log"]:
            (path / c["log"]).write_text(f"{c['family']}:{c['feature']} at {commit}\n")
    (path / "support.json").write_text(json.dumps(
        {"generated": generated, "command": "ms-llm qualify --suite full", "suite": "full",
         "commit": commit, "versions": VERSIONS, "seconds": 600,
         "criteria": "docs/qualification.md", "cells": cells}))
    return path


def test_merge_folders_replaces_cells_and_names_each_cells_commit(tmp_path):
    a = old_folder(tmp_path / "a", "a" * 40, "2026-12-02 13:40 UTC",
                   [cell("qwen3", "single", "Pass"), cell("qwen3", "dp", "Fail", ["a: step 3"]),
                    cell("qwen3", "ep", "n/a", log=False)])
    b = old_folder(tmp_path / "b", "b" * 40, "2026-12-02 15:00 UTC",
                   [cell("qwen3", "dp", "Pass"), cell("qwen35", "lane resume", "Pass")])
    out = tmp_path / "docs"
    assert main(["--merge-from", str(a), "--merge-from", str(b), "--out", str(out)]) == 0
    info = json.loads((out / "support.json").read_text())
    assert [r["commit"] for r in info["runs"]] == ["a" * 40, "b" * 40]
    got = {(c["family"], c["feature"]): c for c in info["cells"]}
    assert set(got) == {("qwen3", "single"), ("qwen3", "dp"), ("qwen3", "ep"),
                        ("qwen35", "lane resume")}
    assert got["qwen3", "dp"]["status"] == "Pass"                 # the later folder's cell wins
    assert got["qwen3", "dp"]["run"] == info["runs"][1]["id"]
    assert got["qwen3", "single"]["run"] == info["runs"][0]["id"]
    assert (out / "logs/qwen3__dp.log").read_text() == "qwen3:dp at " + "b" * 40 + "\n"
    assert (out / "logs/qwen3__single.log").read_text().endswith("a" * 40 + "\n")
    md = (out / "support.md").read_text()
    assert "| git commit | `" + "a" * 40 + "` | `" + "b" * 40 + "` |" in md
    assert "| date | 2026-12-02 13:40 UTC | 2026-12-02 15:00 UTC |" in md
    # rows follow the matrix's order; each cell names its run's commit, n/a none
    assert "| dp | [Pass](logs/qwen3__dp.log) @`bbbbbbb` |  |" in md
    assert "| ep | n/a |  |" in md
    assert md.index("| single |") < md.index("| dp |") < md.index("| lane resume |")
    assert "Cells: 3 Pass, 1 n/a." in md
    # a run no cell comes from any more leaves the header
    c = old_folder(tmp_path / "c", "c" * 40, "2026-12-02 16:00 UTC",
                   [cell("qwen3", "single", "Pass"), cell("qwen3", "dp", "Pass"),
                    cell("qwen3", "ep", "n/a", log=False), cell("qwen35", "lane resume", "Pass")])
    assert main(["--merge-from", str(c), "--out", str(out)]) == 0
    info = json.loads((out / "support.json").read_text())
    assert [r["commit"] for r in info["runs"]] == ["c" * 40]
    assert info["commit"] == "c" * 40               # one run: its keys at the top level too


def test_a_run_merges_its_cells_into_the_published_table(tmp_path):
    out = old_folder(tmp_path / "docs", "a" * 40, "2026-12-02 13:40 UTC",
                     [cell("qwen3", "single", "Pass"), cell("qwen3", "Muon", "Fail", ["a: x"])])
    report.write(str(out), "cells", [cell("qwen3", "Muon", "Pass")], "CPU", 60.0,
                 "ms-llm qualify --cells qwen3:Muon --merge", merge=True)
    table = load(str(out))
    assert len(table["runs"]) == 2 and table["runs"][1]["commit"] != "a" * 40
    got = {(c["family"], c["feature"]): c for c in table["cells"]}
    assert got["qwen3", "Muon"]["status"] == "Pass"
    assert got["qwen3", "Muon"]["run"] == table["runs"][1]["id"]
    assert got["qwen3", "single"]["run"] == table["runs"][0]["id"]
    # without --merge the run's table is its own
    report.write(str(out), "cells", [cell("qwen3", "Muon", "Pass")], "CPU", 60.0, "x")
    assert [(c["family"], c["feature"]) for c in load(str(out))["cells"]] == [("qwen3", "Muon")]


def test_bad_merge_inputs_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    assert main(["--merge-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "support.json: no such file" in capsys.readouterr().err
    (bad / "support.json").write_text("{not json")
    assert main(["--merge-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "support.json: not JSON" in capsys.readouterr().err
    (bad / "support.json").write_text(json.dumps({"cells": [{"family": "qwen3"}]}))
    assert main(["--merge-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "lacks family / feature / status" in capsys.readouterr().err
    a = old_folder(tmp_path / "a", "a" * 40, "2026-12-02 13:40 UTC",
                   [cell("qwen3", "single", "Pass")])
    (a / "logs/qwen3__single.log").unlink()
    assert main(["--merge-from", str(a), "--out", str(tmp_path / "o")]) == 2
    assert "the log" in capsys.readouterr().err
    assert main(["--merge-from", str(a), "--merge", "--out", str(tmp_path / "o")]) == 2
    # --merge into a folder that is not a table is refused before anything runs
    assert main(["--cells", "qwen3:single", "--merge", "--out", str(bad)]) == 2
    assert "--merge:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_fault_only_finds_the_earlier_runs_uninterrupted_curve_and_rewrites_the_log(tmp_path):
    """``--fault-only``: the earlier run's record of a cell is found by its arguments (its
    scratch folder for ours), whichever cell's name its shared reference took; the cell's log
    gets the new (d) line and fault section, the table both commits."""
    from ms_llm.qualify import fault_only
    from ms_llm.qualify.criteria import Check
    from ms_llm.qualify.data import prepare
    from ms_llm.qualify.matrix import select
    from ms_llm.qualify.plan import Planner
    old_work, work = str(tmp_path / "old"), str(tmp_path / "new")
    # the earlier run planned qwen3 single then dp (dp's reference is single's); write its jobs
    old = Planner(old_work, prepare(old_work + "/data"))
    for c in select("full", ["qwen3:single", "qwen3:dp"]):
        old.add(c)
    for job in old.jobs.values():
        d = tmp_path / "old" / "jobs" / job.name
        d.mkdir(parents=True)
        (d / "job.json").write_text(json.dumps({"runs": job.runs}))
        (d / "results.json").write_text(json.dumps({"world_size": job.nproc, "runs": {
            r["name"]: {"name": r["name"], "loss": [float(len(r["name"]))], "grad_norm": [1.0],
                        "error": None, "refused": False} for r in job.runs}}))
    recs = fault_only.earlier_records(old_work)
    # now dp alone: our plan names its reference qwen3__dp.ref, theirs qwen3__single.ref
    new = Planner(work, prepare(work + "/data"))
    (cell,) = select("full", ["qwen3:single"])
    names = new.add(cell)
    got = fault_only.uninterrupted(new, names.run, work, old_work, recs)
    assert got["name"] == "qwen3__single.ref"
    (dp,) = select("full", ["qwen3:dp"])
    new2 = Planner(work, prepare(work + "/data"))
    assert fault_only.uninterrupted(new2, new2.add(dp).run, work, old_work, recs)["name"] == \
        "qwen3__dp.run"
    assert fault_only.uninterrupted(new2, new2.add(dp).ref, work, old_work, recs)["name"] == \
        "qwen3__single.ref"
    # a changed plan (another seed) finds nothing
    assert fault_only.uninterrupted(new2, new2.add(dp).run, work, old_work + "x", recs) is None


def test_a_d_only_run_patches_its_cells_d_and_log(tmp_path):
    """``--fault-only``'s folder holds "(d) only" cells; merged after the cells' own run, each
    replaces its cell's (d), status and log section, and the table names both commits."""
    crit = {"test": {"state": "ok", "detail": "6 steps"}, "a": {"state": "ok", "detail": "a"},
            "b": {"state": "ok", "detail": "b"}, "c": {"state": "ok", "detail": "c"},
            "d": {"state": "fail", "detail": "automatic restart: no record (launch exit 1)"}}
    big = old_folder(tmp_path / "big", "a" * 40, "2026-12-02 13:40 UTC",
                     [dict(cell("qwen3", "dp", "Fail", ["d: x"]), criteria=crit),
                      cell("qwen3", "ep", "n/a", log=False)])
    (big / "logs/qwen3__dp.log").write_text(
        "# qwen3:dp: Fail (d: x)\n\nTest: ok: 6 steps\n(d) fail: x\n\n## run r\n"
        "--- fault launch (restart supervisor)\nold line\n")
    d = tmp_path / "d"
    (d / "logs").mkdir(parents=True)
    (d / "logs/qwen3__dp.d.log").write_text(
        "(d) ok: restarted\n(d) re-run by `x` at dddd\n--- fault launch (restart supervisor)\n"
        "new line\n")
    report.write(str(d), "cells (d) only", [
        {"family": "qwen3", "feature": "dp", "status": "(d) only", "unmet": [], "d_only": True,
         "log": "logs/qwen3__dp.d.log", "criteria": {"d": {"state": "ok", "detail": "restarted"}}}],
        None, 5.0, "x", commit="d" * 40)
    out = tmp_path / "docs"
    # (d) only before the cell's run: nothing to patch
    assert main(["--merge-from", str(d), "--merge-from", str(big), "--out", str(out)]) == 2
    for _ in range(2):          # merging the same (d) twice patches the log once
        assert main(["--merge-from", str(big), "--merge-from", str(d), "--out", str(out)]) == 0
    info = json.loads((out / "support.json").read_text())
    dp = next(c for c in info["cells"] if c["feature"] == "dp")
    assert dp["status"] == "Pass" and dp["unmet"] == [] and dp["criteria"]["d"]["state"] == "ok"
    assert dp["criteria"]["a"]["detail"] == "a"
    assert (out / "logs/qwen3__dp.log").read_text() == (
        "# qwen3:dp: Pass\n\nTest: ok: 6 steps\n(d) ok: restarted\n\n## run r\n"
        "(d) re-run by `x` at dddd\n--- fault launch (restart supervisor)\nnew line\n")
    md = (out / "support.md").read_text()
    assert "[Pass](logs/qwen3__dp.log) @`aaaaaaa` (d @`ddddddd`)" in md


def test_a_cell_whose_d_was_re_run_names_both_commits(tmp_path):
    out = old_folder(tmp_path / "docs", "a" * 40, "2026-12-02 13:40 UTC",
                     [cell("qwen3", "dp", "Pass")])
    table = load(str(out))
    run = dict(table["runs"][0], id="later", commit="d" * 40, generated="2026-12-02 15:00 UTC")
    table["runs"].append(run)
    table["cells"][0]["d_run"] = "later"
    report.write_table(str(out), table)
    md = (out / "support.md").read_text()
    assert "[Pass](logs/qwen3__dp.log) @`aaaaaaa` (d @`ddddddd`)" in md
    assert len(load(str(out))["runs"]) == 2


def test_merge_d_from_takes_only_criterion_d_of_an_older_run(tmp_path):
    """``--merge-d-from``: an older run's (d) (with its log's fault section) patches cells whose
    other criteria come from a newer run; its (a)-(c) are not taken."""
    crit = {"test": {"state": "ok", "detail": "6 steps"}, "a": {"state": "ok", "detail": "new a"},
            "d": {"state": "fail", "detail": "automatic restart: no record"}}
    new = old_folder(tmp_path / "new", "b" * 40, "2026-12-02 13:40 UTC",
                     [dict(cell("qwen3", "dp", "Fail", ["d: x"]), criteria=crit)])
    (new / "logs/qwen3__dp.log").write_text("# qwen3:dp: Fail\n(a) ok: new a\n(d) fail: x\n")
    older = dict(crit, a={"state": "ok", "detail": "old a"}, d={"state": "ok", "detail": "killed"})
    old = old_folder(tmp_path / "old", "a" * 40, "2026-12-02 08:16 UTC",
                     [dict(cell("qwen3", "dp", "Pass"), criteria=older),
                      dict(cell("qwen3", "tp+sp", "Pass"), criteria=older)])
    (old / "logs/qwen3__dp.log").write_text(
        "# qwen3:dp: Pass\n(a) ok: old a\n(d) ok: killed\n--- fault launch (restart supervisor)\n"
        "ms-llm restart: attempt 1 failed\n")
    out = tmp_path / "docs"
    # a (d) of a cell the table lacks (tp+sp) has nothing to patch
    assert main(["--merge-from", str(new), "--merge-d-from", str(old), "--out", str(out)]) == 2
    (old / "support.json").write_text(json.dumps(dict(
        json.loads((old / "support.json").read_text()),
        cells=[dict(cell("qwen3", "dp", "Pass"), criteria=older)])))
    assert main(["--merge-from", str(new), "--merge-d-from", str(old), "--out", str(out)]) == 0
    (dp,) = json.loads((out / "support.json").read_text())["cells"]
    assert dp["status"] == "Pass" and dp["criteria"]["a"]["detail"] == "new a"
    assert dp["criteria"]["d"]["detail"] == "killed"
    log = (out / "logs/qwen3__dp.log").read_text()
    assert log.startswith("# qwen3:dp: Pass\n(a) ok: new a\n(d) ok: killed\n(d) from ")
    assert log.endswith("--- fault launch (restart supervisor)\nms-llm restart: attempt 1 failed\n")
    assert "@`bbbbbbb` (d @`aaaaaaa`)" in (out / "support.md").read_text()


def test_merging_a_patched_table_again_leaves_its_logs_byte_identical(tmp_path):
    """A table whose cells carry (d) from another run (``--merge-d-from``: "(d) from" lines,
    ``--fault-only``: "(d) re-run by") is merged again (``--cells ... --merge`` re-patches every
    cell of the table): no log gains a line. It once re-appended "(d) ok" after "(d) from"."""
    crit = {"test": {"state": "ok", "detail": "6 steps"}, "a": {"state": "ok", "detail": "new a"},
            "d": {"state": "fail", "detail": "automatic restart: no record"}}
    new = old_folder(tmp_path / "new", "b" * 40, "2026-12-02 13:40 UTC",
                     [dict(cell("qwen3", "dp", "Fail", ["d: x"]), criteria=crit)])
    (new / "logs/qwen3__dp.log").write_text("# qwen3:dp: Fail\n(a) ok: new a\n(d) fail: x\n")
    old = old_folder(tmp_path / "old", "a" * 40, "2026-12-02 08:16 UTC",
                     [dict(cell("qwen3", "dp", "Pass"),
                           criteria=dict(crit, d={"state": "ok", "detail": "killed"}))])
    (old / "logs/qwen3__dp.log").write_text(
        "# qwen3:dp: Pass\n(a) ok: old a\n(d) ok: killed\n--- fault launch (restart supervisor)\n"
        "ms-llm restart: attempt 1 failed\n")
    out = tmp_path / "docs"
    assert main(["--merge-from", str(new), "--merge-d-from", str(old), "--out", str(out)]) == 0
    logs = {p.name: p.read_bytes() for p in (out / "logs").iterdir()}
    md = (out / "support.md").read_bytes()
    assert logs["qwen3__dp.log"].count(b"(d) ok: killed") == 1
    for _ in range(2):
        assert main(["--merge-from", str(out), "--out", str(out)]) == 0
        assert {p.name: p.read_bytes() for p in (out / "logs").iterdir()} == logs
        assert (out / "support.md").read_bytes() == md
