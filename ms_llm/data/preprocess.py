"""``ms-llm preprocess``: raw corpora / instruction sets -> Megatron ``.bin``/``.idx`` files.

Why: users coming from MindSpeed-LLM run ``preprocess_data.py`` with familiar flags and feed the
output to either lane. This CLI takes those flags and writes the same files:

* ``GeneralPretrainHandler``: ``<prefix>_<json-key>_document.bin/.idx`` (uint16 ids when the
  vocabulary has < 65500 entries, else int32; Megatron's rule).
* instruction handlers: ``<prefix>_packed_{input_ids,attention_mask,labels}_document`` (int32,
  labels -100 where the loss is off). With ``--pack`` each row is ``--seq-length`` long, several
  samples bin-packed together, padded with the pad id / -100, and ``attention_mask`` holds the
  1-based sample number of each token (0 on padding) so the loader can rebuild per-sample
  causal masks and position ids ("neat packing").
* pairwise handlers: ``<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document``.

Streaming: input is read line by line (JSON arrays incrementally), at most ``4 * workers`` chunks
are in flight, and results are written in input order as they arrive, so memory does not grow
with input size. Outputs are written under temporary names and renamed together at the end: a
failed or interrupted run leaves no file that looks complete.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .handlers import HANDLERS, IGNORE_INDEX, BadSample, build_handler
from .input_records import (SUPPORTED_EXT, PreprocessError, Record,  # noqa: F401 (re-exported)
                            input_files, iter_records)
from .indexed import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from .packing import first_fit_decreasing
from .tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer

MAX_REPORTED_BAD = 20


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ms-llm preprocess", description="Tokenize a corpus into Megatron indexed datasets.")
    p.add_argument("--input", required=True, help="a .jsonl/.json/.txt file or a folder of them")
    p.add_argument("--tokenizer-type", default="PretrainedFromHF", choices=["PretrainedFromHF", "SentencePiece"])
    p.add_argument("--tokenizer-name-or-path", default=None, help="tokenizer folder or file (tokenizer.json / .model)")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model file (Megatron's flag)")
    p.add_argument("--handler-name", default="GeneralPretrainHandler", choices=list(HANDLERS))
    p.add_argument("--json-keys", nargs="+", default=["text"], help="pretraining: fields to tokenize, one output each")
    p.add_argument("--append-eod", action="store_true", help="append the eod id to every pretraining document")
    p.add_argument("--seq-length", type=int, default=None, help="truncate samples to this length; row length with --pack")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=100, help="log progress every N records")
    p.add_argument("--pack", action="store_true", help="bin-pack instruction samples into --seq-length rows")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed records instead of stopping")
    p.add_argument("--map-keys", default=None, help='JSON renaming record fields, e.g. \'{"prompt": "question"}\'')
    p.add_argument("--prompt-type", default=None, help="only 'empty' is accepted; chat formats come from the tokenizer's chat_template")
    p.add_argument("--chunk-size", type=int, default=256, help="records per worker task")
    p.add_argument("--pack-buffer", type=int, default=8192, help="samples bin-packed together (bounded memory)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1 or args.chunk_size < 1 or args.pack_buffer < 1:
        raise PreprocessError("--log-interval, --chunk-size and --pack-buffer must be >= 1")
    if args.seq_length is not None and args.seq_length < 2:
        raise PreprocessError(f"--seq-length must be >= 2, got {args.seq_length}")
    handler_cls = HANDLERS[args.handler_name]
    if args.pack:
        if args.seq_length is None:
            raise PreprocessError("--pack needs --seq-length")
        if not handler_cls.instruction or "Pairwise" in args.handler_name:
            raise PreprocessError(f"--pack applies to the instruction handlers, not {args.handler_name}")
    if args.prompt_type not in (None, "empty"):
        raise PreprocessError(f"--prompt-type {args.prompt_type!r} is not implemented: ms-llm renders conversations "
                              "with the tokenizer's chat_template (tokenizer_config.json); omit the flag")
    if args.tokenizer_name_or_path is None and args.tokenizer_model is None:
        raise PreprocessError("--tokenizer-name-or-path is required")
    if args.map_keys is not None:
        try:
            mk = json.loads(args.map_keys)
        except json.JSONDecodeError as e:
            raise PreprocessError(f"--map-keys is not valid JSON: {e.msg}") from None
        if not isinstance(mk, dict) or not all(isinstance(v, str) for v in mk.values()):
            raise PreprocessError("--map-keys must be a JSON object of strings")
        args.map_keys = mk


def load_tokenizer_for(tokenizer_type: str, path: Optional[str], model: Optional[str] = None) -> Tokenizer:
    """``--tokenizer-type`` semantics: PretrainedFromHF needs ``tokenizer.json``; SentencePiece a ``.model``."""
    path = os.path.expanduser(model or path)
    if tokenizer_type == "PretrainedFromHF":
        f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(f):
            raise PreprocessError(f"--tokenizer-name-or-path: no tokenizer.json at {path}")
        return HFTokenizer(f)
    f = os.path.join(path, "tokenizer.model") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise PreprocessError(f"--tokenizer-name-or-path: no sentencepiece tokenizer.model at {path}")
    return SentencePieceTokenizer(f)


# ---------------------------------------------------------------- worker side

_WORKER: Dict[str, Any] = {}


def _init_worker(cfg: dict) -> None:
    if cfg.get("limit_threads"):  # one tokenizer thread per worker: parallelism comes from --workers
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer_for(cfg["tokenizer_type"], cfg["tokenizer_path"], cfg.get("tokenizer_model"))
    _WORKER["handler"] = build_handler(cfg["handler_name"], tok, json_keys=cfg["json_keys"], append_eod=cfg["append_eod"],
                                       seq_length=cfg["seq_length"], map_keys=cfg["map_keys"])
    _WORKER["text_key"] = cfg["json_keys"][0]


def _process_chunk(chunk: List[Record]) -> Tuple[int, List[Tuple[int, str]], int, Dict[str, Tuple[np.ndarray, np.ndarray]]]:
    """Parse + tokenize a chunk -> (records, [(line, error)], empty count, {key: (flat, lengths)}).

    Results travel as one flat int32 array + lengths per key (not one small array per record):
    pickling per-record arrays made the main process the bottleneck with several workers.
    """
    out = _process_records(chunk)
    errors = [(lineno, r) for lineno, r in out if isinstance(r, str)]
    docs = [r for _, r in out if isinstance(r, dict)]
    packed: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for k in (docs[0] if docs else {}):
        lengths = np.fromiter((len(d[k]) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate([d[k] for d in docs]).astype(np.int32) if lengths.sum() else np.zeros(0, np.int32)
        packed[k] = (flat, lengths)
    return len(chunk), errors, sum(r is None for _, r in out), packed


def _process_records(chunk: List[Record]) -> List[Tuple[int, Any]]:
    """Parse + tokenize records. Each result is a dict of arrays, ``None`` (empty) or an error string."""
    handler = _WORKER["handler"]
    objs, lines, out = [], [], []
    for lineno, kind, payload in chunk:
        if kind == "json":
            try:
                obj = json.loads(payload)
            except json.JSONDecodeError as e:
                out.append((lineno, f"malformed JSON line ({e.msg} at column {e.colno})"))
                continue
            except UnicodeDecodeError:
                out.append((lineno, "line is not valid UTF-8"))
                continue
        elif kind == "text":
            try:
                text = payload.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                out.append((lineno, "line is not valid UTF-8"))
                continue
            if handler.instruction:
                out.append((lineno, f".txt input only works with GeneralPretrainHandler, not {handler.name}"))
                continue
            obj = {_WORKER["text_key"]: text}
        else:
            obj = payload
        objs.append(obj)
        lines.append(lineno)
    for lineno, res in zip(lines, handler.process_batch(objs)):
        out.append((lineno, str(res) if isinstance(res, BadSample) else res))
    out.sort(key=lambda x: x[0])
    return out


# ---------------------------------------------------------------- writer side


class _Writer:
    """Owns the builders; applies --pack; never exposes partial outputs (commit at the end)."""

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer, keys: List[str], instruction: bool):
        self.args = args
        self.tok = tokenizer
        self.keys = keys
        self.instruction = instruction
        dtype = np.int32 if instruction else optimal_dtype(tokenizer.vocab_size)
        self.prefixes = {k: f"{args.output_prefix}_{'packed_' if instruction else ''}{k}_document" for k in keys}
        self.builders: Dict[str, IndexedDatasetBuilder] = {}
        for k in keys:
            self.builders[k] = IndexedDatasetBuilder(bin_path(self.prefixes[k]), dtype)
        self.pack_buf: List[dict] = []
        self.stats = collections.Counter()

    def add_bulk(self, packed: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
        """Write one chunk's records (flat arrays + lengths per key), in input order."""
        if not packed:
            return
        if self.args.pack:
            splits = {k: np.split(flat, np.cumsum(lengths)[:-1]) for k, (flat, lengths) in packed.items()}
            for i in range(len(packed[self.keys[0]][1])):
                self.pack_buf.append({k: v[i] for k, v in splits.items()})
                if len(self.pack_buf) >= self.args.pack_buffer:
                    self.flush_pack()
            return
        for k in self.keys:
            self.builders[k].add_items(*packed[k])
        nonempty = np.zeros(len(packed[self.keys[0]][1]), dtype=bool)
        for k in self.keys:
            nonempty |= packed[k][1] > 0
        self.stats["documents"] += int(nonempty.sum())
        self.stats["tokens"] += int(packed[self.keys[0]][1].sum())

    def flush_pack(self) -> None:
        if not self.pack_buf:
            return
        s = self.args.seq_length
        bins = first_fit_decreasing([len(x["input_ids"]) for x in self.pack_buf], s)
        for b in bins:
            ids = np.full(s, self.tok.pad, dtype=np.int64)
            labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
            seg = np.zeros(s, dtype=np.int64)
            pos = 0
            for j, i in enumerate(b, 1):
                x = self.pack_buf[i]
                n = len(x["input_ids"])
                ids[pos:pos + n], labels[pos:pos + n], seg[pos:pos + n] = x["input_ids"], x["labels"], j
                pos += n
            for k, arr in (("input_ids", ids), ("attention_mask", seg), ("labels", labels)):
                self.builders[k].add_item(arr)
                self.builders[k].end_document()
            self.stats["documents"] += 1
            self.stats["packed_samples"] += len(b)
            self.stats["tokens"] += pos
        self.pack_buf.clear()

    def finish(self) -> None:
        self.flush_pack()
        for k in self.keys:
            self.builders[k].finalize(idx_path(self.prefixes[k]), commit=False)
        for k in self.keys:
            self.builders[k].commit()

    def abort(self) -> None:
        for b in self.builders.values():
            b.abort()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_preprocess(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the whole pipeline; returns statistics. Raises ``PreprocessError`` on bad input."""
    _check_args(args)
    files = input_files(args.input)
    tok = load_tokenizer_for(args.tokenizer_type, args.tokenizer_name_or_path, args.tokenizer_model)
    handler = build_handler(args.handler_name, tok, json_keys=args.json_keys, append_eod=args.append_eod,
                            seq_length=args.seq_length, map_keys=args.map_keys)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(tokenizer_type=args.tokenizer_type, tokenizer_path=args.tokenizer_name_or_path,
               tokenizer_model=args.tokenizer_model, handler_name=args.handler_name, json_keys=list(args.json_keys),
               append_eod=args.append_eod, seq_length=args.seq_length, map_keys=args.map_keys,
               limit_threads=True)
    total_bytes = sum(os.path.getsize(f) for f in files)
    writer = _Writer(args, tok, handler.output_keys, handler.instruction)  # opens temp files: the try below owns them
    pool = None
    bar = None
    saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
    t0 = time.time()
    try:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=not sys.stderr.isatty())
        except ImportError:  # pragma: no cover
            bar = None
        if args.workers > 1:
            ctx = mp.get_context("spawn" if "mindspore" in sys.modules else "fork")
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(cfg,))
        else:
            _init_worker(dict(cfg, limit_threads=False))
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # restored below; measured faster than 2 rayon threads
        state = {"records": 0, "bytes": 0, "next_log": args.log_interval}

        def consume(path: str, result, nbytes: int) -> None:
            n_records, errors, n_empty, packed = result
            for lineno, msg in errors:
                if not args.skip_bad_lines:
                    raise PreprocessError(f"{path}:{lineno}: {msg}")
                writer.stats["bad_lines"] += 1
                if writer.stats["bad_lines"] <= MAX_REPORTED_BAD:
                    _log(f"skipping {path}:{lineno}: {msg}")
            writer.stats["empty"] += n_empty
            writer.add_bulk(packed)
            state["records"] += n_records
            state["bytes"] += nbytes
            if bar is not None:
                bar.update(nbytes)
            if state["records"] >= state["next_log"]:
                el = max(time.time() - t0, 1e-9)
                _log(f"Processed {state['records']} records ({state['records'] / el:.1f} records/s, "
                     f"{state['bytes'] / el / 1e6:.2f} MB/s).")
                while state["next_log"] <= state["records"]:
                    state["next_log"] += args.log_interval

        inflight: collections.deque = collections.deque()
        max_inflight = 4 * args.workers
        for path in files:
            chunk: List[Record] = []
            nbytes = 0
            for rec, n in iter_records(path):
                nbytes += n
                if rec is not None:
                    chunk.append(rec)
                if len(chunk) >= args.chunk_size:
                    if pool is None:
                        consume(path, _process_chunk(chunk), nbytes)
                    else:
                        inflight.append((path, pool.apply_async(_process_chunk, (chunk,)), nbytes))
                        while len(inflight) >= max_inflight:
                            p, r, nb = inflight.popleft()
                            consume(p, r.get(), nb)
                    chunk, nbytes = [], 0
            if chunk or nbytes:
                if pool is None:
                    consume(path, _process_chunk(chunk), nbytes)
                else:
                    inflight.append((path, pool.apply_async(_process_chunk, (chunk,)), nbytes))
        while inflight:
            p, r, nb = inflight.popleft()
            consume(p, r.get(), nb)
        writer.finish()
    except BaseException:
        writer.abort()
        if pool is not None:
            pool.terminate()
            pool = None
        raise
    finally:
        if pool is None and args.workers == 1:
            if saved_env is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved_env
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    elapsed = time.time() - t0
    stats = dict(writer.stats)
    stats.update(records=state["records"], bytes=total_bytes, seconds=elapsed, outputs=list(writer.prefixes.values()))
    return stats


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry; exit code 0 on success, 1 on bad input/flags (one-line message), 2 on usage errors."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        stats = run_preprocess(args)
    except (PreprocessError, OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"ms-llm preprocess: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ms-llm preprocess: interrupted; no output written", file=sys.stderr)
        return 130
    tok_s = stats.get("tokens", 0) / max(stats["seconds"], 1e-9)
    extra = f", {stats['packed_samples']} samples packed" if "packed_samples" in stats else ""
    _log(f"done: {stats['records']} records -> {stats.get('documents', 0)} documents{extra}, {stats.get('tokens', 0)} tokens "
         f"({tok_s:,.0f} tokens/s), {stats.get('bad_lines', 0)} bad lines skipped, {stats.get('empty', 0)} empty; "
         f"wrote {', '.join(p + '.{bin,idx}' for p in stats['outputs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
