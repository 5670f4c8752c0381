"""Export of MoE training checkpoints (``checkpoint.native.export``) to Hugging Face Qwen3-MoE and
Megatron.

A tiny Qwen3-MoE-shaped GPTModel (8 experts, top-2, 2 layers) is saved through the trainer's own
``training.checkpointing.save`` (so the checkpoint holds what real runs write: ``:gate``/``:up``
halves for dense fc1, grouped ``weight1`` as rows of 2F, the routers' ``expert_bias`` buffer),
exported, and read back.

Independent references written here, not taken from the code under test:

* the HF names/shapes of a Qwen3-MoE checkpoint (``model.layers.{i}.mlp.gate.weight``
  ``[E, H]``, ``mlp.experts.{j}.gate_proj/up_proj`` ``[F, H]``, ``down_proj`` ``[H, F]``,
  dense layers ``mlp.gate_proj`` ...), and where each expert's weights sit in the model's own
  parameters (``linear_fc1 = [gate; up]``; grouped ``weight1`` ``[H, E*2F]`` whose memory
  viewed ``[E, H, 2F]`` holds ``fc1_e.T``, ``weight2`` ``[E*F, H]`` viewed ``[E, F, H]`` holds
  ``fc2_e.T``) -- compared bit for bit;
* a float64 NumPy forward of HF's Qwen3-MoE (tests/helpers/moe_reference.py:
  ``Qwen3MoeSparseMoeBlock``: softmax over all experts, top-k, renormalised iff
  ``norm_topk_prob``; layer i sparse iff i not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``) on the exported files.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from helpers import moe_reference
from helpers.cli import run_ms_llm
from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import DCPError
from ms_llm.checkpoint.native.export import hf_config_from_transformer_config
from ms_llm.checkpoint.hf.io import read_hf_config, read_hf_weights

E, K, H, FFN, F, V = 8, 2, 32, 24, 12, 61
BASE = dict(num_layers=2, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=4,
            num_query_groups=2, kv_channels=8, padded_vocab_size=V, qk_layernorm=True,
            untie_embeddings_and_output_weights=True, rotary_base=1e6,
            max_position_embeddings=32, mlp_type="moe", num_moe_experts=E, moe_router_topk=K,
            moe_ffn_hidden_size=F, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
CASES = {
    # per-expert weights; Megatron moe_layer_freq 2 -> layer 0 sparse, layer 1 dense (the
    # dense layer is stored as :gate/:up halves); top-k of logits then softmax (renormalised)
    "local_experts": dict(BASE, moe_layer_freq=2),
    # grouped GEMM weights, both layers sparse, softmax before top-k (HF norm_topk_prob false)
    "grouped": dict(BASE, moe_grouped_gemm=True, moe_router_pre_softmax=True),
}


def _build(kwargs, seed):
    from ms_llm.compat import load_state_dict, state_dict
    from ms_llm.models import GPTModel
    from ms_llm.models.config import TransformerConfig
    cfg = TransformerConfig(**kwargs)
    model = GPTModel(cfg)
    rng = np.random.default_rng(seed)
    sd = {}
    for k, p in state_dict(model).items():
        shape = tuple(p.shape)
        if k.endswith("expert_bias"):
            sd[k] = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            sd[k] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:   # a larger router scale keeps the top-2 well separated from the 3rd expert
            std = 0.5 if k.endswith("router.weight") else 0.08
            sd[k] = (std * rng.standard_normal(shape)).astype(np.float32)
    load_state_dict(model, sd, strict=True, source="test")
    return cfg, model, sd


def _save(model, cfg, save_dir, step=1):
    """The trainer's path (``Trainer.save``): every named parameter incl. buffers, AdamW, with
    the layouts ``parallelize_model`` records."""
    from ms_llm.parallel.parallelize import describe_layouts
    from ms_llm.parallel.state import initialize_model_parallel
    describe_layouts(model)
    from ms_llm.training import checkpointing as ckpt
    from ms_llm.optim import AdamW
    named = list(model.named_parameters())
    opt = AdamW([(n, p) for n, p in named if p.requires_grad])
    return ckpt.save(save_dir, step, named, opt, initialize_model_parallel(),
                     {"step": step, "model_config": dataclasses.asdict(cfg)},
                     barrier=lambda: None, rank=0, world=1)


def _run(model, ids):
    import mindspore as ms
    from ms_llm.models.moe import MoELayer
    logits = model(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)
    routes = [layer.mlp.last_top_indices.asnumpy() for layer in model.decoder.layers
              if isinstance(layer.mlp, MoELayer)]
    return logits, routes


def _expected_hf(cfg):
    """HF Qwen3-MoE tensor names -> shapes, and the sparse layers (Megatron's rule)."""
    sparse = [cfg.moe_layer_pattern[i] if cfg.moe_layer_pattern else i % cfg.moe_layer_freq == 0
              for i in range(cfg.num_layers)]
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
           "lm_head.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (nh * d, H),
                    p + "self_attn.k_proj.weight": (ng * d, H),
                    p + "self_attn.v_proj.weight": (ng * d, H),
                    p + "self_attn.o_proj.weight": (H, nh * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if sparse[i]:
            out[p + "mlp.gate.weight"] = (E, H)
            for j in range(E):
                q = f"{p}mlp.experts.{j}."
                out.update({q + "gate_proj.weight": (F, H), q + "up_proj.weight": (F, H),
                            q + "down_proj.weight": (H, F)})
        else:
            out.update({p + "mlp.gate_proj.weight": (FFN, H), p + "mlp.up_proj.weight": (FFN, H),
                        p + "mlp.down_proj.weight": (H, FFN)})
    return out, sparse


def _expert_weights(sd, cfg, i, j):
    """Expert j of layer i as (gate [F, H], up [F, H], down [H, F]) from the model's own
    parameters, by the layout rules stated in the module docstring."""
    p = f"decoder.layers.{i}.mlp.experts."
    if cfg.moe_grouped_gemm:
        fc1 = sd[p + "weight1"].reshape(E, H, 2 * F)[j].T       # [2F, H]
        down = sd[p + "weight2"].reshape(E, F, H)[j].T          # [H, F]
    else:
        fc1 = sd[f"{p}local_experts.{j}.linear_fc1.weight"]
        down = sd[f"{p}local_experts.{j}.linear_fc2.weight"]
    return fc1[:F], fc1[F:], down


def qwen3_moe_forward(W, cfg, ids):
    """Float64 HF Qwen3-MoE forward (tests/helpers/moe_reference.py): ``(logits [b, s, V], routes
    per
    sparse layer [T, k])``."""
    logits, routing = moe_reference.qwen3_moe_forward(W, cfg, ids)
    return logits, [routing[i][1] for i in sorted(routing)]


def _same_routes(got, want, what):
    assert len(got) == len(want), what
    for layer, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"{what}: layer {layer} routes differ"


@pytest.mark.parametrize("name", list(CASES))
def test_moe_export_hf_and_megatron_keep_logits_and_routes(tmp_path, name):
    from ms_llm.checkpoint.megatron.io import MegatronReader
    from ms_llm.checkpoint import from_pretrained

    cfg, model, sd = _build(CASES[name], seed=7 + len(name))
    ids = np.random.default_rng(3).integers(0, V, size=(2, 9))
    want, want_routes = _run(model, ids)
    assert len(want_routes) == (1 if name == "local_experts" else 2)
    ck = _save(model, cfg, str(tmp_path / "ck"))

    # --- HF: config.json, names/shapes, expert weights bit for bit --------------------------
    hf_dir = dcp.export_hf(ck, str(tmp_path / "hf"))          # config from model_config
    hc = read_hf_config(hf_dir)
    expected, sparse = _expected_hf(cfg)
    assert (hc["model_type"], hc["num_experts"], hc["num_experts_per_tok"],
            hc["moe_intermediate_size"], hc["intermediate_size"]) == ("qwen3_moe", E, K, F, FFN)
    assert hc["norm_topk_prob"] is (not cfg.moe_router_pre_softmax)
    assert hc["decoder_sparse_step"] == 1
    assert hc["mlp_only_layers"] == [i for i, sp in enumerate(sparse) if not sp]
    w = read_hf_weights(hf_dir)
    assert {k: tuple(v.shape) for k, v in w.items()} == expected
    assert all(v.dtype == np.float32 for v in w.values())
    for i in (i for i, sp in enumerate(sparse) if sp):
        p = f"model.layers.{i}.mlp."
        assert np.array_equal(w[p + "gate.weight"], sd[f"decoder.layers.{i}.mlp.router.weight"])
        for j in range(E):
            gate, up, down = _expert_weights(sd, cfg, i, j)
            assert np.array_equal(w[f"{p}experts.{j}.gate_proj.weight"], gate), (i, j)
            assert np.array_equal(w[f"{p}experts.{j}.up_proj.weight"], up), (i, j)
            assert np.array_equal(w[f"{p}experts.{j}.down_proj.weight"], down), (i, j)
    for i in (i for i, sp in enumerate(sparse) if not sp):
        fc1 = sd[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        assert np.array_equal(w[f"model.layers.{i}.mlp.gate_proj.weight"], fc1[:FFN])
        assert np.array_equal(w[f"model.layers.{i}.mlp.up_proj.weight"], fc1[FFN:])

    # independent float64 HF forward on the exported files: fp32 vs float64 over 2 layers
    # measured 4e-7 on logits of magnitude <= 1.8, so 1e-5 absolute (25x margin; swapping
    # gate/up or two experts' down_proj moves logits by > 0.2 here); routes exact (the router's
    # top-2 / 3rd-expert gaps here are far above fp32 rounding).
    ref_logits, ref_routes = qwen3_moe_forward(w, hc, ids)
    assert np.abs(ref_logits - want).max() < 1e-5
    _same_routes([r.astype(np.int64) for r in want_routes], ref_routes, "float64 HF reference")

    # round trip: the same fp32 weights; the reloaded model uses the per-expert layout even
    # where the original was grouped, so only fp32 summation order can differ (measured: 0
    # per-expert, 2.4e-7 = 2 ulps grouped, logits <= 1.8): 2e-6 absolute (~16 ulps).
    back, back_routes = _run(from_pretrained(hf_dir), ids)
    assert np.abs(back - want).max() < 2e-6
    _same_routes(back_routes, want_routes, "HF reload")

    # --- Megatron legacy layout: tp=1 (expert layout of the checkpoint), tp=2 (+ ep=2) ------
    for tp, ep in ((1, 1), (2, 2 if name == "grouped" else 1)):
        out = str(tmp_path / f"mg_tp{tp}_ep{ep}")
        dcp.export_megatron(ck, out, tp=tp, ep=ep, make_vocab_size_divisible_by=1)
        r = MegatronReader(out)
        try:
            keys = set(r.models[(0, 0, 0)][0])
            assert (r.tp, r.ep) == (tp, ep)
        finally:
            r.close()
        moe_layer = sparse.index(True)
        grouped_key = f"decoder.layers.{moe_layer}.mlp.experts.weight1"
        local_key = f"decoder.layers.{moe_layer}.mlp.experts.local_experts.0.linear_fc1.weight"
        assert (grouped_key in keys, local_key in keys) == (bool(cfg.moe_grouped_gemm),
                                                            not cfg.moe_grouped_gemm)
        assert f"decoder.layers.{moe_layer}.mlp.router.weight" in keys
        got, got_routes = _run(from_pretrained(out), ids)
        assert np.abs(got[..., :V] - want).max() < 2e-6, (tp, ep)   # as the HF reload
        assert np.all(got[..., V:] == 0)                 # zero vocab padding scores exactly 0
        _same_routes(got_routes, want_routes, f"Megatron tp={tp} ep={ep}")


def test_moe_export_refusals_and_expert_bias(tmp_path):
    """What HF Qwen3-MoE cannot express is refused in one line, leaving no output folder; an
    all-zero ``expert_bias`` is dropped, a non-zero one refused."""
    cfg, model, _ = _build(dict(BASE, num_layers=1, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True), seed=1)
    ck = _save(model, cfg, str(tmp_path / "ck"))
    for fn in (dcp.export_hf, dcp.export_megatron):
        with pytest.raises(DCPError, match="cannot express moe_router_score_function 'sigmoid'"):
            fn(ck, str(tmp_path / "refused"))
    plain = cfg.replace(moe_router_score_function="softmax", moe_router_enable_expert_bias=False)
    for bad, match in ((dict(moe_shared_expert_intermediate_size=16), "shared experts"),
                       (dict(moe_router_topk_scaling_factor=2.5), "topk_scaling_factor 2.5"),
                       (dict(moe_layer_pattern=[0]), "no MoE layer")):
        c = plain.replace(**bad)
        with pytest.raises(DCPError, match=match) as e:
            hf_config_from_transformer_config(c)
        assert "\n" not in str(e.value)
    with pytest.raises(DCPError, match="cannot hold a MoE model"):
        hf_config_from_transformer_config(plain, "qwen3")

    # explicit hf_config of the softmax twin: a zero expert_bias (never updated) is dropped
    hf_cfg, _ = hf_config_from_transformer_config(plain)
    out = dcp.export_hf(ck, str(tmp_path / "zero_bias"), hf_config=hf_cfg)
    assert not any("bias" in k for k in read_hf_weights(out))
    mg = dcp.export_megatron(ck, str(tmp_path / "zero_bias_mg"), hf_config=hf_cfg)
    assert os.path.isdir(mg)
    # ... a non-zero one changes routing and is refused; nothing is left behind
    model.decoder.layers[0].mlp.router.update_expert_bias(lambda c: np.arange(E, dtype=float))
    ck2 = _save(model, cfg, str(tmp_path / "ck"), step=2)
    for fn, dst in ((dcp.export_hf, "nz"), (dcp.export_megatron, "nz_mg")):
        with pytest.raises(DCPError, match=r"decoder\.layers\.0\.mlp\.router\.expert_bias is "
                                           r"non-zero") as e:
            fn(ck2, str(tmp_path / dst), hf_config=hf_cfg)
        assert "\n" not in str(e.value)
        assert not any(n.startswith(dst) for n in os.listdir(tmp_path))

    # a config that does not match the checkpoint's experts names the tensor
    with pytest.raises(DCPError, match=r"local_experts|shape"):
        dcp.export_hf(ck, str(tmp_path / "wrong"), config=plain.replace(num_moe_experts=4))
    assert not os.path.exists(tmp_path / "wrong")


def test_cli_export_newest_checkpoint(tmp_path):
    """``ms-llm export SAVE_DIR OUT`` picks the newest complete checkpoint and writes a folder
    ``from_pretrained`` reproduces the model from (same logits: both fp32, same kernels);
    bad input is one line on stderr and exit code 2."""
    from ms_llm.cli import main as cli_main
    from ms_llm.checkpoint import from_pretrained
    cfg, model, _ = _build(CASES["grouped"], seed=7)
    save_dir = str(tmp_path / "ckpt")
    _save(model, cfg, save_dir, step=1)
    _save(model, cfg, save_dir, step=2)
    ids = np.random.default_rng(0).integers(0, V, (2, 9))
    want, routes = _run(model, ids)
    for fmt, extra in (("hf", []), ("megatron", ["--target-tensor-parallel-size", "2",
                                                 "--target-expert-parallel-size", "2",
                                                 "--make-vocab-size-divisible-by", "2"])):
        out = str(tmp_path / fmt)
        assert cli_main(["export", save_dir, out, "--format", fmt, *extra]) == 0
        got, got_routes = _run(from_pretrained(out), ids)
        # Megatron pads the vocabulary to a multiple of 2 x tp (61 -> 64 rows).
        np.testing.assert_allclose(got[..., :V], want, rtol=0, atol=2e-6, err_msg=fmt)
        _same_routes(got_routes, routes, fmt)
    assert os.path.isfile(tmp_path / "megatron" / "iter_0000001" / "mp_rank_01_001" /
                          "model_optim_rng.pt")
    r = run_ms_llm("export", tmp_path / "none", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "no complete checkpoint" in r.stderr
