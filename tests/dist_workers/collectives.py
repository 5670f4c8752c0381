"""Worker for tests/parallel/test_collectives.py, run under msrun with 2 or 3 processes.

Every rank builds every rank's inputs from a seed, so it can compute the expected result of each
collective in NumPy (float64) on its own. Prints one "CHECK <name> OK" line per check; any
mismatch raises, which makes msrun exit non-zero.
"""
import sys

import numpy as np

from ms_llm.compat import setup_device

setup_device("CPU", synchronize=True)
import mindspore as ms  # noqa: E402
from mindspore import Tensor  # noqa: E402

from ms_llm.parallel import comm  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402

info = init_distributed()
R, W = info.rank, info.world_size
DTYPES = {"fp32": (ms.float32, 1e-6), "fp16": (ms.float16, 2e-3), "bf16": (ms.bfloat16, 1e-2)}


def data(rank, shape, salt=0):
    return np.random.default_rng(1000 * rank + salt).normal(size=shape)


def to_ms(a, dt):
    return Tensor(a.astype(np.float32)).astype(dt)


def to_np(t):
    return t.astype(ms.float32).asnumpy().astype(np.float64)


def rounded(a, dt):
    return to_np(to_ms(a, dt))


def check(name, got, want, tol):
    err = np.max(np.abs(got - want)) if want.size else 0.0
    scale = max(1.0, np.max(np.abs(want)) if want.size else 1.0)
    if not np.isfinite(err) or err > tol * scale or got.shape != want.shape:
        raise AssertionError(f"{name}: rank {R} max err {err} (tol {tol * scale}), "
                             f"shapes {got.shape} vs {want.shape}")
    print(f"CHECK {name} OK", flush=True)


for dname, (dt, tol) in DTYPES.items():
    ins = [rounded(data(r, (4, 3), 1), dt) for r in range(W)]
    # all_reduce: sum, max, avg
    for op, ref in (("sum", np.sum(ins, 0)), ("max", np.max(ins, 0)), ("avg", np.mean(ins, 0))):
        t = to_ms(ins[R], dt)
        comm.all_reduce(t, op=op)
        check(f"all_reduce_{op}_{dname}", to_np(t), ref, tol * W)
    # all_gather_into_tensor, sync and async
    for async_op in (False, True):
        out = to_ms(np.zeros((4 * W, 3)), dt)
        h = comm.all_gather_into_tensor(out, to_ms(ins[R], dt), async_op=async_op)
        if h is not None:
            h.wait()
        check(f"all_gather_into_tensor_async{int(async_op)}_{dname}", to_np(out),
              np.concatenate(ins, 0), tol)
    # reduce_scatter_tensor
    big = [rounded(data(r, (2 * W, 5), 2), dt) for r in range(W)]
    out = to_ms(np.zeros((2, 5)), dt)
    h = comm.reduce_scatter_tensor(out, to_ms(big[R], dt), async_op=True)
    h.wait()
    check(f"reduce_scatter_tensor_{dname}", to_np(out), np.sum(big, 0)[2 * R:2 * R + 2], tol * W)
    # all_to_all_single with uneven splits, including zero-size ones
    splits = [[(i + 2 * j) % 3 for j in range(W)] for i in range(W)]   # splits[i][j]: i -> j
    srcs = [rounded(data(r, (sum(splits[r]), 2), 3), dt) for r in range(W)]
    out_splits = [splits[i][R] for i in range(W)]
    out = to_ms(np.zeros((sum(out_splits), 2)), dt)
    comm.all_to_all_single(out, to_ms(srcs[R], dt) if srcs[R].size else
                           Tensor(np.zeros((0, 2), np.float32)).astype(dt), out_splits, splits[R])
    want = []
    for i in range(W):
        off = sum(splits[i][:R])
        want.append(srcs[i][off:off + splits[i][R]])
    check(f"all_to_all_single_uneven_{dname}", to_np(out), np.concatenate(want, 0), tol)
    # broadcast from the last rank
    t = to_ms(ins[R], dt)
    comm.broadcast(t, src=W - 1)
    check(f"broadcast_{dname}", to_np(t), ins[W - 1], tol)
    # send/recv ring: each rank sends to the next, receives from the previous (batched)
    t_recv = to_ms(np.zeros((4, 3)), dt)
    works = comm.batch_isend_irecv([comm.P2POp("isend", to_ms(ins[R], dt), (R + 1) % W),
                                    comm.P2POp("irecv", t_recv, (R - 1) % W)])
    for w in works:      # asynchronous, as torch's: the receive is complete after wait()
        w.wait()
    check(f"batch_isend_irecv_ring_{dname}", to_np(t_recv), ins[(R - 1) % W], tol)

# Larger than one shared-memory slot (4 MiB per rank): every op runs in several chunks, with
# odd sizes so the last chunk is partial; fp32 and bf16 (accumulated in fp32, rounded once).
from ms_llm.parallel.comm import shm  # noqa: E402

ROWS = (3 << 20) // 3 + 7                     # ~12 MiB of fp32 per rank in [ROWS, 3]
for dname in ("fp32", "bf16"):
    dt, tol = DTYPES[dname]
    big = [rounded(data(r, (ROWS, 3), 11), dt) for r in range(W)]
    t = to_ms(big[R], dt)
    h = comm.all_reduce(t, async_op=True)
    h.wait()
    check(f"large_all_reduce_{dname}", to_np(t), np.sum(big, 0), tol * W)
    parts = [to_ms(np.zeros((ROWS, 3)), dt) for _ in range(W)]
    comm.all_gather(parts, to_ms(big[R], dt))
    check(f"large_all_gather_{dname}", np.concatenate([to_np(p) for p in parts]),
          np.concatenate(big), tol)
    rows = ROWS - ROWS % W
    out = to_ms(np.zeros((rows // W, 3)), dt)
    comm.reduce_scatter_tensor(out, to_ms(big[R][:rows], dt))
    per = rows // W
    check(f"large_reduce_scatter_{dname}", to_np(out),
          np.sum([b[:rows] for b in big], 0)[R * per:(R + 1) * per], tol * W)
    sp = [[ROWS // (2 * (i + j + 2)) for j in range(W)] for i in range(W)]   # i -> j, uneven
    src = to_ms(big[R][:sum(sp[R])], dt)
    out = to_ms(np.zeros((sum(sp[i][R] for i in range(W)), 3)), dt)
    comm.all_to_all_single(out, src, [sp[i][R] for i in range(W)], sp[R])
    want = [big[i][sum(sp[i][:R]):sum(sp[i][:R]) + sp[i][R]] for i in range(W)]
    check(f"large_all_to_all_{dname}", to_np(out), np.concatenate(want), tol)
    t = to_ms(big[R], dt)
    comm.broadcast(t, src=0)
    check(f"large_broadcast_{dname}", to_np(t), big[0], tol)
print("SHM", "on" if shm.channel(comm.world_group()) is not None else "off", flush=True)

# blocking send/recv between 0 and 1
if R in (0, 1):
    t = Tensor(np.full((3,), 7.0 + R, np.float32))
    if R == 0:
        comm.send(t, 1)
    else:
        comm.recv(t, 0)
    check("send_recv", t.asnumpy().astype(np.float64), np.full((3,), 7.0), 0.0)
# sub-group: ranks {0, W-1}
g = comm.new_group([0, W - 1])
if g.rank >= 0:
    t = Tensor(np.array([R + 1.0], np.float32))
    comm.all_reduce(t, group=g)
    check("subgroup_all_reduce", t.asnumpy().astype(np.float64), np.array([1.0 + W]), 0.0)
# Differentiable collectives (fp32): gradients against NumPy.
from ms_llm.parallel import autograd as pa  # noqa: E402

world = comm.world_group()
x_np = data(R, (2, 4, 3 * W), 7)
ws = [data(r, (2, 4, 3 * W), 8) for r in range(W)]          # per-rank upstream weights
w_same = data(99, (2, 4, 3 * W * W), 9)                      # replicated upstream weight


def grad_of(fn, x):
    return ms.grad(fn)(Tensor(x.astype(np.float32))).asnumpy().astype(np.float64)


g = grad_of(lambda x: (pa.copy_to_group(x, world) * Tensor(ws[R].astype(np.float32))).sum(), x_np)
check("grad_copy_to_group", g, np.sum(ws, 0), 1e-5)
g = grad_of(lambda x: (pa.gather_from_group(x, world, -1) *
                       Tensor(w_same.astype(np.float32))).sum(), x_np)
check("grad_gather_from_group", g, w_same[..., 3 * W * R:3 * W * (R + 1)], 1e-6)
seq_w = [data(r, (2, 4 // W if 4 % W == 0 else 4, 3 * W), 10) for r in range(W)]
if 4 % W == 0:
    g = grad_of(lambda x: (pa.reduce_scatter_to_sequence_parallel(x, world, 1) *
                           Tensor(seq_w[R].astype(np.float32))).sum(), x_np)
    check("grad_reduce_scatter_sp", g, np.concatenate(seq_w, 1), 1e-6)
else:
    print("CHECK grad_reduce_scatter_sp OK (skipped: 4 % W != 0)", flush=True)
splits = [[(i + 2 * j) % 3 + 1 for j in range(W)] for i in range(W)]
src = data(R, (sum(splits[R]), 2), 11)
outs = [splits[i][R] for i in range(W)]
wa = [data(r, (sum(splits[i][r] for i in range(W)), 2), 12) for r in range(W)]
g = grad_of(lambda x: (pa.all_to_all(x, world, outs, splits[R]) *
                       Tensor(wa[R].astype(np.float32))).sum(), src)
want = []
for j in range(W):   # rows this rank sent to rank j get rank j's weight rows for them
    off = sum(splits[i][j] for i in range(R))
    want.append(wa[j][off:off + splits[R][j]])
check("grad_all_to_all", g, np.concatenate(want, 0), 1e-6)
comm.barrier()
print("ALL DONE", flush=True)
sys.exit(0)
