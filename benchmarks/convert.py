"""Checkpoint conversion throughput and peak memory against a read+write floor.

    python -m benchmarks.convert                       # ~530 MB fp32 Llama-shaped model
    python -m benchmarks.convert --layers 2 --keep /tmp/bench_convert

Generates a Hugging Face checkpoint (2 safetensors shards) once, then times, each in a fresh
child process (so its peak RSS is its own, read with ``os.wait4``):

* ``floor``: read every byte of the source files and write the same bytes to new files (64 MiB
  chunks) -- the I/O a conversion cannot avoid;
* ``hf->mg tp2 pp2``, ``mg->mg tp1 pp1``, ``mg->hf``: ``ms-llm convert`` runs.

MB/s is checkpoint bytes / wall seconds. "RSS over start" subtracts the RSS of a child that only
imports the converter (reported as ``import only``), and is compared with the largest layer's
bytes: streaming keeps it a small multiple of one layer, not the whole checkpoint. The page cache
is warm for every row (the floor row runs first, after generation).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import ROOT


_HWM = """
for _line in open('/proc/self/status'):
    if _line.startswith('VmHWM:'):
        print('VMHWM_KB', _line.split()[1])
"""


def child(code: str):
    """Run ``code`` in a fresh interpreter; return (seconds, peak RSS MB). The peak is the
    child's own ``VmHWM`` (``ru_maxrss`` would include the parent's RSS at fork time)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code + _HWM], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": ROOT})
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"benchmark step failed: {p.stderr.strip()[-300:]}")
    kb = [int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("VMHWM_KB")]
    return dt, kb[-1] / 1024.0


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--keep", default=None, help="work folder to keep (default: temporary)")
    args = ap.parse_args()

    work = args.keep or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(work, exist_ok=True)
    hf = os.path.join(work, "hf")
    try:
        if not os.path.isdir(hf):
            # in a child, so this process stays small
            child("from tests.helpers.hf_fixtures import make_hf_checkpoint\n"
                  f"make_hf_checkpoint({hf!r}, 'llama', hidden={args.hidden}, "
                  f"layers={args.layers}, heads=16, kv_heads=4, ffn={args.ffn}, "
                  f"vocab={args.vocab}, tied=False, shards=2, seed=0)\n")
        size = folder_bytes(hf)
        H, F, V = args.hidden, args.ffn, args.vocab
        layer_bytes = 4 * (H * H + 2 * H * H // 4 + H * H + 3 * H * F + 2 * H)
        emb_bytes = 4 * V * H
        for d in ("floor", "mg", "mg1", "hf_back"):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)

        rows = []
        t, rss0 = child("import ms_llm.checkpoint.convert, numpy")
        rows.append(("import only", t, None, rss0))
        floor = f"""
import os
src, dst = {hf!r}, {os.path.join(work, 'floor')!r}
os.makedirs(dst)
for n in sorted(os.listdir(src)):
    with open(os.path.join(src, n), 'rb') as fi, open(os.path.join(dst, n), 'wb') as fo:
        while True:
            b = fi.read(1 << 26)
            if not b:
                break
            fo.write(b)
"""
        t, rss = child(floor)
        rows.append(("floor: read + write", t, size / t / 1e6, rss))
        conv = ("from ms_llm.checkpoint.convert import main\n"
                "if main({!r}) != 0:\n    raise SystemExit(2)\n")
        steps = [
            ("hf->mg tp2 pp2", ["--load-model-type", "hf", "--save-model-type", "mg",
                                "--load-dir", hf, "--save-dir", os.path.join(work, "mg"),
                                "--target-tensor-parallel-size", "2",
                                "--target-pipeline-parallel-size", "2"]),
            ("mg->mg tp1 pp1", ["--load-model-type", "mg", "--save-model-type", "mg",
                                "--load-dir", os.path.join(work, "mg"),
                                "--save-dir", os.path.join(work, "mg1")]),
            ("mg->hf", ["--load-model-type", "mg", "--save-model-type", "hf",
                        "--load-dir", os.path.join(work, "mg1"),
                        "--save-dir", os.path.join(work, "hf_back"), "--max-shard-size", "200MB"]),
        ]
        for name, argv in steps:
            t, rss = child(conv.format(argv))
            rows.append((name, t, size / t / 1e6, rss))

        print(f"\ncheckpoint {size / 1e6:.0f} MB (fp32, {args.layers} layers, hidden {H}, "
              f"ffn {F}, vocab {V}); largest layer {layer_bytes / 1e6:.1f} MB, "
              f"embedding / lm_head {emb_bytes / 1e6:.0f} MB each\n")
        print(f"| {'step':<22} | {'seconds':>7} | {'MB/s':>7} | {'vs floor':>8} | "
              f"{'peak RSS MB':>11} | {'RSS over start MB':>17} | {'/ checkpoint':>12} |")
        print(f"|{'-' * 24}|{'-' * 9}|{'-' * 9}|{'-' * 10}|{'-' * 13}|{'-' * 19}|{'-' * 14}|")
        floor_mbs = rows[1][2]
        for name, t, mbs, rss in rows:
            over = rss - rss0
            print(f"| {name:<22} | {t:7.2f} | {mbs if mbs else 0:7.0f} | "
                  f"{(mbs / floor_mbs if mbs else 0):8.2f} | {rss:11.0f} | "
                  f"{over if name != 'import only' else 0:17.0f} | "
                  f"{(over * 1e6 / size if name != 'import only' else 0):12.2f} |")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
