"""Low-precision training: OCP MX formats and MXFP8 module replacement.

``to_mx``/``MXTensor`` (``mx``), the differentiable ``mx_linear`` (``mx_linear``), the MXFP8
modules (``modules``), ``apply_quantization`` for the run config's ``quant:`` section (``apply``)
and the Ascend-native vs emulated choice (``_dispatch``).
"""
from .mx import BLOCK_SIZE, ELEM_FORMATS, MXTensor, fake_quantize, to_mx
from .mx_linear import mx_linear
from .modules import MXFP8GroupedLinear, MXFP8GroupedMLP, MXFP8Linear
from .apply import apply_quantization, kept_unaligned, register_replacement

__all__ = ["BLOCK_SIZE", "ELEM_FORMATS", "MXTensor", "fake_quantize", "to_mx", "mx_linear",
           "MXFP8Linear", "MXFP8GroupedLinear", "MXFP8GroupedMLP", "apply_quantization", "kept_unaligned",
           "register_replacement"]
