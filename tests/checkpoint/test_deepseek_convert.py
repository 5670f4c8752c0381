"""DeepSeek-V3 / GLM-4.5 conversion: HF -> Megatron (tp / ep / pp layouts) -> HF is bit-exact,
the Megatron folders reload with the HF folder's logits, and the Megatron-Core keys are where
Megatron puts them (MLA up-projections split by heads over tp, down-projections replicated,
shared experts split like the dense MLP, the expert bias copied). HF folders are written by
transformers (test-only)."""
from __future__ import annotations

import glob
import logging
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import deepseek_fixtures as fx
from helpers.deepseek_fixtures import run_convert as run, same_bits as same
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.hf.io import read_hf_weights

import transformers  # noqa: E402,F401  (test extra: cross-checks against HF modeling code)

LAYOUTS = {  # name -> converter flags
    "tp2": ["--target-tensor-parallel-size", "2"],
    "ep2_pp2": ["--target-expert-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                "--num-layer-list", "1,2"],
    # 3 layers + 1 noop layer over pp=2 with virtual stages of 1 layer (2 chunks per stage)
    "pp2_vpp_noop": ["--target-pipeline-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1", "--noop-layers", "3"],
}


@pytest.fixture(scope="module", params=["deepseek_q_lora", "glm45"])
def hf_dir(request, tmp_path_factory):
    kind, kwargs = fx.CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    fx.build_hf(kind, kwargs, seed=7).save_pretrained(str(root / "hf"))
    return request.param, root


def _logits(path):
    import mindspore as ms
    from ms_llm.checkpoint import from_pretrained
    ids, _ = fx.batch()
    return from_pretrained(str(path))(ms.Tensor(ids.astype(np.int32))).asnumpy()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_and_reload(hf_dir, layout):
    name, root = hf_dir
    mg, back = root / f"mg_{layout}", root / f"back_{layout}"
    model_type = "deepseek3" if name.startswith("deepseek") else "glm45"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", model_type,
        "--load-dir", root / "hf", "--save-dir", mg, *LAYOUTS[layout])
    run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg,
        "--save-dir", back)
    hf, got = read_hf_weights(str(root / "hf")), read_hf_weights(str(back))
    assert set(got) == set(hf)
    for k in hf:
        assert same(got[k], hf[k]), k
    # Same numbers after sharding and merging: exact (the weights are bit-identical).
    np.testing.assert_array_equal(_logits(mg), _logits(root / "hf"))


def test_megatron_keys_and_tp_splits(hf_dir):
    name, root = hf_dir
    mg = root / "mg_tp2"
    if not mg.exists():   # run alone: convert here (test_round_trip_and_reload usually did)
        model_type = "deepseek3" if name.startswith("deepseek") else "glm45"
        run("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", model_type,
            "--load-dir", root / "hf", "--save-dir", mg, *LAYOUTS["tp2"])
    hf = read_hf_weights(str(root / "hf"))
    files = {os.path.basename(os.path.dirname(f)): tp.load(f)["model"] for f in
             sorted(glob.glob(str(mg / "iter_0000001" / "mp_rank_*" / "model_optim_rng.pt")))}
    assert sorted(files) == ["mp_rank_00", "mp_rank_01"]
    p, L1 = "model.layers.1.", "decoder.layers.1."
    for t, sd in enumerate(files[f"mp_rank_{t:02d}"] for t in range(2)):
        assert same(sd[L1 + "mlp.router.expert_bias"], hf[p + "mlp.gate.e_score_correction_bias"])
        half = hf[p + "mlp.shared_experts.gate_proj.weight"].shape[0] // 2
        fc1 = np.concatenate([hf[p + "mlp.shared_experts.gate_proj.weight"][t * half:(t + 1) * half],
                              hf[p + "mlp.shared_experts.up_proj.weight"][t * half:(t + 1) * half]])
        assert same(sd[L1 + "mlp.shared_experts.linear_fc1.weight"], fc1)
        if name.startswith("deepseek"):
            a = p + "self_attn."
            # MindSpeed-LLM's names on disk: linear_qkv = [q_a_proj; kv_a_proj_with_mqa]
            # (replicated), linear_qb / linear_kvb = up-projections split by heads.
            up = hf[a + "q_b_proj.weight"]
            assert same(sd[L1 + "self_attention.linear_qb.weight"],
                        np.split(up, 2, axis=0)[t])       # heads 2t, 2t+1
            assert same(sd[L1 + "self_attention.linear_kvb.weight"],
                        np.split(hf[a + "kv_b_proj.weight"], 2, axis=0)[t])
            assert same(sd[L1 + "self_attention.linear_qkv.weight"], np.concatenate(
                [hf[a + "q_a_proj.weight"], hf[a + "kv_a_proj_with_mqa.weight"]]))
            assert same(sd[L1 + "self_attention.q_layernorm.weight"], hf[a + "q_a_layernorm.weight"])
            assert same(sd[L1 + "self_attention.k_layernorm.weight"], hf[a + "kv_a_layernorm.weight"])
            assert not any("linear_q_down_proj" in k or "linear_kv_up_proj" in k for k in sd)
            assert same(sd[L1 + "self_attention.linear_proj.weight"],
                        np.split(hf[a + "o_proj.weight"], 2, axis=1)[t])


def test_mtp_weights_are_loaded_when_asked_and_skipped_otherwise(hf_dir, tmp_path, caplog):
    """DeepSeek's release keeps the MTP module as ``model.layers.{num_layers}.*``. Loading
    without ``model.mtp_num_layers`` skips them with a warning; the main model's logits are
    unchanged. (Their numerics and conversion: test_deepseek_mtp.py.)"""
    name, root = hf_dir
    src = tmp_path / "with_mtp"
    os.makedirs(src)
    for f in os.listdir(root / "hf"):
        if not f.endswith(".safetensors"):
            os.link(root / "hf" / f, src / f)
    w = load_file(str(root / "hf" / "model.safetensors"))
    n, H = fx.CASES[name][1]["num_hidden_layers"], fx.CASES[name][1]["hidden_size"]
    last = f"model.layers.{n - 1}."
    for k in [k for k in w if k.startswith(last)]:        # a decoder layer plus MTP's own
        w[f"model.layers.{n}." + k[len(last):]] = w[k]
    for k, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)),
                     ("eh_proj.weight", (H, 2 * H)), ("shared_head.norm.weight", (H,))):
        w[f"model.layers.{n}.{k}"] = np.ones(shape, np.float32)
    w[f"model.layers.{n}.embed_tokens.weight"] = w["model.embed_tokens.weight"]
    w[f"model.layers.{n}.shared_head.head.weight"] = w["lm_head.weight"]
    save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="ms_llm.checkpoint"):
        np.testing.assert_array_equal(_logits(src), _logits(root / "hf"))
    assert sum("skipped" in r.getMessage() and "MTP" in r.getMessage()
               for r in caplog.records) == 1
    from ms_llm.checkpoint.hf.io import read_hf_config
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.models.families import config_from_hf
    cfg = config_from_hf(read_hf_config(str(src))).replace(mtp_num_layers=1)
    model = from_pretrained(str(src), config=cfg)
    np.testing.assert_array_equal(model.mtp.layers[0].eh_proj.weight.asnumpy(),
                                  np.ones((H, 2 * H), np.float32))
    # and they convert: HF -> Megatron (tp=2) -> HF bit-exact, MTP included (both families)
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
        "--save-dir", tmp_path / "mg", "--target-tensor-parallel-size", "2")
    sd = tp.load(str(tmp_path / "mg" / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"))
    assert "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight" in sd["model"]
    # newer Megatron-Core names the inner layer mtp_model_layer: read as well
    for f in glob.glob(str(tmp_path / "mg" / "iter_0000001" / "mp_rank_*" / "*.pt")):
        ck = tp.load(f)
        ck["model"] = {k.replace(".transformer_layer.", ".mtp_model_layer."): v
                       for k, v in ck["model"].items()}
        tp.save(ck, f)
    run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
        "--save-dir", tmp_path / "back")
    got = read_hf_weights(str(tmp_path / "back"))
    assert set(got) == set(w)
    for k in w:
        assert same(got[k], w[k]), k


@pytest.mark.parametrize("variant", ["mla", "glm"])
def test_trained_proxy_exports_to_hf(tmp_path, variant):
    """Train the DeepSeek proxy (or its GLM-4.5-style variant) for one step with a checkpoint,
    ``ms-llm export`` it, and transformers' model of the exported folder gives the trained
    model's logits (1e-4, as in the parity tests) and ms-llm reloads it exactly. The MLA run
    trains an MTP depth too: it exports as DeepSeek's ``model.layers.{L}.*`` and reloads."""
    import json

    import mindspore as ms
    import torch
    import transformers as tf
    from helpers.deepseek_parallel_common import DS_BASE, DS_CONFIG
    from ms_llm import cli
    from ms_llm.config import load_config
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.training.trainer import Trainer
    extra = ["--model.mtp_num_layers", "1"] if variant == "mla" else [
        "--model.multi_latent_attention", "false", "--model.num_query_groups", "2",
        "--model.kv_channels", "16", "--model.add_qkv_bias", "true",
        "--model.qk_layernorm", "true", "--model.rotary_percent", "0.5"]
    cfg = load_config(DS_CONFIG, DS_BASE + extra + [
        "--training.max_steps", "1", "--training.output_dir", str(tmp_path / "out"),
        "--checkpoint.save_dir", str(tmp_path / "ck")])
    trainer = Trainer(cfg)
    trainer.fit()
    out = tmp_path / "exported"
    assert cli.main(["export", str(tmp_path / "ck"), str(out)]) == 0
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == ("deepseek_v3" if variant == "mla" else "glm4_moe")
    ids = np.random.default_rng(0).integers(0, 512, (2, 10))
    want = trainer.model(ms.Tensor(ids.astype(np.int32))).asnumpy()
    np.testing.assert_array_equal(from_pretrained(str(out))(
        ms.Tensor(ids.astype(np.int32))).asnumpy(), want)
    if variant == "mla":
        L = cfg.model.num_layers
        assert hf_cfg["num_nextn_predict_layers"] == 1
        back = from_pretrained(str(out), config=trainer.model.config)
        mine = dict(trainer.model.parameters_and_names())
        theirs = dict(back.parameters_and_names())
        mtp_keys = [k for k in mine if k.startswith("mtp.")]
        assert len(mtp_keys) > 10 and sorted(k for k in theirs if k.startswith("mtp.")) == \
            sorted(mtp_keys)
        for k in mtp_keys:
            np.testing.assert_array_equal(theirs[k].asnumpy(), mine[k].asnumpy(), err_msg=k)
        w = read_hf_weights(str(out))
        np.testing.assert_array_equal(w[f"model.layers.{L}.shared_head.head.weight"],
                                      w["lm_head.weight"])
    cls = tf.DeepseekV3ForCausalLM if variant == "mla" else tf.Glm4MoeForCausalLM
    hf = cls.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_lora", [24, 0])
def test_mla_shards_read_back_from_both_namings(q_lora):
    """``mla_merge`` undoes ``mla_shard`` (MindSpeed's names with ``q_lora_rank``, Megatron-Core's
    without) and also reads a checkpoint written with Megatron-Core's names."""
    from ms_llm.models import layouts as L
    from ms_llm.models.layouts import mla as DS
    spec = L.ModelSpec(family="deepseek-v3", num_layers=1, hidden=16, ffn=32, heads=4, groups=4,
                       head_dim=12, vocab=8, tied=False, qkv_bias=False, qk_norm=False, mla=True,
                       q_lora_rank=q_lora, kv_lora_rank=8, qk_nope=8, qk_rope=4, v_head=6,
                       attn_bias=True)
    rng = np.random.default_rng(0)
    full = {mg: rng.standard_normal(shape).astype(np.float32) for mg, _, shape in
            [(mg, hf, shape) for mg, hf, shape in DS._mla_pairs(spec)]}
    mcore = {t: {mg: (np.split(x, 2, 0)[t] if mg in DS._MLA_ROWS else
                      np.split(x, 2, 1)[t] if mg in DS._MLA_COLS else x)
                 for mg, x in full.items()} for t in range(2)}
    written = {t: DS.mla_shard(spec, full, 2, t) for t in range(2)}
    if q_lora:
        assert "self_attention.linear_qkv.bias" in written[0]
    else:
        assert set(k for k in written[0] if not k.endswith("_extra_state")) == set(mcore[0])
    for shards in (written, mcore):
        def part(t, e, key, shards=shards):
            if key not in shards[t]:
                raise KeyError(key)
            return shards[t][key]
        back = DS.mla_merge(spec, part, 2)
        assert set(back) == set(full)
        for k in full:
            assert same(back[k], full[k]), k
