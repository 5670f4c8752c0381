"""TensorBoard event files with Megatron-LM's tags and x-axes (``training.tensorboard_dir``).

Written with the ``tensorboard`` package's own event-file writer and protobufs (the writer
``torch.utils.tensorboard`` uses), by rank 0 (which holds every logged value: the loss is
all-reduced before logging). Tags are Megatron's:

* per iteration (x = iteration) and again against consumed samples (tag ``"<tag> vs samples"``,
  x = consumed samples, in the sub-run ``samples/``): ``lm loss``, ``learning-rate``,
  ``grad-norm``, ``batch-size``, and the MTP depths' ``mtp_<k> loss``, the DPO
  ``rewards/*``, ``skipped-steps``;
* per iteration: ``throughput`` (model TFLOP/s per device, Megatron's ``--log-throughput``),
  ``tokens-per-sec``, ``iteration-time``, ``mem-peak-rss-bytes`` (MindSpore's allocator stats
  read 0 on CPU, so the process high-water mark stands in for Megatron's ``mem-*-bytes``), and
  for MoE models ``load_balancing_loss`` (rank 0's routers' auxiliary losses of the step's last
  micro-batch, summed over its MoE layers; includes the z-loss when that is on);
* validation: ``lm loss validation`` and ``lm loss validation ppl`` (DPO: ``<metric>
  validation``), per iteration and vs samples;
* timers (``training.log_timers_to_tensorboard``, level > 0): ``<name>-time``, the max over
  ranks in ms, as Megatron's ``Timers.write``;
* the resolved run config as text (tag ``config``).

``num-zeros`` and ``loss-scale`` are not written: ms-llm computes no zero count and has no fp16
loss scaling. A resumed run writes to the same folder and first records a ``SessionLog.START``
at its first step; TensorBoard (``EventAccumulator``'s purge of orphaned data) then drops the
earlier run's events from that step on, so each step appears once even when the earlier run got
past its last checkpoint. The samples axis is a separate sub-run because that purge goes by the
event's x value.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

# metrics.jsonl key -> Megatron tag, written against iterations and consumed samples
_BOTH_AXES = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
              "skipped_steps": "skipped-steps"}
# metrics.jsonl key -> tag (x = iteration only)
_ITERATION_ONLY = {"tflops_per_device": "throughput", "tokens_per_s": "tokens-per-sec",
                   "step_time_s": "iteration-time", "moe_aux_loss": "load_balancing_loss"}


def tag_for(key: str) -> Optional[str]:
    """The Megatron tag of a metrics.jsonl key logged on the step line, or None."""
    if key in _BOTH_AXES:
        return _BOTH_AXES[key]
    if key in _ITERATION_ONLY:
        return _ITERATION_ONLY[key]
    if key.startswith("mtp_") and key.endswith("_loss"):
        return key[:-len("_loss")] + " loss"      # mtp_1_loss -> "mtp_1 loss" (Megatron)
    if key.startswith("rewards/"):
        return key
    return None


def eval_tag_for(key: str) -> Optional[str]:
    """Validation keys: ``eval_loss`` -> ``lm loss validation`` (Megatron's names)."""
    if key == "eval_loss":
        return "lm loss validation"
    if key == "eval_ppl":
        return "lm loss validation ppl"
    if key.startswith("eval_"):
        return key[len("eval_"):] + " validation"
    return None


class TensorBoardWriter:
    """One writer per run folder (iterations) plus ``samples/`` (consumed samples)."""

    def __init__(self, logdir: str, start_step: int = 0, start_samples: int = 0):
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ImportError("training.tensorboard_dir needs the tensorboard package: "
                              "pip install tensorboard") from None
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self._it = EventFileWriter(logdir, flush_secs=10)
        self._samples = EventFileWriter(os.path.join(logdir, "samples"), flush_secs=10)
        # Everything at or after the first step this run logs belongs to this run.
        self._start(self._it, start_step + 1)
        self._start(self._samples, start_samples + 1)

    @staticmethod
    def _start(writer, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        writer.add_event(Event(wall_time=time.time(), step=step,
                               session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int, samples: Optional[int] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return      # lists and dicts of the record (e.g. per-rank optimizer bytes)
        now = time.time()
        self._it.add_event(Event(wall_time=now, step=int(step), summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=float(value))])))
        if samples is not None:
            self._samples.add_event(Event(wall_time=now, step=int(samples), summary=Summary(
                value=[Summary.Value(tag=f"{tag} vs samples", simple_value=float(value))])))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """A text summary (TensorBoard's Text tab), as the text plugin stores it."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=DT_STRING, string_val=[text.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._it.add_event(Event(wall_time=time.time(), step=step, summary=Summary(
            value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)])))

    def log_record(self, record: Dict[str, Any], batch_size: Optional[int] = None) -> None:
        """A metrics.jsonl step row under Megatron's tags."""
        step, samples = record["step"], record.get("consumed_samples")
        for key, value in record.items():
            tag = tag_for(key)
            if tag is None:
                continue
            both = key in _BOTH_AXES or key.startswith(("mtp_", "rewards/"))
            self.scalar(tag, value, step, samples if both else None)
        if batch_size is not None:
            self.scalar("batch-size", batch_size, step, samples)
        if "peak_rss_gb" in record:
            self.scalar("mem-peak-rss-bytes", record["peak_rss_gb"] * 1024 ** 3, step)

    def log_eval(self, step: int, values: Dict[str, float], samples: Optional[int]) -> None:
        for key, value in values.items():
            tag = eval_tag_for(key)
            if tag is not None:
                self.scalar(tag, value, step, samples)

    def log_timers(self, step: int, stats: Dict[str, Dict[str, float]]) -> None:
        for name, mm in stats.items():
            self.scalar(f"{name}-time", mm["max"], step)

    def log_config(self, config: dict) -> None:
        """The resolved config, as Megatron's ``config`` text (a JSON code block)."""
        self.text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def flush(self) -> None:
        self._it.flush()
        self._samples.flush()

    def close(self) -> None:
        self._it.close()
        self._samples.close()
