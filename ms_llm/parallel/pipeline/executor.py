"""One executor for every pipeline schedule.

A schedule is data (per rank, a list of ``Action(F|B, microbatch, chunk)``, see ``schedules/``);
``plan_rounds`` turns all ranks' lists into lockstep rounds, placing the chunks as the schedule's
record says (``ScheduleSpec.placement``). In each round this rank runs at most
one action:

* ``F``: the chunk's forward on the micro-batch (token ids on the first virtual stage, the
  received activation elsewhere), keeping what the backward needs until the matching ``B``
  (1F1B's memory bound comes from the schedule);
* ``B``: the vector-Jacobian product with the received output gradient (1 for the last stage's
  loss), accumulating the chunk's weight gradients and producing the input gradient to send back.
  ``F`` keeps the micro-batch's backward closure (``compat.autograd.PendingVJP``), so ``B`` does
  not compute the forward again, wherever the rank's schedule allows: MindSpore 2.10 runs pending
  backward closures last-in first-out only, so the kept F..B spans must nest
  (``schedules.kept_backwards``: all of GPipe's and of the last stage's, every other one of a
  1F1B middle rank's). The rest keep only the stage input and re-run the forward for ``B``
  (``DeferredVJP``), before waiting for the gradient, so that a rank waiting for the next stage
  does the re-run meanwhile (``kept_backwards`` leaves the re-runs to the earliest micro-batches,
  whose backward waits longest).

After each round every rank posts the round's outputs to the ranks that need them, through
``comm.batch_isend_irecv`` (one global order, so blocking point-to-point cannot deadlock), and
goes on computing: on CPU the transfers run on the communication thread, and a received tensor
is waited for only by the action that reads it (the schedule's next rounds overlap the
exchange). Receive buffers have shapes known in advance (``[micro-batch, seq / sp, hidden]``),
nothing is exchanged about shapes per step.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.compat import F, float32
from ms_llm.compat.autograd import DeferredVJP, PendingVJP
from ms_llm.models.moe import collect_router_counts
from .. import comm
from .schedules import ScheduleSpec, kept_backwards, plan_rounds, transfers_after
from .weight_grad import WeightGradStore, split_weight_grads


class PipelineExecutor:
    def __init__(self, chunks: Sequence, pstate, spec: ScheduleSpec, schedule: List[list],
                 vpp: int, act_shape: Tuple[int, ...], act_dtype, grad_dtype=float32):
        """``schedule``: every rank's actions, built by ``spec`` (the schedule's record)."""
        self.chunks = list(chunks)
        self.placement = spec.placement  # which (rank, chunk) runs each virtual stage
        self.grad_dtype = grad_dtype     # of the micro-batch gradient sums (fp32, or bf16)
        self.pp, self.rank, self.vpp = pstate.sizes.pp, pstate.pp_rank, vpp
        self.pp_ranks = pstate.ranks_along("pp")
        self.rounds = plan_rounds(schedule, self.pp, vpp, placement=self.placement)
        self.num_stages = self.pp * vpp
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype
        self.params = [[p for p in c.trainable_params()] for c in self.chunks]
        # FSDP reduce-scatters a chunk's gradients on its last backward of the step only.
        self.last_backward = {a.chunk: a for a in schedule[self.rank] if a.kind == "B"}
        # (microbatch, chunk) whose backward closure F keeps alive (no forward re-run in B)
        self.kept = kept_backwards(schedule[self.rank])
        # Zero-bubble schedules: B gives the input gradient, W the linears' weight gradients.
        self.store: Optional[WeightGradStore] = None
        if spec.splits_backward:
            if any(hasattr(c, "set_requires_gradient_sync") for c in self.chunks):
                raise ValueError(f"{spec.config_name} with parallel.fsdp_size > 1 is not built: "
                                 f"FSDP reduce-scatters in B, before W's gradients")
            self.store = WeightGradStore()
            self.split_linears = sum(split_weight_grads(c, self.store) for c in self.chunks)
        self.param_index = [{id(p): i for i, p in enumerate(ps)} for ps in self.params]
        # transfers in flight: receive key -> handle, and the sends' handles
        self._recv_work: Dict[tuple, object] = {}
        self._send_work: List[object] = []
        comm.open_pairs(self.pp_ranks[r] for r in self._peers())
        # (kind, microbatch, chunk, t0, t1) with perf_counter times of the last step: "F"/"B"/"W"
        # compute spans, "R" forward re-runs for B (run before waiting for B's gradient), "comm"
        # spans (posting the round's exchange) and "wait" spans (blocked on a transfer still in
        # flight), for timelines and benchmarks.
        self.events: List[tuple] = []
        self.timed = False      # synchronise after each action (benchmarks' timelines)

    def _peers(self) -> set:
        """Pipeline ranks this rank exchanges with (its neighbours, and the ring's wrap)."""
        return {r for row in self.rounds for src, dst, *_ in
                transfers_after(row, self.pp, self.vpp, self.num_stages, self.placement)
                if self.rank in (src, dst) for r in (src, dst)} - {self.rank}

    def _await(self, act) -> None:
        """Wait for the transfer that brings ``act``'s input (nothing if it arrived)."""
        key = ("act" if act.kind == "F" else "grad", act.microbatch, act.chunk)
        work = self._recv_work.pop(key, None)
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            self._span("wait", act.microbatch, act.chunk, t0)

    def _collect_counts(self, chunk: int, keep: bool) -> None:
        """The routed-token counts of the chunk's MoE layers only (no walk of a dense chunk)."""
        for layer in self.chunks[chunk].moe_layers:
            collect_router_counts(layer, keep)

    @staticmethod
    def _sync(tensors) -> None:
        """Wait for the kernels that produced ``tensors`` (PyNative may run them later)."""
        for t in tensors:
            t.asnumpy()

    def _span(self, kind: str, mb: int, chunk: int, t0: float) -> None:
        self.events.append((kind, mb, chunk, t0, time.perf_counter()))

    def run(self, micro_batches: Sequence[dict], loss_fn: Callable) -> Tuple[Tensor, list]:
        """One step over ``micro_batches``; ``loss_fn(chunk_output, batch)`` reduces the last
        stage's per-token loss to the scalar the step differentiates. Returns this rank's summed
        loss (zero off the last stage) and the gradients of ``self.params``, chunk by chunk."""
        grads: List[Optional[list]] = [None] * len(self.chunks)
        vjps: Dict[tuple, Callable] = {}
        inbox: Dict[tuple, Tensor] = {}
        loss = Tensor(np.zeros((), np.float32))
        self.events = []
        for actions in self.rounds:
            act = actions[self.rank]
            outbox: Dict[tuple, Tensor] = {}
            if act is not None and act.kind == "B" and \
                    (act.microbatch, act.chunk) not in self.kept:
                # the forward this B re-runs runs before waiting for B's gradient
                t0 = time.perf_counter()
                vjps[(act.microbatch, act.chunk)].prepare()
                self._span("R", act.microbatch, act.chunk, t0)
            if act is not None and act.kind != "W":
                self._await(act)
            t0 = time.perf_counter()
            if act is not None:
                if act.kind == "F":
                    out = self._forward(act, micro_batches[act.microbatch], inbox, vjps, loss_fn)
                    self._collect_counts(act.chunk, keep=True)
                    aux = self.chunks[act.chunk].last_aux_loss
                    if aux is not None:      # reported with the loss, as one process does
                        loss = loss + aux
                    if self.chunks[act.chunk].last:
                        loss = loss + out
                    else:
                        outbox[("act", act.microbatch, act.chunk)] = out
                elif act.kind == "W":
                    self._weight_grads(act, grads)
                else:
                    gx = self._backward(act, inbox, vjps, grads)
                    # A re-run forward's routing was counted in F already (no-op when kept).
                    self._collect_counts(act.chunk, keep=False)
                    if gx is not None:
                        outbox[("grad", act.microbatch, act.chunk)] = gx
                if self.timed:      # finish the action's kernels so the span is its compute
                    self._sync(list(outbox.values()) + [loss] + (grads[act.chunk] or [])[-1:])
                self._span(act.kind, act.microbatch, act.chunk, t0)
            t0 = time.perf_counter()
            self._exchange(actions, outbox, inbox)
            self._span("comm", -1, -1, t0)
        t0 = time.perf_counter()
        for work in self._send_work + list(self._recv_work.values()):
            work.wait()
        self._send_work, self._recv_work = [], {}
        self._span("wait", -1, -1, t0)
        if self.store is not None and self.store.records:
            raise RuntimeError(f"pipeline: step ended with deferred weight gradients of "
                               f"{sorted(self.store.records)}")
        if vjps or inbox:
            raise RuntimeError(f"pipeline: step ended with {len(vjps)} forwards without backward "
                               f"and {len(inbox)} unread messages")
        return loss, self._flat(grads)

    def forward_only(self, batch: dict, last_fn: Callable):
        """One micro-batch through every virtual stage in the model's order, nothing kept for a
        backward (evaluation; the caller holds ``no_grad``): each rank runs the stages it holds
        and sends each output to the next stage's rank (blocking: every rank walks the same
        stage order, so sends and receives pair up). Returns ``last_fn(per-token loss)`` on the
        rank holding the last stage, None on the others."""
        extra = (batch.get("attention_mask"), batch.get("position_ids"))
        seq = batch["tokens"].shape[1]
        h, result = None, None
        for v in range(self.num_stages):
            rank, chunk = self.placement.stage_of(v, self.pp)
            if v > 0:
                h = self._pass_on(h, self.placement.stage_of(v - 1, self.pp)[0], rank)
            if rank != self.rank:
                continue
            c = self.chunks[chunk]
            out = c(batch["tokens"] if c.first else h, seq, batch["labels"], *extra,
                    tokens=batch["tokens"])
            if c.last:
                result = last_fn(out)
            else:
                h = out
        return result

    def _pass_on(self, h: Optional[Tensor], src: int, dst: int) -> Optional[Tensor]:
        """The activation between two consecutive stages' ranks (itself if one rank holds both)."""
        if src == dst or self.rank not in (src, dst):
            return h
        if self.rank == src:
            for work in comm.batch_isend_irecv([comm.P2POp("isend", h, self.pp_ranks[dst])]):
                work.wait()
            return None
        buf = F.zeros(*self.act_shape, dtype=self.act_dtype)
        for work in comm.batch_isend_irecv([comm.P2POp("irecv", buf, self.pp_ranks[src])]):
            work.wait()
        return buf

    def _flat(self, grads: List[Optional[list]]) -> list:
        """The chunks' gradients in parameter order, a parameter two chunks share (a V
        placement's first and last stage on one rank: the tied embedding) once, its gradients
        summed."""
        flat, index = [], {}
        for gs, ps in zip(grads, self.params):
            for g, p in zip(gs if gs is not None else [F.zeros_like(p) for p in ps], ps):
                if id(p) in index:
                    flat[index[id(p)]] = flat[index[id(p)]] + g
                else:
                    index[id(p)] = len(flat)
                    flat.append(g)
        return flat

    def _forward(self, act, batch, inbox, vjps, loss_fn) -> Tensor:
        chunk = self.chunks[act.chunk]
        extra = (batch.get("attention_mask"), batch.get("position_ids"))
        seq = batch["tokens"].shape[1]
        if chunk.first:
            tokens = batch["tokens"]

            def fn(*_):
                return self._finish(chunk, chunk(tokens, seq, batch["labels"], *extra,
                                                 tokens=tokens), batch, loss_fn)
            step = self._vjp_kind(act)(fn, Tensor(np.zeros((), np.float32)),
                                       self.params[act.chunk])
        else:
            x = inbox.pop(("act", act.microbatch, act.chunk))

            def fn(h):
                return self._finish(chunk, chunk(h, seq, batch["labels"], *extra,
                                                 tokens=batch["tokens"]), batch, loss_fn)
            step = self._vjp_kind(act)(fn, x, self.params[act.chunk])
        vjps[(act.microbatch, act.chunk)] = step
        return step.output

    def _vjp_kind(self, act):
        return PendingVJP if (act.microbatch, act.chunk) in self.kept else DeferredVJP

    @staticmethod
    def _finish(chunk, out, batch, loss_fn):
        return loss_fn(out, batch) if chunk.last else out

    def _backward(self, act, inbox, vjps, grads) -> Optional[Tensor]:
        chunk = self.chunks[act.chunk]
        if hasattr(chunk, "set_requires_gradient_sync"):
            chunk.set_requires_gradient_sync(act == self.last_backward[act.chunk])
        vjp = vjps.pop((act.microbatch, act.chunk))
        dy = Tensor(np.ones((), np.float32)) if chunk.last else \
            inbox.pop(("grad", act.microbatch, act.chunk))
        if self.store is not None:
            with self.store.collecting((act.microbatch, act.chunk)):
                gx, gw = vjp.backward(dy)
        else:
            gx, gw = vjp.backward(dy)
        acc = grads[act.chunk]
        gw = [g if g.dtype == self.grad_dtype else g.astype(self.grad_dtype) for g in gw]
        grads[act.chunk] = list(gw) if acc is None else [a + g for a, g in zip(acc, gw)]
        return None if chunk.first else gx[0]

    def _weight_grads(self, act, grads) -> None:
        """W: the weight gradients B deferred, added to the chunk's sums (B ran first, so the
        sums exist; the deferred entries hold zeros from B)."""
        acc, index = grads[act.chunk], self.param_index[act.chunk]
        for weight, x, dy in self.store.pop((act.microbatch, act.chunk)):
            g = WeightGradStore.weight_grad(x, dy)
            i = index[id(weight)]
            acc[i] = acc[i] + (g if g.dtype == self.grad_dtype else g.astype(self.grad_dtype))

    def _exchange(self, actions, outbox, inbox) -> None:
        ops, recv_keys = [], []
        for src, dst, kind, mb, dst_chunk in transfers_after(actions, self.pp, self.vpp,
                                                             self.num_stages, self.placement):
            if self.rank not in (src, dst):
                continue
            v_dst = self.placement.virtual_stage(dst, dst_chunk, self.pp)
            src_chunk = self.placement.stage_of(v_dst - 1 if kind == "act" else v_dst + 1,
                                                self.pp)[1]
            if src == dst:
                inbox[(kind, mb, dst_chunk)] = outbox.pop((kind, mb, src_chunk))
            elif src == self.rank:
                ops.append(comm.P2POp("isend", outbox.pop((kind, mb, src_chunk)),
                                      self.pp_ranks[dst]))
            else:
                buf = F.zeros(*self.act_shape, dtype=self.act_dtype)
                inbox[(kind, mb, dst_chunk)] = buf
                ops.append(comm.P2POp("irecv", buf, self.pp_ranks[src]))
                recv_keys.append((kind, mb, dst_chunk))
        if ops:   # posted; each receive is waited for by the action that reads it
            works = comm.batch_isend_irecv(ops)
            for op, work in zip(ops, works):
                if op.kind == "isend":
                    self._send_work.append(work)
            for key, work in zip(recv_keys, [w for o, w in zip(ops, works) if o.kind == "irecv"]):
                self._recv_work[key] = work
        if outbox:
            raise RuntimeError(f"pipeline: outputs {sorted(outbox)} were never sent")
