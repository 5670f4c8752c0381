"""``ms-llm preprocess`` throughput and peak memory against the tokenizer's raw encode speed.

    python -m benchmarks.preprocess              # 200 MB jsonl (generated in a temp dir)
    python -m benchmarks.preprocess --mb 20      # quick run

Setup (not timed): a jsonl of ``--mb`` MB is generated from the embedded stdlib-docs corpus
(documents shuffled and cut at random points so the text is not one repeated block), and a
byte-level BPE ``tokenizer.json`` (16k vocab) is trained on that corpus.

Rows, each in a fresh child process (peak RSS = the child's own ``VmHWM``; for 2 workers the
largest pool worker's peak is shown too):

* ``raw encode_batch``: JSON already parsed outside the timer, only ``Tokenizer.encode_batch``
  on 256-document batches timed (the Rust tokenizer may use both cores);
* ``raw encode_batch 1 thread``: the same with ``TOKENIZERS_PARALLELISM=false``;
  the ceiling is the faster of these two rows (on a shared 2-vCPU box, often the 1-thread one);
* ``preprocess w=1`` / ``w=2``: the full CLI (read, parse JSON, tokenize, append eod, write
  ``.bin/.idx``), ``--workers 1`` and ``2``;
* ``preprocess w=1 (1/4 input)``: same at a quarter of the size -- peak memory should not change
  (streaming), time should scale.

tokens/s counts tokens incl. eod; "ratio" = row tokens/s / ceiling tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import module_env

_HWM = """
def _hwm(pid='self'):
    for line in open(f'/proc/{pid}/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) / 1024
"""

RAW = _HWM + """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
n_tok = 0; secs = 0.0; batch = []
def run(batch):
    global n_tok, secs
    t = time.perf_counter()
    enc = tok.encode_batch(batch, add_special_tokens=False)
    secs += time.perf_counter() - t
    n_tok += sum(len(e.ids) for e in enc) + len(batch)  # + eod, as preprocess --append-eod
with open(sys.argv[2], encoding='utf-8') as fh:
    for line in fh:
        batch.append(json.loads(line)['text'])
        if len(batch) == 256:
            run(batch); batch = []
if batch: run(batch)
print(json.dumps({'seconds': secs, 'tokens': n_tok, 'rss': _hwm(), 'worker_rss': 0}))
"""

PRE = _HWM + """
import json, os, sys, threading, time
from ms_llm.data.preprocess import build_parser, run_preprocess
peak = {}
def watch():  # sample pool workers' VmHWM while they live
    me = os.getpid()
    while True:
        for pid in os.listdir('/proc'):
            if pid.isdigit() and int(pid) != me:
                try:
                    if int(open(f'/proc/{pid}/stat').read().split()[3]) == me:
                        peak[pid] = max(peak.get(pid, 0), _hwm(pid))
                except (OSError, IndexError, ValueError):
                    pass
        time.sleep(0.5)
threading.Thread(target=watch, daemon=True).start()
args = build_parser().parse_args(sys.argv[1:])
stats = run_preprocess(args)
print(json.dumps({'seconds': stats['seconds'], 'tokens': stats['tokens'], 'rss': _hwm(),
                  'worker_rss': max(peak.values(), default=0)}))
"""


def child(code: str, args, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=module_env(dict(os.environ, **(env or {}))))
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_inputs(work: str, mb: float) -> tuple:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ms_llm.data import ensure_default_corpus, read_documents

    corpus, _ = ensure_default_corpus()
    docs = list(read_documents(corpus))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16384, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok_dir = os.path.join(work, "tok")
    os.makedirs(tok_dir)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))

    rng = random.Random(0)
    paths = {}
    for name, target in (("full", mb * 1e6), ("quarter", mb * 1e6 / 4)):
        path = os.path.join(work, f"{name}.jsonl")
        size = 0
        with open(path, "w", encoding="utf-8") as fh:
            while size < target:
                rng.shuffle(docs)
                for d in docs:
                    cut = rng.randrange(len(d) // 2 + 1)
                    line = json.dumps({"text": d[cut:] + "\n" + d[:cut], "id": size}) + "\n"
                    fh.write(line)
                    size += len(line.encode("utf-8"))
                    if size >= target:
                        break
        paths[name] = path
    return tok_dir, paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--keep", default=None, help="work dir to keep (default: a temp dir, deleted)")
    a = ap.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    try:
        t = time.time()
        tok_dir, paths = make_inputs(work, a.mb)
        print(f"setup: {os.path.getsize(paths['full']) / 1e6:.0f} MB jsonl + tokenizer in {time.time() - t:.0f} s "
              f"({os.cpu_count()} CPUs)", flush=True)
        tok_json = os.path.join(tok_dir, "tokenizer.json")
        rows = []
        rows.append(("raw encode_batch", child(RAW, [tok_json, paths["full"]])))
        rows.append(("raw encode_batch 1 thread", child(RAW, [tok_json, paths["full"]], {"TOKENIZERS_PARALLELISM": "false"})))
        for w in (1, 2):
            rows.append((f"preprocess w={w}", child(PRE, ["--input", paths["full"], "--tokenizer-name-or-path", tok_dir,
                                                    "--output-prefix", os.path.join(work, f"out{w}"), "--append-eod",
                                                    "--workers", w, "--log-interval", 10**9])))
        rows.append(("preprocess w=1 (1/4 input)", child(PRE, ["--input", paths["quarter"], "--tokenizer-name-or-path",
                                                          tok_dir, "--output-prefix", os.path.join(work, "outq"),
                                                          "--append-eod", "--log-interval", 10**9])))
        ceiling = max(r["tokens"] / r["seconds"] for _, r in rows[:2])  # the faster raw row
        print(f"\n| row | seconds | tokens | tokens/s | ratio to ceiling | peak RSS MB | worker peak RSS MB |")
        print("|---|---|---|---|---|---|---|")
        for name, r in rows:
            tps = r["tokens"] / r["seconds"]
            print(f"| {name} | {r['seconds']:.1f} | {r['tokens']:,} | {tps:,.0f} | {tps / ceiling:.2f} | {r['rss']:.0f} | "
                  f"{r['worker_rss']:.0f} |")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
