"""Which device MindSpore runs on, set once per process.

Every device-dependent choice in ms_llm (which kernel exists, which fallback to use) asks this
module, so model code never checks the device itself.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import mindspore as ms
from mindspore.ops import constexpr

from .environment import explicit, setting
from .private_api import ascend_plugin_error, device_chosen_by_caller

_STATE = {"device": None, "threads": None}
log = logging.getLogger("ms_llm.compat")


class DeviceUnavailableError(RuntimeError):
    """The device (or a kernel path) the run asked for cannot be used here; the message is one
    line naming the setting and the reason."""


def setup_device(device: Optional[str] = None, *, threads: Optional[int] = None,
                 synchronize: Optional[bool] = None) -> str:
    """Select the device ("CPU" or "Ascend") and PyNative mode; idempotent.

    When MindSpore already runs on a device in this process (a kernel executed, communication
    was initialised, or the caller chose one with ``mindspore.set_device``), that device is
    adopted instead of set: MindSpore refuses ``set_device`` once its runtime has started, and
    library users should not have to call ms_llm before their own first op. Asking for another
    device than the running one is an error.

    ``threads`` sets MindSpore's CPU kernel pool. It defaults to 1 on CPU: with >= 2 threads every
    elementwise kernel stalls ~4 ms on small VMs while matmul stays multi-threaded regardless.
    MindSpore allows setting it only once per process.
    ``synchronize`` makes PyNative errors surface at the failing op instead of leaking into later
    ops; ``runtime.sync_ops`` sets it, by default on for CPU and off on Ascend
    (``sync_ops_default``)."""
    if _STATE["device"] is None:
        running = _running_device()
        configured = setting("training.device")
        configured = None if configured == "auto" else configured
        wanted = _normalise(device or configured or running or _detect())
        if running is None:
            if wanted == "Ascend" and not ascend_available():
                raise DeviceUnavailableError(f"device Ascend asked for (training.device), but "
                                             f"MindSpore {ms.__version__} cannot use it: "
                                             f"{ascend_unavailable_reason()}")
            ms.set_device(wanted)
        elif running != wanted:
            raise RuntimeError(f"device: MindSpore already runs on {running} in this process, "
                               f"cannot switch to {wanted}")
        if synchronize is None:
            synchronize = sync_ops_default(wanted)
        ms.set_context(mode=ms.PYNATIVE_MODE)
        if synchronize:   # the non-deprecated form of set_context(pynative_synchronize=True)
            ms.runtime.launch_blocking()
        _STATE["device"] = wanted
    elif device is not None and _normalise(device) != _STATE["device"]:
        raise RuntimeError(f"device already set to {_STATE['device']}, cannot switch to "
                           f"{_normalise(device)}")
    if _STATE["device"] == "CPU" and _STATE["threads"] is None:
        _set_cpu_threads(threads)
    return _STATE["device"]


def sync_ops_default(device: str) -> bool:
    """``runtime.sync_ops`` when set, else on for CPU only. On small CPU VMs handing every op to
    MindSpore's async launch thread costs more than it saves (measured: the 50M-model PyNative
    forward+backward took 6.4-7.0 s synchronous against 9.3-9.9 s asynchronous); on an NPU the
    asynchronous launch is what keeps the device busy, and nothing was measured there."""
    value = setting("runtime.sync_ops")
    if value is None or not explicit("runtime.sync_ops"):
        return device == "CPU"
    return bool(value)


def _normalise(device: str) -> str:
    name = {"cpu": "CPU", "ascend": "Ascend", "npu": "Ascend"}.get(device.lower(), device)
    if name not in ("CPU", "Ascend"):
        raise ValueError(f"device: unsupported value {device!r} (expected CPU or Ascend)")
    return name


def _running_device() -> Optional[str]:
    """The device MindSpore is already committed to in this process, or None.

    Committed means its runtime has started (``mindspore.hal.is_initialized``) or the caller
    picked it with ``mindspore.set_device``; in both cases calling ``set_device`` again would
    either raise or override the caller's device id.
    """
    target = ms.get_context("device_target")
    if target not in ("CPU", "Ascend"):
        return None
    if ms.hal.is_initialized(target) or device_chosen_by_caller():
        return target
    return None


def _set_cpu_threads(threads: Optional[int]) -> None:
    n = threads if threads is not None else int(setting("runtime.cpu_threads"))
    try:
        ms.device_context.cpu.op_tuning.threads_num(n)
    except RuntimeError:  # already set by the user in this process: keep theirs
        pass
    _STATE["threads"] = n


def ascend_available() -> bool:
    """Whether this MindSpore loaded its Ascend plugin (its own check, without its log lines)."""
    return not ascend_unavailable_reason()


def ascend_unavailable_reason() -> str:
    """'' when MindSpore can use Ascend, else why not, on one line: the plugin's load error
    (``mindspore.device_context.ascend.is_available`` logs the same) or "CPU build"."""
    error = ascend_plugin_error()
    if error is None:
        return ""
    return " ".join(error.split()) or "this MindSpore package has no Ascend plugin (CPU build)"


def _detect() -> str:
    # MindSpore's own default target, as installed: "Ascend" for the Ascend wheel, "CPU" otherwise.
    target = ms.get_context("device_target")
    if target == "Ascend":
        return "Ascend"
    if _looks_like_an_ascend_host():   # NPUs here, but MindSpore cannot use them: say why
        log.warning("device auto: running on CPU although this host has Ascend NPUs: %s",
                    ascend_unavailable_reason() or "MindSpore's default target is CPU")
    return "CPU"


def _looks_like_an_ascend_host() -> bool:
    return os.path.exists("/dev/davinci0") or bool(os.environ.get("ASCEND_HOME_PATH"))


def device() -> str:
    """The active device name; sets up the default device on first use."""
    return _STATE["device"] or setup_device()


# constexpr: under mindspore.jit this runs once at compile time and becomes a graph constant
# (a constexpr needs an argument, or graph autodiff fails with "Fail to find user").
@constexpr
def _device_is(name: str) -> bool:
    return device() == name


def is_cpu() -> bool:
    return _device_is("CPU")


def is_ascend() -> bool:
    return _device_is("Ascend")


def bf16_graph_supported() -> bool:
    """Whether a bf16 model can be captured by ``mindspore.jit`` on this device. MindSpore 2.10's
    CPU graph mode has no bf16 ``TensorMove`` kernel ("Select CPU operator[TensorMove] fail!
    Unsupported data type! ... get input[BFloat16]", inserted for the bf16 embedding table) and
    no bf16 ``Reshape`` (its CPU kernel lists every dtype but bf16; PyNative reshapes are views
    and need none), so bf16 training on CPU runs in PyNative there. With ms-llm's embedding and
    casts as Custom ops the capture gets as far as the first reshape of the fused QKV output;
    what would remain is carrying bf16 as a 16-bit integer container through every reshape.
    Re-probe on a newer MindSpore."""
    if not is_cpu():
        return True
    return not ms.__version__.startswith("2.10.")
