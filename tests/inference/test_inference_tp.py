"""Tensor-parallel inference under msrun: tp=2 produces the tokens tp=1 produces (greedy with
the cache, greedy recomputed, and seeded sampling), for left-padded prompts of a GQA model with
QK-norm (one KV group per rank) and one with QKV bias."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import hf_fixtures
from helpers.msrun import run_msrun, worker_logs
from ms_llm.inference import generate
from ms_llm.checkpoint import from_pretrained

PROMPTS = [[5, 9, 11, 2, 7, 30], [40, 3], [17, 17, 60, 1]]


@pytest.mark.msrun
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tp2_generates_the_tp1_tokens(tmp_path, family):
    folder = tmp_path / "hf"
    hf_fixtures.make_hf_checkpoint(folder, family, hidden=64, ffn=96, heads=4, kv_heads=2,
                                   vocab=128, seed=6)
    out = tmp_path / "tokens.json"
    r = run_msrun("generate_tp.py", 2, str(tmp_path / "logs"),
                  [str(out), str(folder), json.dumps(PROMPTS)], timeout=600)
    assert r.returncode == 0, "\n".join(log[-3000:] for log in worker_logs(str(tmp_path / "logs"), 2))
    got = json.loads(out.read_text())
    model = from_pretrained(str(folder))
    want = generate(model, PROMPTS, 8, pad_token_id=0)
    np.testing.assert_array_equal(got["greedy"], want)
    np.testing.assert_array_equal(got["recompute"], want)
    np.testing.assert_array_equal(
        got["sampled"], generate(model, PROMPTS, 8, do_sample=True, temperature=1.2, top_k=20,
                                 top_p=0.9, seed=5, pad_token_id=0))
