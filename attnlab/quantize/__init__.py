"""Weight-only quantization: int8 per output channel, int4 group-wise; see handler.py."""

from attnlab.quantize.handler import (
    DEFAULT_GROUP_SIZE,
    SCHEMES,
    LogitError,
    QuantScheme,
    float_misfits,
    linear_names,
    logit_error,
    make_scheme,
    quantize_model,
    quantize_state_dict,
    quantized_like,
    read_scheme,
    swap_modules,
    without_kernels,
)
from attnlab.quantize.int4 import Int4Linear, dequantize_int4, quantize_int4
from attnlab.quantize.int8 import Int8Linear, dequantize_int8, quantize_int8

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "SCHEMES",
    "Int4Linear",
    "Int8Linear",
    "LogitError",
    "QuantScheme",
    "dequantize_int4",
    "dequantize_int8",
    "float_misfits",
    "linear_names",
    "logit_error",
    "make_scheme",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantize_state_dict",
    "quantized_like",
    "read_scheme",
    "swap_modules",
    "without_kernels",
]
