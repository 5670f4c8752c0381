"""Checkpoint integrity (issue #33): crc32 verification on load, fallback past corrupt or garbage
checkpoints with one line, no writing over checkpoints that do not verify, ``ms-llm checkpoint
verify``, and the acceptance run: a flipped byte in the newest checkpoint's shard is found at
resume and the run continues from the previous checkpoint on the curve of a run that never saw
the corruption."""
import json
import os
import shutil

import numpy as np
import pytest
from helpers.parallel_common import TINY_MODEL

from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import DCPError, LocalChunk, WantedChunk
from ms_llm.checkpoint.verify import guard_save_dir, metadata_problem
from ms_llm.cli.checkpoint import main as verify_main
from ms_llm.config import load_config
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
TINY = TINY_MODEL + ["--training.micro_batch_size", "4", "--training.global_batch_size", "4",
                     "--training.progress_bar", "false", "--training.lr_warmup_steps", "2",
                     "--training.lr", "3e-3", "--training.log_interval", "1",
                     "--training.jit", "false"]
W = np.arange(24, dtype=np.float32).reshape(6, 4)


def _save(d, step, w=W, state=None):
    return dcp.save_checkpoint(d, step, {"w": LocalChunk(w, w.shape)},
                               state or {"step": step}, rank=0, world_size=1,
                               barrier=lambda: None)


def flip_last_mantissa_byte(path):
    """Change one float32 of the file's last tensor by one ulp-ish amount: still finite."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def shard(path):
    return os.path.join(path, "rank_00000.safetensors")


def test_crc_verified_on_load_and_discovery_falls_back(tmp_path):
    d = str(tmp_path)
    for s in (1, 2):
        _save(d, s, W + s)
    flip_last_mantissa_byte(shard(os.path.join(d, "iter_0000002")))
    wanted = {"w": WantedChunk(W.shape, (0, 0), W.shape)}
    with pytest.raises(DCPError, match=r"crc32 differs .*corrupt"):
        dcp.load_checkpoint(os.path.join(d, "iter_0000002"), wanted)
    msgs = []
    assert dcp.resolve_resume("auto", d, report=msgs.append) == os.path.join(d, "iter_0000001")
    assert len(msgs) == 1 and "iter_0000002" in msgs[0] and "crc32" in msgs[0] \
        and "falling back to" in msgs[0]
    arrays, _ = dcp.load_checkpoint(os.path.join(d, "iter_0000001"), wanted)
    np.testing.assert_array_equal(arrays["w"], W + 1)


@pytest.mark.parametrize("garbage,why", [
    (b"\x00\xff garbage", "unreadable|invalid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"format": "ms_llm.dcp", "step": 2, "files": [], "tensors": {}, "state": {}}',
     "must be JSON objects"),
    (b'{"format": "ms_llm.dcp", "step": "2", "files": {}, "tensors": {}, "state": {}}',
     "'step' must be"),
    (b'{"format": "other"}', "not an ms_llm.dcp checkpoint"),
])
def test_garbage_metadata_is_skipped_with_a_reason(tmp_path, garbage, why):
    d = str(tmp_path)
    _save(d, 1)
    _save(d, 2)
    with open(os.path.join(d, "iter_0000002", "metadata.json"), "wb") as f:
        f.write(garbage)
    msgs = []
    assert dcp.find_latest_complete(d, report=msgs.append) == os.path.join(d, "iter_0000001")
    assert len(msgs) == 1
    import re
    assert re.search(why, msgs[0]), msgs[0]


def test_metadata_structure_checks():
    ok = {"format": "ms_llm.dcp", "step": 1, "files": {"a.safetensors": {"size": 8, "crc32": 1}},
          "tensors": {"w": {"dtype": "float32", "global_shape": [2],
                            "chunks": [{"file": "a.safetensors", "key": "w", "offsets": [0],
                                        "sizes": [2]}]}}, "state": {}}
    assert metadata_problem(ok, "m") is None
    bad = json.loads(json.dumps(ok))
    bad["tensors"]["w"]["chunks"][0]["sizes"] = [3]
    assert "outside its global shape" in metadata_problem(bad, "m")
    bad = json.loads(json.dumps(ok))
    bad["files"] = {"../x": {"size": 1, "crc32": 0}}
    assert "plain file name" in metadata_problem(bad, "m")
    bad = json.loads(json.dumps(ok))
    bad["tensors"]["w"]["chunks"][0]["file"] = "other"
    assert "names no listed file" in metadata_problem(bad, "m")
    for state, key in (({"data": {"consumed_samples": -16}}, "state.data.consumed_samples"),
                       ({"step": 1.5}, "state.step"), ({"optimizer_step": "2"},
                                                        "state.optimizer_step"),
                       ({"skipped_steps": True}, "state.skipped_steps")):
        assert f"m: {key} must be a non-negative integer" in \
            metadata_problem(dict(ok, state=state), "m")
    assert "state.data must be an object" in metadata_problem(dict(ok, state={"data": 3}), "m")


def test_guard_refuses_a_folder_of_broken_checkpoints_and_foreign_ones(tmp_path):
    d = str(tmp_path / "a")
    _save(d, 1)
    flip_last_mantissa_byte(shard(os.path.join(d, "iter_0000001")))
    os.truncate(shard(os.path.join(d, "iter_0000001")), 100)
    with pytest.raises(DCPError, match="do not verify and none to resume from"):
        guard_save_dir(d, None, {}, print)
    e = str(tmp_path / "b")
    _save(e, 1, state={"step": 1, "model_config": {"hidden_size": 64, "num_layers": 2}})
    guard_save_dir(e, None, {"hidden_size": 64, "num_layers": 2}, print)   # same model: fine
    with pytest.raises(DCPError, match=r"another model \(model.num_layers 2 there, 4 in this"):
        guard_save_dir(e, None, {"hidden_size": 64, "num_layers": 4}, print)


def test_checkpoint_verify_command(tmp_path, capsys):
    d = str(tmp_path)
    _save(d, 1)
    _save(d, 2)
    assert verify_main(["verify", d]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.endswith(": ok") for line in out)
    flip_last_mantissa_byte(shard(os.path.join(d, "iter_0000002")))
    assert verify_main(["verify", os.path.join(d, "iter_0000002"), "--size-only"]) == 0
    assert verify_main(["verify", d]) == 1
    out = capsys.readouterr().out
    assert "iter_0000002: FAILED: " in out and "crc32 differs" in out
    assert verify_main(["verify", str(tmp_path / "nothing")]) == 2
    assert verify_main(["verify", str(tmp_path / "iter_0000001" / "..")]) == 1


def _cfg(tmp_path, name, *extra):
    return load_config(CONFIG, TINY + ["--training.output_dir", str(tmp_path / name), *extra])


def test_corrupt_shard_of_newest_checkpoint_resumes_from_previous_on_the_same_curve(tmp_path,
                                                                                   capsys):
    """Acceptance: steps 1-2-3 saved every step; one finite byte of the step-3 shard flipped;
    resume finds it, says so, continues from step 2, and steps 3-4 match an uninterrupted run."""
    from ms_llm.training.trainer import Trainer
    full = Trainer(_cfg(tmp_path, "full", "--training.max_steps", "4")).fit()
    save = str(tmp_path / "ckpt")
    Trainer(_cfg(tmp_path, "a", "--training.max_steps", "3", "--checkpoint.save_dir", save,
                 "--checkpoint.save_interval", "1")).fit()
    newest = os.path.join(save, "iter_0000003")
    flip_last_mantissa_byte(shard(newest))
    capsys.readouterr()
    resumed = Trainer(_cfg(tmp_path, "b", "--training.max_steps", "4",
                           "--checkpoint.save_dir", save, "--training.resume", "auto"))
    out = capsys.readouterr().out
    assert "iter_0000003" in out and "crc32 differs" in out and "falling back to" in out, out
    assert "resumed from" in out and "iter_0000002 at step 2" in out, out
    assert resumed.step == 2
    kept = [n for n in os.listdir(save) if n.startswith(".unverified_iter_0000003")]
    assert len(kept) == 1, os.listdir(save)   # the corrupt one is kept aside, not overwritten
    rest = resumed.fit()
    # same process, same kernels and data order: the continued curve is the uninterrupted one
    np.testing.assert_allclose([r["loss"] for r in rest], [r["loss"] for r in full[2:]],
                               rtol=1e-6)
    assert dcp.find_latest_complete(save).endswith("iter_0000004")


def _torch_dist(path, alias=False):
    from ms_llm.checkpoint.torch_dist.io import TorchDistWriter
    w = TorchDistWriter(str(path))
    w.add("w", W.shape, (0, 0), W[:3])
    w.add("w", W.shape, (3, 0), W[3:])
    if alias:   # the second chunk's bytes declared at the first one's
        c0, c1 = w.entries["w"].chunks
        c1.byte_offset = c0.byte_offset
    w.close({"iteration": 1})
    return str(path)


def test_torch_dist_folders_are_checked_for_byte_ranges(tmp_path, capsys):
    """Megatron-Core torch_dist records no checksum: its reader and ``ms-llm checkpoint
    verify`` check the chunks' byte ranges (inside the file, not aliasing) and coverage."""
    from ms_llm.checkpoint.torch_dist.io import TorchDistReader
    good = _torch_dist(tmp_path / "good")
    np.testing.assert_array_equal(TorchDistReader(good).tensor("w"), W)
    assert verify_main(["verify", good]) == 0
    assert "ok (torch_dist format" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"bytes \[\d+, \d+\) overlap"):
        TorchDistReader(_torch_dist(tmp_path / "alias", alias=True))
    # a Megatron save folder: every iter_* folder verified as torch_dist
    save = tmp_path / "save"
    first, second = _torch_dist(save / "iter_0000001"), _torch_dist(save / "iter_0000002")
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    assert verify_main(["verify", str(save)]) == 0
    assert capsys.readouterr().out.count("ok (torch_dist format") == 2
    distcp = os.path.join(second, "__0_0.distcp")
    os.truncate(distcp, os.path.getsize(distcp) - 10)
    assert verify_main(["verify", str(save)]) == 1
    out = capsys.readouterr().out
    assert f"{first}: ok" in out and f"{second}: FAILED: " in out
    assert verify_main(["verify", second]) == 1
    assert "FAILED: " in capsys.readouterr().out


def _megatron_run(tmp_path, fmt, name, steps, *extra):
    from ms_llm.training.trainer import Trainer
    return Trainer(_cfg(tmp_path, name, "--training.max_steps", str(steps),
                        "--checkpoint.save_dir", str(tmp_path / fmt), "--checkpoint.format", fmt,
                        "--checkpoint.save_interval", "1", *extra))


def _newest_file(save, fmt):
    it = os.path.join(save, "iter_0000002")
    return os.path.join(it, "mp_rank_00", "model_optim_rng.pt") if fmt == "torch" else \
        os.path.join(it, "__0_0.distcp")


@pytest.mark.parametrize("fmt,damage", [("torch", "truncate"), ("torch_dist", "flip")])
def test_megatron_format_newest_checkpoint_broken_falls_back_to_the_previous(tmp_path, capsys,
                                                                          fmt, damage):
    """``checkpoint.format torch`` / ``torch_dist``: a truncated or byte-flipped newest save is
    found at resume (zip CRC-32, ``.metadata`` ranges), said in one line, kept aside as
    ``.unverified_iter_*``, and the run continues from the previous iteration, as the native
    format does; a folder holding only broken saves is refused, not written over."""
    _megatron_run(tmp_path, fmt, "a", 2).fit()
    save = str(tmp_path / fmt)
    target = _newest_file(save, fmt)
    if damage == "truncate":
        os.truncate(target, os.path.getsize(target) // 2)
    else:
        with open(target, "r+b") as f:   # a byte in the middle of a tensor's bytes
            f.seek(os.path.getsize(target) // 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
    assert verify_main(["verify", save]) == 1
    capsys.readouterr()
    resumed = _megatron_run(tmp_path, fmt, "b", 3, "--training.resume", "auto")
    out = capsys.readouterr().out
    assert "iter_0000002" in out and "falling back to" in out and \
        ("CRC-32" in out or "truncated" in out), out
    assert resumed.step == 1
    assert len([n for n in os.listdir(save) if n.startswith(".unverified_iter_0000002")]) == 1
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "1"
    resumed.fit()
    assert verify_main(["verify", save]) == 0
    for it in ("iter_0000002", "iter_0000003"):   # only a broken save left: refused
        shutil.rmtree(os.path.join(save, it))
    os.truncate(_newest_file(save, fmt).replace("iter_0000002", "iter_0000001"), 100)
    with pytest.raises(DCPError, match="do not verify and none to resume from"):
        _megatron_run(tmp_path, fmt, "c", 3, "--training.resume", "auto")


def test_a_tampered_megatron_sample_count_is_refused_naming_the_key(tmp_path):
    """A Megatron checkpoint's ``args.consumed_train_samples`` (or iteration) below zero would
    resume the data order from a negative position: refused naming the file and key."""
    from ms_llm.checkpoint.torch_dist.train import write_training_dcp
    with pytest.raises(ValueError, match=r"src.pt: args.consumed_train_samples must be a "
                                         r"non-negative integer, got -16"):
        write_training_dcp(str(tmp_path), {}, {}, 2, None, -16, {}, False, 4, "src.pt")
    with pytest.raises(ValueError, match=r"src.pt: iteration must be"):
        write_training_dcp(str(tmp_path), {}, {}, -1, None, None, {}, False, 4, "src.pt")
    assert not os.listdir(tmp_path)


def test_a_failed_megatron_format_save_leaves_no_iteration_folder(tmp_path, monkeypatch):
    """``checkpoint.format torch``: the save is written under ``.tmp_iter_*`` and renamed when
    whole, so a save that fails midway leaves neither an ``iter_*`` folder nor the temporary."""
    from ms_llm.checkpoint.megatron import train as legacy
    src = _save(str(tmp_path / "native"), 3, state={"step": 3})

    def disk_full(*_a, **_k):
        raise OSError("No space left on device")
    monkeypatch.setattr(legacy, "read_training_dcp", lambda _p: (
        {"decoder.final_layernorm.weight": W[0]},
        {"exp_avg.decoder.final_layernorm.weight": W[0],
         "exp_avg_sq.decoder.final_layernorm.weight": W[0], "step": np.int64(3)}, {}, 3))
    monkeypatch.setattr(legacy.torch_pickle, "save", disk_full)
    out = tmp_path / "torch"
    out.mkdir()
    with pytest.raises(OSError, match="No space left"):
        legacy.export_legacy(src, str(out), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.0, global_batch_size=4)
    assert os.listdir(out) == []
