"""fully_shard with non-uniform sharding under real msrun matches the single-process run.

Sizes are awkward on purpose (vocab 257, hidden 96, ffn 200, 3 layers): 257 rows are uneven on 2, 3
and 4 ranks, the 24-row QK-norm-free qkv bias-less weights and 1-D norm weights of 96 are even,
and the fsdp=3 run also keeps the gathered weights (reshard_after_forward=false). Tolerance: rtol
1e-5 (fp32; reduce-scatter and the split gradient norm sum in another order).

The same msrun jobs also run TP x FSDP (4 workers), the bf16 reduce MixedPrecisionPolicy (model
level and one unit against a bf16 NumPy reference), FSDP + MXFP8 and FSDP + full recompute;
single-process tests check the flat buffer layout against NumPy and the storage-freeing reshard
against the unsharded model."""
import json

import numpy as np
import pytest

from helpers.msrun import run_spec, run_worker_job
from helpers.parallel_common import AWKWARD, CONFIG, SyntheticLoader, small_data_overrides

import ml_dtypes

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
MX = ["--quant.recipe", "mxfp8", "--model.ffn_hidden_size", "224"]   # MXFP8 dims: multiples of 32
V258 = ["--model.padded_vocab_size", "258"]     # tensor parallel needs an even vocabulary


def train_single(extra=()):
    cfg = load_config(CONFIG, AWKWARD + small_data_overrides() + list(extra))
    trainer = Trainer(cfg)
    trainer.data.loader = SyntheticLoader(cfg, 0, 1)
    recs = trainer.fit()
    return {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]}


@pytest.fixture(scope="module")
def reference():
    return train_single()


@pytest.fixture(scope="module")
def reference6():
    return train_single(["--training.max_steps", "6", "--training.lr_decay_steps", "6"])


@pytest.fixture(scope="module")
def reference_mx():
    return train_single(MX)


@pytest.fixture(scope="module")
def reference_v258():
    return train_single(V258)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp_ckpt"))


def run_job(tmp_path, nproc, specs):
    return run_worker_job("fsdp_train.py", tmp_path, nproc, specs)


def job_specs(nproc: int, ckpt_dir: str) -> list:
    """The runs of the ``nproc``-worker msrun job (``msrun_util.run_spec`` strings)."""
    mbs = 12 // nproc   # global batch 12 = micro-batch x ranks (same samples as the reference)
    common = ["--parallel.fsdp_size", str(nproc), "--training.micro_batch_size", str(mbs)]
    specs = [run_spec(f"fsdp{nproc}", common)]
    sched = ["--training.lr_decay_steps", "6"]
    save = ["--checkpoint.save_dir", ckpt_dir]
    if nproc == 3:
        specs.append(run_spec(f"fsdp{nproc}_keep", common, [
            "--parallel.reshard_after_forward", "false", "--training.micro_batch_size", "2"]))
        specs.append(run_spec("save3", common, ["--training.max_steps", "3"], sched, save))
    if nproc == 2:
        specs.append(run_spec("resume2", common, ["--training.max_steps", "6"], sched, save,
                              ["--training.resume", "auto"]))
        specs.append("unit_reduce:")
        specs.append(run_spec("bf16_reduce", common, ["--parallel.fsdp_reduce_dtype", "bf16"]))
        specs.append(run_spec("bf16_param", common, ["--parallel.fsdp_param_dtype", "bf16"]))
        specs.append(run_spec("mxfp8", common, MX))
        specs.append(run_spec("recompute2", common, ["--training.recompute_granularity", "full",
                                                      "--training.recompute_method", "uniform"]))
    if nproc == 4:   # tensor parallel 2 x FSDP 2: global batch 12 = 6 x 2 data-parallel ranks
        specs.append(run_spec("tp2_fsdp2", ["--parallel.tensor_model_parallel_size", "2",
                                            "--parallel.fsdp_size", "2",
                                            "--training.micro_batch_size", "6"], V258))
    return specs


@pytest.fixture(scope="module")
def fsdp3_job(tmp_path_factory, ckpt_dir):
    """The fsdp=3 job's results. It also writes the checkpoint (save3, in ``ckpt_dir``) the
    fsdp=2 job resumes from, so both tests ask for this fixture: each test runs alone, in any
    order, and the 3-worker job still runs once per session."""
    return run_job(tmp_path_factory.mktemp("fsdp3_job"), 3, job_specs(3, ckpt_dir))


def assert_matches(run, ref, name):
    assert len(run["loss"]) == 5, name
    np.testing.assert_allclose(run["loss"], ref["loss"], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"], rtol=RTOL, err_msg=name)


@pytest.mark.msrun
@pytest.mark.parametrize("nproc", [3, 2, pytest.param(4, marks=pytest.mark.extended)])
def test_fsdp_matches_single_process(request, tmp_path, reference, reference6, reference_mx,
                                     reference_v258, ckpt_dir, nproc):
    if nproc == 3:
        res = dict(request.getfixturevalue("fsdp3_job"))
    else:
        if nproc == 2:   # resume2 needs the checkpoint the fsdp=3 job saves
            request.getfixturevalue("fsdp3_job")
        res = run_job(tmp_path, nproc, job_specs(nproc, ckpt_dir))
    if nproc == 2:
        check_unit_reduce(str(tmp_path / "result.json"))
        check_bf16_reduce(res.pop("bf16_reduce"), res["fsdp2"])
        check_bf16_param(res.pop("bf16_param"), res["fsdp2"])
        check_mxfp8(res.pop("mxfp8"), reference_mx)
        # full recompute of the FSDP units re-runs the same kernels on the same gathered
        # weights: equal to fsdp=2 without recompute (rtol 1e-6), and (below) to one process
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(res["recompute2"][key], res["fsdp2"][key], rtol=1e-6,
                                       err_msg=f"recompute2 {key}")
    if nproc == 4:
        assert_matches(res.pop("tp2_fsdp2"), reference_v258, "tp2_fsdp2")
    for name, run in res.items():
        if name == "save3":
            np.testing.assert_allclose(run["loss"], reference6["loss"][:3], rtol=RTOL)
        elif name == "resume2":
            # Saved at fsdp=3 after 3 steps, resumed at fsdp=2: steps 4-6 continue exactly.
            assert len(run["loss"]) == 3
            np.testing.assert_allclose(run["loss"], reference6["loss"][3:], rtol=RTOL)
            np.testing.assert_allclose(run["grad_norm"], reference6["grad_norm"][3:], rtol=RTOL)
        else:
            assert_matches(run, reference, name)


def bf16(a) -> np.ndarray:
    """Round to bfloat16 (round-to-nearest-even, ml_dtypes) and back to float32."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def check_unit_reduce(out_json: str) -> None:
    """One Linear(6 -> 5) sharded 3/2 rows over 2 ranks, loss sum(c_r * (x_r W^T)) per rank, so
    rank r's full gradient is c_r^T x_r. The inputs are integers (same generator as the worker),
    so fp32 gradients are exact and the fp32 reduce is exactly G0 + G1. With reduce_dtype bf16
    each rank's gradient is rounded to bf16, the two are added (exact in fp32 for these
    integers) and the sum is rounded to bf16 again, then returned as fp32: compared exactly."""
    grads = []
    for r in range(2):
        rng = np.random.default_rng(100 + r)
        x = rng.integers(-50, 51, (4, 6)).astype(np.float64)
        c = rng.integers(-50, 51, (4, 5)).astype(np.float64)
        grads.append(c.T @ x)
    want = {"None": np.float32(grads[0] + grads[1]),
            "bf16": bf16(bf16(grads[0]) + bf16(grads[1]))}
    assert (want["bf16"] != want["None"]).any()    # the inputs do exercise bf16 rounding
    for r, rows in enumerate((slice(0, 3), slice(3, 5))):    # torch.chunk rule: 5 rows -> 3, 2
        with open(f"{out_json}.rank{r}") as f:
            got = json.load(f)
        for key, full in want.items():
            np.testing.assert_array_equal(np.float32(got[key]), full[rows],
                                          err_msg=f"rank {r} reduce_dtype {key}")


def check_bf16_reduce(run, fp32_run) -> None:
    """reduce_dtype bf16 vs the same fsdp=2 run reducing in fp32. Step 1 starts from the same
    weights, so the loss is equal and the gradient differs only by the two bf16 roundings (the
    cast and the sum, each <= 2^-8 relative per element), so its norm is within 2^-7. Later
    steps move through Adam, whose update is normalised per element (m / sqrt(v)): a gradient
    change of ~2^-8 relative moves each update by about that fraction of the learning rate.
    Measured over 5 steps: loss within 3.4e-5, grad norm within 5.5e-4; bound 5e-3 (9x margin,
    still well below the 1e-1-scale step-to-step changes of the grad norm, so a wrong gradient
    would not pass)."""
    assert len(run["loss"]) == 5
    np.testing.assert_allclose(run["loss"][0], fp32_run["loss"][0], rtol=1e-6)
    rel = abs(run["grad_norm"][0] / fp32_run["grad_norm"][0] - 1)
    assert 0 < rel <= 2 ** -7, rel      # > 0: the bf16 reduce did happen (measured 3.3e-5)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(run[key], fp32_run[key], rtol=5e-3, err_msg=f"bf16 {key}")


def check_bf16_param(run, fp32_run) -> None:
    """param_dtype bf16: units compute with bf16-rounded weights (each within 2^-9 relative;
    the CPU kernels compute in fp32 on them) while the fp32 shards are what AdamW updates.
    Step 1's loss must move (the policy is applied) but only by weight rounding: measured
    1.0e-6 relative for loss, 3e-4 for grad norm over 3 steps. Bound 5e-3 as for the bf16
    reduce (same per-element 2^-8 scale through Adam)."""
    assert len(run["loss"]) == 5
    assert run["loss"][0] != fp32_run["loss"][0]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(run[key], fp32_run[key], rtol=5e-3, err_msg=f"bf16p {key}")


def check_mxfp8(run, ref) -> None:
    """FSDP gathers the full weights, so every MXFP8 32-block (along K, within one row) is the
    one the single-process run quantizes; only fp32 summation order differs (the gradient sum
    over the batch is split by rank and reduce-scattered). That cannot change step 1 (rtol
    1e-5, loss and grad norm). After the first update weights differ by ~1 ulp, which flips
    some elements' FP8 rounding (one E4M3 step is 6% of that element), and the curves drift
    apart chaotically: on one machine steps 1-4 agreed within 3.5e-8, on another step 3's loss
    moved 1.4e-5 and step 5's grad norm 3.2e-3. So steps 2-5 at 1e-2; the fp32 FSDP runs of
    this file check the sharding itself at 1e-5."""
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(run[key][:1], ref[key][:1], rtol=RTOL, err_msg=f"mx {key}")
        np.testing.assert_allclose(run[key], ref[key], rtol=1e-2, err_msg=f"mx {key}")


# ----------------------------------------------------------------------- single process
@pytest.mark.parametrize("world", [2, 3, 4])
def test_flat_layout_matches_numpy(world):
    """Copy-in / all-gather / copy-out and pack / reduce-scatter / views of FlatLayout, with the
    collectives simulated in NumPy, against NumPy slicing by the torch.chunk rule."""
    from mindspore import Tensor
    from ms_llm.parallel.fsdp.flat import FlatLayout
    shapes = [(257, 3), (7,), (2, 4), (12, 5), (1,)]      # uneven, empty shards on 3 and 4
    rng = np.random.default_rng(world)
    fulls = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(world)]

    def rows(n, r):
        c = -(-n // world)
        return slice(min(r * c, n), min((r + 1) * c, n))
    layouts = [FlatLayout(shapes, world, r) for r in range(world)]
    import mindspore as ms
    parts = [lay.pack_shards([Tensor(f[rows(f.shape[0], r)]) for f in fulls], ms.float32)
             for r, lay in enumerate(layouts)]
    assert len({int(p.shape[0]) for p in parts}) == 1       # equal padded length per rank
    for lay in layouts:
        for got, want in zip(lay.unpack_full(parts), fulls):
            np.testing.assert_array_equal(got.asnumpy(), want)
    packed = [lay.pack_grads([Tensor(g) for g in grads[r]], ms.float32).asnumpy()
              for r, lay in enumerate(layouts)]
    n = layouts[0].numel
    for r, lay in enumerate(layouts):
        flat = Tensor(np.sum([p[r * n:(r + 1) * n] for p in packed], 0))  # rank r's slice
        for i, view in enumerate(lay.shard_views(flat)):
            want = np.sum([grads[q][i] for q in range(world)], 0)[rows(shapes[i][0], r)]
            np.testing.assert_allclose(view.asnumpy(), want, rtol=1e-6, atol=1e-6)


def test_reshard_frees_storage_and_gradients_match_unsharded():
    """fully_shard over the one-process world group (the whole execution path: flat gather,
    freed storage, pre-backward refill, async reduce-scatter delivered into the gradient views,
    no-sync accumulation) against the same model unsharded: identical op sequence per layer,
    so the gradients must be equal to fp32 rounding (rtol 1e-6; they come out bit-equal)."""
    import mindspore as ms
    from mindspore import Tensor
    from ms_llm.compat import manual_seed
    from ms_llm.compat.private_api import storage_nbytes
    from ms_llm.models import GPTModel, TransformerConfig
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=48, padded_vocab_size=37,
                            untie_embeddings_and_output_weights=True)
    ids = [Tensor(np.random.default_rng(i).integers(0, 37, (2, 8)).astype(np.int32))
           for i in range(2)]

    def build():
        manual_seed(0)
        m = GPTModel(cfg)
        m.set_train(True)
        return m

    def grads(model, n_micro, probe=None):
        params = model.trainable_params()

        def loss(t):
            out = model(t, labels=t).sum()
            if probe is not None:
                probe.append(probe_fn())
            return out
        fn = ms.value_and_grad(loss, None, params)
        acc = None
        for i in range(n_micro):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == n_micro - 1)
            _, g = fn(ids[i])
            g = [x.asnumpy() for x in g]
            acc = g if acc is None else [a + x for a, x in zip(acc, g)]
        return dict(zip([p.name for p in params], acc))
    ref = build()
    want = {1: grads(ref, 1), 2: grads(ref, 2)}
    model = build()
    layers = list(model.decoder.layers)
    units = [model.embedding] + layers + [model.output_layer]
    for u in units:
        fully_shard(u, comm.world_group())
    fully_shard(model, comm.world_group(), reshard_after_forward=False)
    for i, u in enumerate(units):
        u.set_modules_to_forward_prefetch(units[i + 1:i + 2])
        u.set_modules_to_backward_prefetch(units[max(0, i - 1):i])

    def probe_fn():   # after forward, before backward: bytes still held by the full weights
        return [sum(storage_nbytes(t) for t in u._fsdp_state.fulls) for u in layers]
    probe = []
    for n_micro in (1, 2, 1):
        got = grads(model, n_micro, probe)
        for k, w in want[n_micro].items():
            np.testing.assert_allclose(got[k], w, rtol=1e-6, atol=1e-7, err_msg=k)
    assert probe and all(b == 0 for p in probe for b in p), probe   # freed after forward
    assert all(u._fsdp_state.fulls is None for u in units)           # dropped after backward


def test_unit_mixing_dtypes_is_an_error():
    from mindspore import Parameter, Tensor
    from ms_llm.compat import nn
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    lin = nn.Linear(4, 3)
    lin.bias = Parameter(Tensor(np.zeros(3, np.float16)), name="bias")
    with pytest.raises(ValueError, match="mix dtypes"):
        fully_shard(lin, comm.world_group())
