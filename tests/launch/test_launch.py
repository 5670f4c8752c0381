"""scripts/pretrain.sh end to end under real msrun (one job each: success and a failing worker),
and a two-node launch (NNODES/NODE_RANK) simulated on this machine."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers.cli import run_ms_llm
from helpers.parallel_common import TINY_MODEL
from helpers.pretrain_sh import pretrain_env

from helpers.paths import ROOT
from ms_llm.launch import msrun as ms_launch
from ms_llm.launch.msrun import free_port, msrun_command

SMALL = TINY_MODEL + ["--training.micro_batch_size", "4", "--training.global_batch_size", "8",
                      "--training.log_interval", "1"]


def launch(tmp_path, *args, timeout=300):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=pretrain_env(tmp_path), cwd=tmp_path)


@pytest.mark.msrun
def test_pretrain_sh_trains_and_plots(tmp_path):
    out = tmp_path / "out"
    r = launch(tmp_path, *SMALL, "--training.max_steps", "4", "--training.output_dir", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert "iteration        4/       4" in r.stdout and "lm loss:" in r.stdout
    # MFU columns (ms_llm.planning.flops; the peak from training.peak_tflops or the CPU probe)
    assert "| MFU: " in r.stdout and all(row["mfu"] > 0 and row["tflops_per_device"] > 0
                                         and row["peak_tflops"] > 0 for row in rows)
    p = run_ms_llm("plot", out, timeout=120)
    assert p.returncode == 0 and os.path.isfile(out / "loss.png")


@pytest.mark.msrun
def test_pretrain_sh_fails_when_the_worker_fails(tmp_path):
    # The config is valid (the launcher's pre-check passes); the worker then fails on the data.
    r = launch(tmp_path, *SMALL, "--data.corpus", str(tmp_path / "missing.jsonl"),
               "--training.output_dir", str(tmp_path / "out"))
    assert r.returncode != 0
    log = open(tmp_path / "logs" / "worker_0.log").read()
    assert "missing.jsonl" in log


def test_launcher_rejects_bad_node_settings(tmp_path):
    script = os.path.join(ROOT, "scripts", "pretrain.sh")
    for extra, needle in [({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK"),
                          ({"NNODES": "0"}, "NNODES"),
                          ({"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR"),
                          ({"NPROC": "2", "NPUS_PER_NODE": "3"}, "disagree")]:
        r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                           env=pretrain_env(tmp_path, **extra), cwd=tmp_path)
        assert r.returncode == 2 and needle in r.stderr, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "msrun" not in r.stdout


@contextlib.contextmanager
def forward_port(listen_host: str, port: int, target_host: str):
    """Forward TCP connections from ``listen_host:port`` to ``target_host:port`` (a thread).

    On one machine every launch whose MASTER_ADDR is a local interface address believes it is
    the master node and starts its own scheduler. The second "node" therefore gets 127.0.0.2 (on
    the loopback network but not an interface address, so msrun treats it as another host),
    and this forwarder delivers its connections to the scheduler node 0 started on 127.0.0.1.
    """
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((listen_host, port))
    server.listen(64)

    def pump(src, dst):
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def accept():
        while True:
            try:
                client, _ = server.accept()
            except OSError:     # closed: the test is over
                return
            try:
                upstream = socket.create_connection((target_host, port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        server.close()


def losses(out_dir) -> list:
    return [json.loads(line)["loss"] for line in open(os.path.join(out_dir, "metrics.jsonl"))]


@pytest.mark.msrun
@pytest.mark.extended   # the NNODES / NODE_RANK / MASTER_ADDR checks stay in the default run
def test_two_nodes_train_like_one_two_worker_launch(tmp_path):
    """NNODES=2 x NPUS_PER_NODE=1 (two launches, NODE_RANK 0 and 1, one shared MASTER_PORT) is
    one data-parallel job of two ranks: same per-step loss as NPROC=2 on one node (rtol 1e-5,
    fp32; only the all-reduce's summation could differ)."""
    run = SMALL + ["--training.max_steps", "3", "--training.jit", "false",
                   "--training.progress_bar", "false"]
    script = os.path.join(ROOT, "scripts", "pretrain.sh")

    def start(name, **extra):
        env = pretrain_env(tmp_path, LOG_DIR=str(tmp_path / f"logs_{name}"), **extra)
        cmd = ["bash", script, *run, "--training.output_dir", str(tmp_path / f"out_{name}")]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp_path)

    # One after the other: on 2 cores, three concurrent launches take longer than in sequence.
    procs = {"single": start("single", NPROC="2")}
    outs = {"single": procs["single"].communicate(timeout=300)[0]}
    port = str(free_port())
    node = dict(NNODES="2", NPUS_PER_NODE="1", MASTER_PORT=port)
    with forward_port("127.0.0.2", int(port), "127.0.0.1"):
        procs["node0"] = start("node0", NODE_RANK="0", MASTER_ADDR="127.0.0.1", **node)
        procs["node1"] = start("node1", NODE_RANK="1", MASTER_ADDR="127.0.0.2", **node)
        outs.update({name: procs[name].communicate(timeout=300)[0]
                     for name in ("node0", "node1")})
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}:\n{outs[name][-4000:]}"
    # The job really spans both launches: node 1 ran global rank 1, node 0 saw two
    # data-parallel ranks (global batch 8 = micro-batch 4 x 2 ranks: 1 micro-batch per step).
    assert os.listdir(tmp_path / "logs_node1") == ["worker_1.log"]
    assert "1 micro-batch(es) per step" in outs["node0"]
    assert "1 micro-batch(es) per step" in outs["single"]
    single, nodes = losses(tmp_path / "out_single"), losses(tmp_path / "out_node0")
    assert len(single) == 3
    np.testing.assert_allclose(nodes, single, rtol=1e-5)


# ------------------------------------------------------------------ ms_llm.launch.msrun itself
def test_msrun_command_single_and_multi_node():
    one = msrun_command("w.py", ["a", 3], worker_num=2, master_port=9000, log_dir="L")
    assert one == ["msrun", "--worker_num", "2", "--local_worker_num", "2", "--master_port",
                   "9000", "--log_dir", "L", "--join", "True", "--cluster_time_out", "120",
                   "w.py", "a", "3"]
    two = msrun_command("w.py", worker_num=4, local_worker_num=2, node_rank=1,
                        master_addr="10.0.0.1", master_port="@PORT@", log_dir="@LOG_DIR@",
                        cluster_time_out=30)
    assert two[:10] == ["msrun", "--worker_num", "4", "--local_worker_num", "2", "--node_rank",
                        "1", "--master_addr", "10.0.0.1", "--master_port"]
    with pytest.raises(ValueError, match="master_addr"):
        msrun_command("w.py", worker_num=4, local_worker_num=2, node_rank=1, master_port=1,
                      log_dir="L")
    env = ms_launch.launch_env({"PYTHONPATH": f"/x{os.pathsep}{ms_launch.ROOT}", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(os.pathsep) == [ms_launch.ROOT, "/x"]
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert env["GLOG_v"] == "3" and env["PYTHONUNBUFFERED"] == "1"


def test_pretrain_sh_supervisor_builds_the_msrun_command(monkeypatch):
    """scripts/pretrain.sh hands its node settings to ms_llm.training.restart, which builds the
    command with ms_llm.launch.msrun (placeholders filled per attempt)."""
    from ms_llm.training import restart
    seen = {}
    monkeypatch.setattr(restart, "run_with_restarts",
                        lambda t, n, s, p, d: seen.update(t=t, n=n, p=p, d=d) or 0)
    assert restart.main(["--max-restarts", "0", "--save-dir", "", "--master-port", "8118",
                         "--log-dir", "D", "--worker-num", "4", "--local-worker-num", "2",
                         "--node-rank", "1", "--master-addr", "10.0.0.1",
                         "--cluster-time-out", "60", "--", "train.py", "c.yaml", "--x.y", "1"]) == 0
    assert seen["t"] == msrun_command("train.py", ["c.yaml", "--x.y", "1"], worker_num=4,
                                      local_worker_num=2, node_rank=1, master_addr="10.0.0.1",
                                      master_port=restart.PORT, log_dir=restart.LOG_DIR,
                                      cluster_time_out=60)
    assert (seen["n"], seen["p"], seen["d"]) == (0, 8118, "D")
    assert restart.launch_command(seen["t"], 1, 8118, "D")[9:12] == ["--master_port", "8119",
                                                                     "--log_dir"]
    # a relaunch resumes: the template's own --training.resume is replaced, never given twice
    # (the command line refuses a key given twice)
    tpl = ["train.py", "c.yaml", "--training.resume", "none", "--x.y", "1",
           "--training.resume=none"]
    assert restart.launch_command(tpl, 0, 8118, "D") == tpl
    assert restart.launch_command(tpl, 2, 8118, "D") == ["train.py", "c.yaml", "--x.y", "1",
                                                         "--training.resume", "auto"]


def test_a_timed_out_launch_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    # the grandchild runs in a session of its own, as msrun's workers do
    job = ms_launch.MsrunJob(["bash", "-c", f"setsid sleep 60 & echo $! > {pid_file}; echo hi; "
                              "wait"], str(tmp_path), 1, output=str(tmp_path / "worker_0.log"))
    res = job.wait(timeout=2)
    assert res.returncode == ms_launch.TIMEOUT and not res.ok and res.logs == ["hi\n"]
    child = int(pid_file.read_text())
    for _ in range(50):   # the SIGKILLed grandchild disappears (or is a zombie being reaped)
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"pid {child} survived the time-out")
    assert "worker_0.log" in res.failure_report() and "msrun exit timeout" in res.failure_report()


def test_run_spec_round_trip():
    from helpers.msrun import parse_run_spec, run_spec
    s = run_spec("a", ["--data.split", "90,10,0"], ["--x.y", "1"], flags=["@dead", "packed"])
    assert s == "a:--data.split=90|10|0,--x.y=1,@dead,@packed"
    assert parse_run_spec(s) == ("a", ["--data.split=90,10,0", "--x.y=1"], ["@dead", "@packed"])
    with pytest.raises(ValueError, match="run spec b"):
        run_spec("b", ["--x.y"])
