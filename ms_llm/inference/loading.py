"""What a generation run needs from a model folder: the model, its tokenizer, its EOS ids and its
context length, for the three kinds of folder the suite produces.

Why a training checkpoint goes through an HF export: the distributed checkpoint stores pieces
of every parameter under any tp / ep / fsdp layout; ``dcp_export.export_hf`` already assembles
them (and is tested for every layout), so loading one is an export to a temporary folder followed
by the ordinary HF load. It has no tokenizer of its own: ``--tokenizer`` names one.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import List, Optional

from ms_llm.checkpoint.native.discovery import find_latest_complete
from ms_llm.checkpoint.native.format import METADATA
from ms_llm.data.tokenizer import Tokenizer, load_tokenizer


def training_checkpoint(path: str) -> Optional[str]:
    """The ``iter_*`` directory to load if ``path`` is a training checkpoint (an ``iter_*``
    directory or a ``checkpoint.save_dir``), else None."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        return find_latest_complete(path, report=lambda _msg: None)  # a Megatron folder is quiet
    except (OSError, ValueError):
        return None


def load_model(path: str, dtype: Optional[str] = None):
    """GPTModel from an HF folder, a Megatron folder or a training checkpoint."""
    from ms_llm.checkpoint import from_pretrained
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder")
    ckpt = training_checkpoint(path)
    if ckpt is None:
        return from_pretrained(path, dtype=dtype)
    from ms_llm.checkpoint.native.export import export_hf
    with tempfile.TemporaryDirectory(prefix="ms_llm_generate_") as tmp:
        out = export_hf(ckpt, os.path.join(tmp, "hf"))
        return from_pretrained(out, dtype=dtype)


def load_tokenizer_for(path: str, tokenizer: Optional[str] = None) -> Tokenizer:
    """``tokenizer`` (a file, a folder, or ``embedded`` for the default corpus tokenizer), else
    the model folder's own ``tokenizer.json`` / ``tokenizer.model``."""
    if tokenizer == "embedded":
        from ms_llm.data import ensure_default_corpus
        tokenizer = ensure_default_corpus()[1]
    try:
        return load_tokenizer(tokenizer or path)
    except FileNotFoundError:
        if tokenizer is None and training_checkpoint(path) is not None:
            raise FileNotFoundError(f"{path} is a training checkpoint, which holds no "
                                    f"tokenizer: pass --tokenizer") from None
        raise


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(path: str, tokenizer: Tokenizer) -> List[int]:
    """The ids that end a reply: ``generation_config.json``'s (else ``config.json``'s)
    ``eos_token_id`` plus the tokenizer's EOS (the chat templates' end-of-turn token)."""
    ids: List[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _json(os.path.join(path, name)).get("eos_token_id")
        if value is not None:
            ids = [int(v) for v in (value if isinstance(value, list) else [value])]
            break
    if tokenizer.eod not in ids:
        ids.append(int(tokenizer.eod))
    return ids


def encode_prompt(tokenizer: Tokenizer, text: str) -> List[int]:
    """A plain prompt as HF's ``tokenizer(text)`` encodes it: with the special tokens the
    ``tokenizer.json`` post-processor adds (Llama 3's BOS); sentencepiece models as is."""
    if tokenizer.path.endswith(".json"):
        from tokenizers import Tokenizer as HFTokenizer
        return list(HFTokenizer.from_file(tokenizer.path).encode(text,
                                                                 add_special_tokens=True).ids)
    return tokenizer.encode(text)
