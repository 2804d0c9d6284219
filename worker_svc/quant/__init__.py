"""Quantized weights: FP8 (per-channel or per-tensor scales) and AWQ 4-bit.

A quantized linear layer keeps only the shape of its plain weight and multiplies through
a prepared weight (`Fp8Weight`, `AwqWeight`: `matmul.PreparedWeight`) set as its
`packed_weight`. `config.py` decides what a load uses, `loading.py` fills the layers.
"""

from worker_svc.quant.awq import AwqWeight, dequantize_awq
from worker_svc.quant.config import QUANTIZATION_CHOICES, QuantConfig, resolve_quantization
from worker_svc.quant.fp8 import Fp8Weight, dequantize_fp8, quantize_fp8_per_channel

__all__ = [
    "QUANTIZATION_CHOICES",
    "AwqWeight",
    "Fp8Weight",
    "QuantConfig",
    "dequantize_awq",
    "dequantize_fp8",
    "quantize_fp8_per_channel",
    "resolve_quantization",
]
