"""One Megatron-style log line per logged step, mirrored as JSON in ``metrics.jsonl``."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Dict, Optional


def peak_rss_gb() -> float:
    """Peak resident memory of this process (since ``reset_peak_rss``, where that worked).
    MindSpore's memory stats read 0 on CPU and its pool never returns memory, so the OS
    high-water mark is the honest figure."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 ** 2)


def reset_peak_rss() -> bool:
    """Restart the high-water mark from the current RSS (Linux >= 4.0: ``5`` written to
    ``/proc/self/clear_refs`` resets ``VmHWM``, which ``ru_maxrss`` reports). The trainer calls
    it just before building the model, so the logged peak is training's, not a transient of the
    data set-up before it (reading and tokenizing the corpus). False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_gb() -> float:
    """Resident memory now (``VmRSS``). Taken just before the model is built, it is the baseline
    (interpreter, MindSpore, data) that ``ms-llm plan``'s predicted peak is compared above."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1024 ** 2)
    return 0.0


class MetricsLogger:
    def __init__(self, output_dir: str, max_steps: int, enabled: bool = True,
                 progress_bar: bool = True, start_step: int = 0,
                 rss_before_model_gb: Optional[float] = None, append: bool = False,
                 flops_per_token: Optional[int] = None, peak_tflops: Optional[float] = None,
                 num_devices: int = 1):
        self.enabled = enabled
        # MFU as Megatron ("TFLOP/s/GPU") and torchtitan report it: per device (ms_llm.planning.flops)
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.num_devices = max(1, num_devices)
        self.rss_before_model_gb = rss_before_model_gb
        self.max_steps = max_steps
        self.t0 = time.time()
        self.start_step = start_step
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._bar = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if start_step == 0 and not append and os.path.exists(self.path):
                os.remove(self.path)  # a fresh run starts a fresh file (a restart appends)
            # A bar only on a terminal; under msrun stdout is a log file, where each logged line
            # carries progress and ETA instead.
            if progress_bar and sys.stderr.isatty():
                from tqdm import tqdm
                self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step",
                                 dynamic_ncols=True, mininterval=1.0, leave=False)

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, tokens: int,
            step_time: float, consumed_samples: int, global_batch_size: int,
            extra: Optional[dict] = None) -> dict:
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                  "step_time_s": step_time, "elapsed_s": time.time() - self.t0,
                  "consumed_samples": consumed_samples, "peak_rss_gb": peak_rss_gb()}
        if self.flops_per_token:
            from ms_llm.planning.flops import achieved
            perf = achieved(tokens, step_time * self.num_devices, self.flops_per_token,
                            self.peak_tflops or 0.0)
            record.update(tflops_per_device=perf["tflops"], mfu=perf["mfu"],
                          peak_tflops=self.peak_tflops, model_flops_per_token=self.flops_per_token)
        if self.rss_before_model_gb is not None:
            record["rss_before_model_gb"] = self.rss_before_model_gb
        if extra:
            record.update(extra)
        if not self.enabled:
            return record
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        line = (f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {step:8d}/{self.max_steps:8d}"
                f" | consumed samples: {consumed_samples:10d}"
                f" | elapsed time per iteration (ms): {step_time * 1000:.1f}"
                f" | learning rate: {lr:.6E} | global batch size: {global_batch_size:5d}"
                f" | lm loss: {loss:.6E} | grad norm: {grad_norm:.4f}"
                f" | tokens/s: {record['tokens_per_s']:.1f}"
                + (f" | TFLOP/s/device: {record['tflops_per_device']:.3f}"
                   f" | MFU: {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                + f" | elapsed: {record['elapsed_s']:.1f} s"
                f" | mem: {record['peak_rss_gb']:.2f} GB | {self._progress(step)} |"
                + (f" slowest rank {record['slowest_rank']}: "
                   f"{record['step_time_max_s'] * 1000:.1f} ms |" if "slowest_rank" in record
                   else "")
                + (f" skipped steps: {record['skipped_steps']} |" if "skipped_steps" in record
                   else "")
                + "".join(f" {k}: {v:.6E} |" for k, v in (extra or {}).items()
                          if isinstance(v, float) and k != "step_time_max_s"))   # scalar metrics (DPO rewards)
        if self._bar is not None:
            self._bar.write(line)
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        else:
            print(line, flush=True)
        return record

    def log_eval(self, step: int, values: dict) -> dict:
        """An evaluation row (``eval_loss``, ``eval_ppl``...) and Megatron's validation line."""
        record = {"step": step, **values}
        if not self.enabled:
            return record
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        line = f" validation loss at iteration {step} |" + "".join(
            f" {k}: {v:.6E} |" for k, v in values.items())
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)
        return record

    def _progress(self, step: int) -> str:
        done = step - self.start_step
        left = self.max_steps - step
        eta = (time.time() - self.t0) / done * left if done > 0 else 0.0
        return f"{100.0 * step / self.max_steps:.0f}% eta {int(eta // 60)}m{int(eta % 60):02d}s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def slowest_rank(step_time: float, world: int) -> Dict[str, float]:
    """Every worker's step time gathered (one tiny all-gather per logged step): the slowest
    rank and its time, so a straggler shows in the step log."""
    if world == 1:
        return {}
    import numpy as np
    from mindspore import Tensor, float32, mint
    from ms_llm.parallel import comm
    mine = Tensor(np.array([step_time], np.float32))
    times = [mint.zeros((1,), dtype=float32) for _ in range(world)]
    comm.all_gather(times, mine, group=comm.world_group())
    values = [float(t.asnumpy()[0]) for t in times]
    r = int(np.argmax(values))
    return {"step_time_max_s": values[r], "slowest_rank": r}


def step_extras(guard, skipped: bool, step_time: float,
                world: int) -> Dict[str, object]:
    out: Dict[str, object] = slowest_rank(step_time, world)
    if guard.policy == "skip":
        out.update(skipped=bool(skipped), skipped_steps=guard.skipped)
    return out
