"""Which quantization a load uses: the `--quantization` flag against the checkpoint's
`quantization_config` (config.json), parsed once into a `QuantConfig`.

Checkpoint layouts read (the ones vLLM reads):
- vLLM FP8: {"quant_method": "fp8", "activation_scheme": ..., "ignored_layers": [...]};
  `<layer>.weight` float8_e4m3fn [out, in], `<layer>.weight_scale` fp32 per tensor.
- llm-compressor FP8: {"quant_method": "compressed-tensors", "format": "float-quantized",
  "config_groups": {...: {"weights": {"num_bits": 8, "type": "float", "strategy":
  "tensor" | "channel"}, "targets": ["Linear"]}}, "ignore": ["lm_head", ...]};
  `weight_scale` is [] / [1] per tensor or [out, 1] per channel.
- AutoAWQ: {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
  "version": "gemm"}; `qweight`, `qzeros`, `scales` (see awq.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

QUANTIZATION_CHOICES = ("auto", "none", "fp8", "awq")


@dataclass(frozen=True)
class QuantConfig:
    method: str = "none"  # none | fp8 | awq
    # fp8: True when the checkpoint holds FP8 tensors, False to quantize a plain one at load.
    from_checkpoint: bool = False
    fp8_per_channel: bool = True  # the checkpoint's weight_scale is [out, 1], not a scalar
    group_size: int = 0  # awq: input features per scale / zero point
    ignore: tuple[str, ...] = ()  # checkpoint layer names (or "re:" patterns) left unquantized

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_CHOICES[1:]:
            raise ValueError(f"unknown quantization {self.method!r}")
        if self.method == "awq" and self.group_size <= 0:
            raise ValueError(f"AWQ group_size must be positive, got {self.group_size}")

    def quantizes(self, layer_name: str) -> bool:
        """Whether checkpoint linear `layer_name` (e.g. model.layers.0.mlp.up_proj) is
        stored quantized."""
        if self.method == "none":
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], layer_name):
                    return False
            elif pattern == layer_name:
                return False
        return True


def checkpoint_quantization(quantization_config: dict | None) -> QuantConfig:
    """Parse config.json's `quantization_config`; raises on layouts we cannot run."""
    if not quantization_config:
        return QuantConfig()
    method = quantization_config.get("quant_method")
    if method == "fp8":
        if quantization_config.get("weight_block_size"):
            raise ValueError("block-wise FP8 checkpoints (weight_block_size) are not supported")
        return QuantConfig(
            "fp8",
            from_checkpoint=True,
            fp8_per_channel=False,
            ignore=tuple(quantization_config.get("ignored_layers") or ()),
        )
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config)
    if method == "awq":
        return _awq(quantization_config)
    raise ValueError(
        f"checkpoint quantization {method!r} is not supported; "
        "supported: fp8, compressed-tensors (float-quantized FP8), awq"
    )


def _compressed_tensors(config: dict) -> QuantConfig:
    if config.get("format") != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {config.get('format')!r} is not "
            "supported; only 'float-quantized' (FP8)"
        )
    strategies = set()
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(
                f"compressed-tensors weights {weights} are not FP8 (num_bits 8, type float)"
            )
        strategies.add(weights.get("strategy"))
    if not strategies or not strategies <= {"tensor", "channel"} or len(strategies) > 1:
        raise ValueError(
            f"compressed-tensors FP8 weight strategy {sorted(map(str, strategies))} "
            "is not supported; one of 'tensor' or 'channel'"
        )
    return QuantConfig(
        "fp8",
        from_checkpoint=True,
        fp8_per_channel=strategies == {"channel"},
        ignore=tuple(config.get("ignore") or ()),
    )


def _awq(config: dict) -> QuantConfig:
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ with bits={bits} is not supported; only 4-bit")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; only 'gemm'")
    if not config.get("zero_point", True):
        raise ValueError("AWQ without zero points is not supported")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"AWQ group_size must be a positive integer, got {group_size!r}")
    return QuantConfig(
        "awq",
        from_checkpoint=True,
        group_size=group_size,
        # AutoAWQ skips every module whose name contains one of these.
        ignore=tuple(
            f"re:.*{re.escape(key)}" for key in config.get("modules_to_not_convert") or ()
        ),
    )


def resolve_quantization(flag: str, quantization_config: dict | None) -> QuantConfig:
    """The `--quantization` flag ("auto" = what the checkpoint says) against the checkpoint."""
    if flag not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {flag!r}; choose one of {QUANTIZATION_CHOICES}")
    stored = checkpoint_quantization(quantization_config)
    if flag == "auto" or flag == stored.method:
        return stored
    if stored.method != "none":
        raise ValueError(
            f"the checkpoint is {stored.method}-quantized; load it with "
            f"--quantization {stored.method} or auto, not {flag}"
        )
    if flag == "fp8":
        return QuantConfig("fp8", from_checkpoint=False)
    if flag == "awq":
        raise ValueError(
            "--quantization awq needs an AWQ checkpoint (AutoAWQ's layout); "
            "a plain checkpoint can be quantized at load with fp8"
        )
    return stored
