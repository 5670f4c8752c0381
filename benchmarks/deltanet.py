"""One Gated DeltaNet layer, forward + backward: ms-llm's ``GatedDeltaNet`` (MindSpore PyNative,
chunked delta rule with the nilpotent-product UT inverse) against transformers'
``Qwen3NextGatedDeltaNet`` (torch eager, its torch chunked delta rule with a triangular solve),
same weights, same input, same machine, one process.

    python -m benchmarks.deltanet [--hidden 512] [--seq 2048] [--batch 1] [--repeat 3]

Widths: hidden 512 (the ~55M model), 4 key heads / 8 value heads of 64, conv kernel 4, chunk
64. Timing: min and median wall time of fwd+bwd over --repeat runs after one warm-up, the two
implementations alternating. The ratio is torch time / ms-llm time (>= 1.0: ms-llm is faster).
The last column is the largest output difference relative to the largest output (same weights).
CPU figures on a shared machine are noisy: the CPU model and load are printed with them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


import mindspore as ms

from ms_llm.compat import setup_device

# as training runs it: MindSpore's CPU kernel threads from runtime.cpu_threads (default 1; the
# elementwise kernels stall ~4 ms per op at 2+ threads on this 2-core VM, mindspore-cpu.md)
setup_device("CPU")

from benchmarks.harness import machine  # noqa: E402
from ms_llm.compat import nn  # noqa: E402
from ms_llm.models.config import TransformerConfig  # noqa: E402
from ms_llm.models.gated_delta_net import GatedDeltaNet  # noqa: E402


def build(hidden: int, seed: int = 0):
    import torch
    import transformers
    heads_k, heads_v, d = hidden // 128, hidden // 64, 64
    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=hidden, linear_num_key_heads=heads_k, linear_num_value_heads=heads_v,
        linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    ref = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(hf_cfg, 0)
    ref = ref.float()
    c = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                          layer_types=["gated_delta_net"], linear_num_key_heads=heads_k,
                          linear_num_value_heads=heads_v, linear_key_head_dim=d,
                          linear_value_head_dim=d, linear_conv_kernel_dim=4)
    nn.manual_seed(seed)
    ours = GatedDeltaNet(c)
    sd = {n: p.detach().numpy() for n, p in ref.named_parameters()}
    for name, p in ours.parameters_and_names():
        p.set_data(ms.Tensor(sd[name]))
    return ref, ours


def run(args) -> None:
    import torch
    torch.set_num_threads(args.threads or os.cpu_count())
    ref, ours = build(args.hidden)
    x = np.random.default_rng(1).standard_normal((args.batch, args.seq, args.hidden)) \
        .astype(np.float32)
    dy = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    params = ours.trainable_params()
    grad_fn = ms.value_and_grad(lambda t: (ours(t) * ms.Tensor(dy)).sum(), None, params)
    xt = ms.Tensor(x)

    def step_ours():
        loss, grads = grad_fn(xt)
        loss.asnumpy()
        return grads

    def step_torch():
        ref.zero_grad()
        out = ref(torch.tensor(x))
        (out * torch.tensor(dy)).sum().backward()
        return out

    with torch.no_grad():
        want = ref(torch.tensor(x)).numpy()
    got = ours(xt).asnumpy()
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    times = {"ms-llm": [], "torch": []}
    step_ours(), step_torch()                       # warm-up
    for _ in range(args.repeat):
        for name, fn in (("ms-llm", step_ours), ("torch", step_torch)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(machine())
    print(f"Gated DeltaNet fwd+bwd, batch {args.batch}, seq {args.seq}, hidden {args.hidden}")
    for name, ts in times.items():
        print(f"  {name:7s} min {min(ts):8.3f} s  median {statistics.median(ts):8.3f} s")
    ratio = min(times["torch"]) / min(times["ms-llm"])
    print(f"  ratio torch / ms-llm (min): {ratio:.2f}x   max |out diff| / max |out|: {rel:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
