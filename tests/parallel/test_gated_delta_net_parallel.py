"""Tensor and context parallel of Gated DeltaNet, the host-side rules (the numerics run under
msrun in tests/parallel/test_qwen3_next_parallel.py): a rank's in-memory shard of every DeltaNet
tensor
is the shard the hf <-> mg converter writes for that tp rank (so Megatron tp checkpoints and tp training
agree), and the ``row_parts`` regions a training checkpoint stores (``conv1d.weight:q/k/v``)
tile the global tensor exactly under tp x FSDP. Bit-exact: only indices move. Context
parallel refuses chunks shorter than the conv's reach and packed-document masks with one line."""
from __future__ import annotations

import numpy as np
import pytest

from ms_llm.models.families.qwen3_next.layouts import GATED_DELTA_NET
from ms_llm.models.layouts import ModelSpec
from ms_llm.models.layouts.kinds import A
from ms_llm.models.config import TransformerConfig
from ms_llm.models.gated_delta_net import GatedDeltaNet
from ms_llm.parallel.mixer_plans.gated_delta_net import (conv_parts, part_rows,
                                                         validate_gated_delta_net_tp)
from ms_llm.parallel.placement import Mesh, Placement, add_shard, checkpoint_regions, \
    set_placement


def _config(hk=2, hv=4):
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                             layer_types=["gated_delta_net"], linear_key_head_dim=8,
                             linear_value_head_dim=6, linear_num_key_heads=hk,
                             linear_num_value_heads=hv)


@pytest.mark.parametrize("tp", [2])
def test_in_memory_shard_is_the_converters_tp_shard(tp):
    c = _config()
    mixer = GatedDeltaNet(c)
    full = {A + n: p.asnumpy() for n, p in mixer.parameters_and_names()}
    spec = ModelSpec.from_config("qwen3-next", c, kinds=("gated_delta_net",))
    kind = GATED_DELTA_NET
    for t in range(tp):
        want = kind.shard(spec, full, tp, t)

        def chunk(x, dim):
            return np.split(x, tp, axis=dim)[t]
        ours = {"in_proj_qkvz.weight": chunk(full[A + "in_proj_qkvz.weight"], 0),
                "in_proj_ba.weight": chunk(full[A + "in_proj_ba.weight"], 0),
                "conv1d.weight": full[A + "conv1d.weight"][part_rows(conv_parts(mixer), t, tp)],
                "A_log": chunk(full[A + "A_log"], 0), "dt_bias": chunk(full[A + "dt_bias"], 0),
                "norm.weight": full[A + "norm.weight"],
                "out_proj.weight": chunk(full[A + "out_proj.weight"], 1)}
        for n, x in ours.items():
            np.testing.assert_array_equal(x, want[A + n], err_msg=f"{n} tp rank {t}")


def test_row_parts_regions_tile_the_tensor_under_tp_and_fsdp():
    """conv1d.weight [q; k; v] at tp 2 x FSDP 3 (uneven dim-0 cut of each rank's
    [q_r; k_r; v_r]): the regions of the six ranks rebuild every part, each element once."""
    parts = (("q", 16), ("k", 16), ("v", 24))
    full = np.arange(56 * 4, dtype=np.float32).reshape(56, 1, 4)
    tp, dp = 2, 3
    got = {p: np.full((n, 1, 4), -1.0, np.float32) for p, n in parts}
    for t in range(tp):
        tp_local = full[part_rows(parts, t, tp)]
        for d in range(dp):
            mesh = Mesh({"tp": t, "dp": d}, {"tp": tp, "dp": dp})
            pl = Placement(layout="row_parts", row_parts=parts)
            holder = type("P", (), {})()
            set_placement(holder, pl)
            pl = add_shard(holder, full.shape, "tp", 0)
            set_placement(holder, pl)
            pl = add_shard(holder, tp_local.shape, "dp", 0)
            n = tp_local.shape[0]
            c = -(-n // dp)
            local = tp_local[min(d * c, n):min((d + 1) * c, n)]
            for r in checkpoint_regions("w", local.shape, pl, mesh):
                part = r.name.split(":")[1]
                assert r.gshape == (dict(parts)[part], 1, 4)
                sl = got[part][r.offsets[0]:r.offsets[0] + r.sizes[0]]
                assert (sl == -1).all(), "a row written twice"
                sl[...] = local[r.lstart:r.lstart + r.length]
    base = 0
    for p, n in parts:
        np.testing.assert_array_equal(got[p], full[base:base + n], err_msg=p)
        base += n


def test_key_heads_not_divisible_by_tp_is_one_line():
    with pytest.raises(ValueError, match="model.linear_num_key_heads \\(2\\) is not divisible"):
        validate_gated_delta_net_tp(_config(hk=2, hv=4), 4)


def test_context_parallel_refuses_short_chunks_and_packed_masks():
    from types import SimpleNamespace
    import mindspore as ms
    from ms_llm.parallel.context_parallel.delta_rule import ContextParallelConv1d
    mixer = GatedDeltaNet(_config())
    conv = ContextParallelConv1d(mixer.conv1d, SimpleNamespace(cp=2, cp_rank=0, group=None))
    x = ms.Tensor(np.zeros((1, 4, mixer.conv1d.weight.shape[0]), np.float32))
    with pytest.raises(ValueError, match="shorter than the Gated DeltaNet conv kernel - 1"):
        conv(x)
    h = ms.Tensor(np.zeros((1, 4, 32), np.float32))
    with pytest.raises(ValueError, match="not built for Gated DeltaNet"):
        mixer(h, attention_mask=SimpleNamespace(causal=False))
    assert mixer(h, attention_mask=SimpleNamespace(causal=True)).shape == (1, 4, 32)


def test_training_checkpoint_with_conv_parts_exports_to_hf(tmp_path):
    """A Qwen3-Next training checkpoint (conv1d stored as ``:q`` / ``:k`` / ``:v``) exports to
    HF with the conv weight reassembled bit for bit and the same logits after reloading."""
    import dataclasses
    import mindspore as ms
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.checkpoint.native import dcp
    from ms_llm.checkpoint.hf.io import read_hf_weights
    from ms_llm.models import GPTModel
    from ms_llm.optim import AdamW
    from ms_llm.parallel.parallelize import describe_layouts
    from ms_llm.parallel.state import initialize_model_parallel
    from ms_llm.training import checkpointing as ckpt
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, kv_channels=8, padded_vocab_size=64,
                            layer_types=["gated_delta_net", "attention"],
                            linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4,
                            attention_output_gate=True, qk_layernorm=True,
                            layernorm_zero_centered_gamma=True, rotary_percent=0.5,
                            untie_embeddings_and_output_weights=True, ffn_hidden_size=48)
    model = GPTModel(cfg)
    describe_layouts(model)
    named = list(model.named_parameters())
    ck = ckpt.save(str(tmp_path / "ck"), 1, named,
                   AdamW([(n, p) for n, p in named if p.requires_grad]),
                   initialize_model_parallel(),
                   {"step": 1, "model_config": dataclasses.asdict(cfg)},
                   barrier=lambda: None, rank=0, world=1)
    with dcp.DCPReader(ck) as reader:
        stored = [n for n in reader.names() if "conv1d" in n]
    assert sorted(n.rsplit(":", 1)[-1] for n in stored if n.startswith("decoder.")) == \
        ["k", "q", "v"], stored
    hf_dir = dcp.export_hf(ck, str(tmp_path / "hf"))
    conv = read_hf_weights(hf_dir)["model.layers.0.linear_attn.conv1d.weight"]
    np.testing.assert_array_equal(
        conv, dict(named)["decoder.layers.0.self_attention.conv1d.weight"].asnumpy())
    ids = ms.Tensor(np.arange(20, dtype=np.int32).reshape(2, 10))
    np.testing.assert_array_equal(from_pretrained(hf_dir)(ids).asnumpy(), model(ids).asnumpy())
