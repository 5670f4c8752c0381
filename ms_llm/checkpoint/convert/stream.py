"""The converter's streaming loop: source -> sink one decoder layer at a time, published by one
rename, with every tensor checked for NaN/inf on the way.

Why its own module: ``ms-llm convert``, ``ms-llm export`` (``native.export``) and the LoRA merge
all stream through it, and "complete or absent" (the output folder appears only after every
tensor was written and the source's ``check()`` found nothing left unread) must hold for all.
"""
from __future__ import annotations

import os
import shutil

import ml_dtypes
import numpy as np

from .args import ConvertError

__all__ = ["stream_to_sink", "check_finite"]


def check_finite(where: str, tensors, allow: bool):
    """``tensors`` (an array, a dict of them, or None), refusing a NaN/inf unless ``allow``:
    a converted or merged model with one is wrong in every output it produces."""
    if allow or tensors is None:
        return tensors
    items = tensors.items() if isinstance(tensors, dict) else [("", tensors)]
    for name, x in items:
        if isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16) \
                and not np.isfinite(x).all():
            raise ConvertError(f"{where}{' ' + name if name else ''} holds a non-finite value "
                               f"(NaN/inf); pass --allow-non-finite to convert it anyway")
    return tensors


def stream_to_sink(src, sink, tmp: str, out: str, *, progress=None, check=None,
                   allow_nonfinite: bool = False) -> str:
    """Copy ``src`` into ``sink`` one layer at a time (memory stays near one layer), then
    publish the folder ``tmp`` as ``out`` by renaming it. On any failure the sink is aborted and
    ``tmp`` removed, so ``out`` is either complete or absent. ``check()`` runs before the sink
    is closed (e.g. to reject source tensors that nothing consumed). Every tensor is checked for
    NaN/inf on the way (unless ``allow_nonfinite``)."""
    ok = allow_nonfinite
    try:
        sink.embedding(check_finite("embedding", src.embedding(), ok))
        n = src.spec.num_layers
        for i in range(n):
            sink.layer(i, check_finite(f"decoder layer {i}", src.layer(i), ok))
            if progress:
                progress(i + 1, n)
        output = check_finite("output layer", src.output(), ok)
        for j in range(src.spec.mtp_layers):
            sink.mtp_layer(j, check_finite(f"MTP depth {j}", src.mtp_layer(j), ok), output)
        sink.final(check_finite("final norm", src.final_norm(), ok), output)
        if check is not None:
            check()
        sink.close()
    except BaseException:
        sink.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    return out
