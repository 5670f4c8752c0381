"""Reference side of tests/checkpoint/test_torch_dist.py: megatron-core's GPTModel (local spec,
Qwen3-like:
GQA, QK-norm, SwiGLU, RMSNorm, untied) saved / loaded with its own ``dist_checkpointing``
(``torch_dist``) in a one-process gloo group, on CPU.

    python tests/helpers/mcore_dist_ckpt.py save CKPT_DIR STATE.npz   # random init (seed 5), save
    python tests/helpers/mcore_dist_ckpt.py load CKPT_DIR STATE.npz   # fresh model (seed 9), load
    python tests/helpers/mcore_dist_ckpt.py save_train CKPT_DIR STATE.npz  # + torch AdamW, 2 steps
    python tests/helpers/mcore_dist_ckpt.py load_train CKPT_DIR STATE.npz  # + its optimizer state
    python tests/helpers/mcore_dist_ckpt.py save_lane SAVE_DIR LANE.pt     # the PyTorch lane's save
    python tests/helpers/mcore_dist_ckpt.py save_legacy SAVE_DIR STATE.npz  # --ckpt-format torch, 2 steps
    python tests/helpers/mcore_dist_ckpt.py load_legacy SAVE_DIR STATE.npz  # torch.load + load_state_dict
    python tests/helpers/mcore_dist_ckpt.py save_distopt:TYPE:BUCKET CKPT_DIR STATE.npz  # DistributedOptimizer
    python tests/helpers/mcore_dist_ckpt.py load_distopt CKPT_DIR STATE.npz  # + its optimizer state
Either way STATE.npz receives the model's state_dict after the operation (the *_train modes add
``exp_avg.<name>``, ``exp_avg_sq.<name>`` and ``step``). The optimizer part is what
megatron-core's ``FP32Optimizer.sharded_state_dict`` builds (its own helpers: the moments as
sharded tensors keyed by the model's keys, the shared step as ``common_step``); its
``FP32Optimizer`` itself allocates on CUDA, so the torch AdamW it wraps is used directly. Run as a file, not from
stdin: the checkpoint writer spawns processes. The two CUDA calls megatron-core makes get CPU
stand-ins here, in the reference process only (see the project notes on megatron-core on CPU).
"""
import os
import socket
import sys

import numpy as np
import torch


def model(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96,
                            num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True,
                            use_cpu_initialization=True, layernorm_epsilon=1e-6)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=64, max_sequence_length=128,
                    position_embedding_type="rope", rotary_base=1000000,
                    share_embeddings_and_output_weights=False)


def main(mode: str, ckpt: str, out: str) -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    if mode == "save_lane":
        return save_lane(ckpt, out)
    if mode.startswith("save_distopt:"):
        _, kind, bucket = mode.split(":")
        return save_distopt(kind, int(bucket), ckpt, out)
    if mode == "load_distopt":
        return load_distopt(ckpt, out)
    m = model(5 if mode.startswith("save") else 9)
    if mode.endswith("_train"):
        return train_mode(mode, m, ckpt, out)
    if mode.endswith("_legacy"):
        return legacy_mode(mode, m, ckpt, out)
    if mode == "save":
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save({"model": m.sharded_state_dict(), "iteration": 7}, ckpt)
    else:
        sd = {k: v for k, v in m.sharded_state_dict().items() if "_extra_state" not in k}
        loaded = dist_checkpointing.load({"model": sd}, ckpt)
        m.load_state_dict(loaded["model"], strict=False)
    np.savez(out, **{k: v.detach().numpy() for k, v in m.state_dict().items()
                     if "_extra_state" not in k and v is not None})
    dist.destroy_process_group()


def train_mode(mode: str, m, ckpt: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    torch.manual_seed(17)
    for _ in range(2 if mode == "save_train" else 1):   # load: state must exist to load into
        for p in params:
            p.grad = torch.randn_like(p) * 0.01
        opt.step()
    msd = m.sharded_state_dict()
    sd = opt.state_dict()
    step = sd["state"][0]["step"]
    optim_state_to_sharding_state(sd, get_param_id_to_sharded_param_map(msd, params),
                                  exclude_keys="step")
    sd["state"]["common_step"] = step
    if mode == "save_train":
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save({"model": msd, "optimizer": sd, "iteration": 2}, ckpt)
        moments = {i: opt.state[p] for i, p in enumerate(params)}
    else:
        msd = {k: v for k, v in msd.items() if "_extra_state" not in k}
        loaded = dist_checkpointing.load({"model": msd, "optimizer": sd}, ckpt)
        m.load_state_dict(loaded["model"], strict=False)
        moments = loaded["optimizer"]["state"]
        step = loaded["optimizer"]["state"]["common_step"]
    arrays = {k: v.detach().numpy() for k, v in m.state_dict().items()
              if "_extra_state" not in k and v is not None}
    for i, name in enumerate(names):
        for k in ("exp_avg", "exp_avg_sq"):
            arrays[f"{k}.{name}"] = moments[i][k].detach().numpy()
    arrays["step"] = np.array(float(step))
    np.savez(out, **arrays)
    dist.destroy_process_group()


def legacy_mode(mode: str, m, save_dir: str, out: str) -> None:
    """Megatron-LM's ``--ckpt-format torch`` file at tp = pp = 1 with the non-distributed
    optimizer: torch AdamW over megatron-core's own ``_get_param_groups`` (decay group, then
    no-decay), its ``state_dict()`` as the ``optimizer`` entry, as ``save_checkpoint`` writes."""
    import argparse
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    groups = _get_param_groups([m], OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1),
                               None)
    opt = torch.optim.AdamW([{**g, "weight_decay": 0.1 * g["wd_mult"]} for g in groups],
                            lr=1e-3, betas=(0.9, 0.95))
    torch.manual_seed(17)
    for _ in range(2 if mode == "save_legacy" else 1):   # load: state must exist to load into
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 0.01
        opt.step()
    path = os.path.join(save_dir, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    if mode == "save_legacy":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"args": argparse.Namespace(consumed_train_samples=8, iteration=2,
                                               ckpt_format="torch"),
                    "checkpoint_version": 3.0, "iteration": 2, "model": m.state_dict(),
                    "optimizer": opt.state_dict(),
                    "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 1e-4, "num_steps": 8,
                                            "lr_warmup_steps": 0, "lr_decay_steps": 80,
                                            "lr_decay_style": "cosine"},
                    "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}, path)
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    else:
        sd = torch.load(path, weights_only=False)
        missing, unexpected = m.load_state_dict(sd["model"], strict=False)
        assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
        opt.load_state_dict(sd["optimizer"])
        assert sd["iteration"] == sd["args"].iteration
    names = {id(p): n for n, p in m.named_parameters()}
    arrays = {k: v.detach().numpy() for k, v in m.state_dict().items()
              if "_extra_state" not in k and v is not None}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            arrays[f"{k}.{names[id(p)]}"] = st[k].detach().numpy()
        arrays["step"] = np.array(float(st["step"]))
    arrays["group_sizes"] = np.array([len(g["params"]) for g in opt.param_groups])
    arrays["group_names"] = np.array([names[id(p)] for g in opt.param_groups
                                      for p in g["params"]])
    np.savez(out, **arrays)
    dist.destroy_process_group()


def _distopt(seed: int, bucket: int):
    """megatron-core's ``DistributedOptimizer`` (fp32; grad buffer buckets of ``bucket``
    elements, 0: one bucket) over ``model(seed)``. Its CUDA-only spots get CPU stand-ins:
    tensors asked for on ``cuda`` are made on the CPU, and CPU parameters report the CUDA
    tensor type its constructor checks for."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    for fn in ("tensor", "zeros", "empty", "ones", "full"):
        def on_cpu(*a, _make=getattr(torch, fn), **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _make(*a, **k)
        setattr(torch, fn, on_cpu)
    tensor_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (
        tensor_type(self).replace("torch.", "torch.cuda.", 1) if not a and not k
        else tensor_type(self, *a, **k))
    m = model(seed)
    ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket > 0, bucket_size=bucket or None), m)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.1, use_distributed_optimizer=True), [ddp])
    return m, ddp, opt


def _distopt_dump(m, ddp, opt, out: str) -> None:
    """Each parameter's fp32 main param and moments as the optimizer itself holds them
    (``_get_main_param_and_optimizer_states``), Adam's ``step`` and the bucket count."""
    inner = opt.chained_optimizers[0]
    arrays = {}
    for name, p in m.named_parameters():
        states = inner._get_main_param_and_optimizer_states(p)
        for k in ("param", "exp_avg", "exp_avg_sq"):
            arrays[f"{k}.{name}"] = states[k].detach().reshape(p.shape).numpy()
    arrays["step"] = np.array(float(inner.state_dict()["optimizer"]["param_groups"][0]["step"]))
    arrays["buckets"] = np.array(len(ddp.buffers[0].buckets))
    np.savez(out, **arrays)


def save_distopt(sharding_type: str, bucket: int, ckpt: str, out: str) -> None:
    """``_distopt`` after 2 Adam steps, saved in ``sharding_type`` (``legacy``:
    ``--ckpt-format torch``, ``model_optim_rng.pt`` + ``distrib_optim.pt``)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    m, ddp, opt = _distopt(5, bucket)
    torch.manual_seed(17)
    for _ in range(2):
        ddp.zero_grad_buffer()
        for p in m.parameters():
            p.main_grad.copy_(torch.randn_like(p) * 0.01)
        opt.step()
    if sharding_type == "legacy":   # --ckpt-format torch: Megatron-LM's two files per rank
        import argparse
        it = os.path.join(ckpt, "iter_0000002", "mp_rank_00")
        os.makedirs(it, exist_ok=True)
        args = argparse.Namespace(consumed_train_samples=8, iteration=2, ckpt_format="torch",
                                  use_distributed_optimizer=True, data_parallel_size=1,
                                  overlap_grad_reduce=bucket > 0, ddp_bucket_size=bucket or None)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 2,
                    "model": m.state_dict(), "optimizer": opt.state_dict(),
                    "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 8}},
                   os.path.join(it, "model_optim_rng.pt"))
        opt.save_parameter_state(os.path.join(it, "distrib_optim.pt"))
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    else:
        msd = m.sharded_state_dict()
        osd = opt.sharded_state_dict(msd, metadata={
            "distrib_optim_sharding_type": sharding_type,
            "distrib_optim_fully_reshardable_mem_efficient": True})
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save({"model": msd, "optimizer": osd, "iteration": 2}, ckpt)
    _distopt_dump(m, ddp, opt, out)
    dist.destroy_process_group()


def load_distopt(ckpt: str, out: str) -> None:
    """A fresh ``_distopt`` (one bucket) loads ``ckpt`` as Megatron-LM 0.16 does: the layout
    from the checkpoint's ``content_metadata``, model and optimizer through
    ``dist_checkpointing.load``, then ``load_state_dict`` of both."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    put = DistributedOptimizer._set_main_param_and_optimizer_states

    def put_keeping_step(self, model_param, tensors):
        # torch AdamW (this CPU stand-in for TE / Apex FusedAdam) keeps a per-parameter "step"
        # that fully_reshardable's loader never passes (it set it from the param groups just
        # before); FusedAdam has none, so megatron-core's own path needs no step here.
        if "step" not in tensors:
            tensors = {**tensors, "step": self._get_main_param_and_optimizer_states(
                model_param)["step"].clone()}
        put(self, model_param, tensors)
    DistributedOptimizer._set_main_param_and_optimizer_states = put_keeping_step
    m, ddp, opt = _distopt(9, 0)
    ddp.zero_grad_buffer()
    for p in m.parameters():   # state must exist to load into (as in load_train)
        p.main_grad.copy_(torch.randn_like(p) * 0.01)
    opt.step()
    meta = dist_checkpointing.load_content_metadata(ckpt)
    msd = {k: v for k, v in m.sharded_state_dict().items() if "_extra_state" not in k}
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load({"model": msd, "optimizer": osd}, ckpt)
    m.load_state_dict(loaded["model"], strict=False)
    opt.load_state_dict(loaded["optimizer"])
    _distopt_dump(m, ddp, opt, out)
    dist.destroy_process_group()


def megatron_layout(hf: dict, heads: int, groups: int, head_dim: int) -> dict:
    """Per-layer HF Qwen3 tensors (or Adam moments shaped like them) in Megatron-Core's
    torch_dist keys: layers stacked, TE names for the norms, qkv grouped per KV group."""
    layers = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": hf["lm_head.weight"]}
    per = {}
    for i in layers:
        g = lambda n: hf[f"model.layers.{i}.{n}"]   # noqa: E731
        hidden = g("self_attn.q_proj.weight").shape[1]
        q = g("self_attn.q_proj.weight").reshape(groups, heads // groups * head_dim, hidden)
        k = g("self_attn.k_proj.weight").reshape(groups, head_dim, hidden)
        v = g("self_attn.v_proj.weight").reshape(groups, head_dim, hidden)
        layer = {
            "self_attention.linear_qkv.layer_norm_weight": g("input_layernorm.weight"),
            "self_attention.linear_qkv.weight": torch.cat([q, k, v], 1).reshape(-1, hidden),
            "self_attention.q_layernorm.weight": g("self_attn.q_norm.weight"),
            "self_attention.k_layernorm.weight": g("self_attn.k_norm.weight"),
            "self_attention.linear_proj.weight": g("self_attn.o_proj.weight"),
            "mlp.linear_fc1.layer_norm_weight": g("post_attention_layernorm.weight"),
            "mlp.linear_fc1.weight": torch.cat([g("mlp.gate_proj.weight"),
                                                g("mlp.up_proj.weight")], 0),
            "mlp.linear_fc2.weight": g("mlp.down_proj.weight")}
        for name, t in layer.items():
            per.setdefault(name, []).append(t)
    return out, per


def save_lane(save_dir: str, lane_file: str) -> None:
    """What Megatron-LM's ``save_checkpoint`` writes for the PyTorch lane's state at its
    iteration (``LANE.pt`` from tests/helpers/pytorch_lane.dump): model, the FP32Optimizer's moments
    and ``common_step``, ``opt_param_scheduler``, ``args`` (consumed samples), the torch RNG as a
    ShardedObject, then the tracker; also ``SAVE_DIR.npz`` with the Megatron-layout tensors."""
    import argparse
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    lane = torch.load(lane_file, weights_only=False)
    it = int(lane["iteration"])
    sharded, flat = {}, {}

    def shard(prefix: str, tensors: dict) -> dict:
        whole, per = megatron_layout(tensors, lane["heads"], lane["groups"], lane["head_dim"])
        got = {}
        for name, t in whole.items():
            got[name] = ShardedTensor.from_rank_offsets(prefix + name, t.contiguous())
            flat[prefix + name] = t.numpy()
        for name, ts in per.items():
            key = prefix + "decoder.layers." + name
            got[key] = [ShardedTensor.from_rank_offsets(key, t.contiguous().unsqueeze(0),
                                                        (0, i, len(ts)), prepend_axis_num=0)
                        for i, t in enumerate(ts)]
            flat[key] = torch.stack(ts).numpy()
        return got

    model = shard("", lane["model"])
    state = {"common_step": torch.tensor(float(lane["step"]))}
    for i, moment in enumerate(("exp_avg", "exp_avg_sq")):
        state[i] = {moment: shard(f"optimizer.state.{moment}.", lane[moment])}
    args = argparse.Namespace(consumed_train_samples=lane["consumed"], iteration=it,
                              ckpt_format="torch_dist")
    rng = ShardedObject("rng_state", [{"random_rng_state": None, "np_rng_state": None,
                                       "torch_rng_state": torch.get_rng_state()}], (1,), (0,))
    path = os.path.join(save_dir, f"iter_{it:07d}")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save({"model": model, "optimizer": {"state": state,
                                                           "param_groups": lane["groups_sd"]},
                             "opt_param_scheduler": lane["scheduler"], "iteration": it,
                             "args": args, "checkpoint_version": 3.0, "rng_state": rng}, path)
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(it))
    np.savez(save_dir + ".npz", **flat)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
