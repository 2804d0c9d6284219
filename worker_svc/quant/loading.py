"""Loading quantized linear layers: which checkpoint slice each quantized tensor is, and
assembling a layer's parts (q|k|v, gate|up) into one `Fp8Weight` / `AwqWeight`.

`QuantizedLoad` sits between the checkpoint stream and `LlamaForCausalLM.load_weights`:
it selects and consumes the quantized tensors (and, for FP8 at load, the plain weights of
the layers it quantizes) and passes every other tensor on. The model's plain weights of
those layers are freed before the model is materialised, so the full-precision weights
never exist in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from worker_svc.model.layers import MergedLinear
from worker_svc.model.llama import STACKED_PARTS, LlamaForCausalLM, checkpoint_leaf
from worker_svc.model.parallel_layers import Index, RowParallelLinear
from worker_svc.quant.awq import AWQ_PACK, AwqWeight
from worker_svc.quant.config import QuantConfig
from worker_svc.quant.fp8 import FP8_DTYPE, Fp8Weight, quantize_fp8_per_channel

FP8_SUFFIXES = ("weight", "weight_scale", "input_scale")
AWQ_SUFFIXES = ("qweight", "qzeros", "scales")


@dataclass
class _QuantLayer:
    """One quantized module and the parts its checkpoint tensors fill."""

    module: MergedLinear | RowParallelLinear
    in_features: int
    parts: dict[str | None, tuple[int, int]]  # part -> (row offset, rows) in the output dim
    in_start: int | None = None  # row-parallel: this rank's first input feature
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    filled: set[tuple[str | None, str]] = field(default_factory=set)

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.parts.values())


class QuantizedLoad:
    """Built on the meta-device model before it is materialised (see `free_weights`)."""

    def __init__(self, model: LlamaForCausalLM, quant: QuantConfig) -> None:
        self.model = model
        self.quant = quant
        self.layers: dict[str, _QuantLayer] = {}  # module path -> layer
        for path, module in model.named_modules():
            in_start = None
            if isinstance(module, MergedLinear):
                parts = {
                    p: (module.part_offsets[p], module.part_sizes[p]) for p in module.part_sizes
                }
                names = [f"{path.rpartition('.')[0]}.{checkpoint_leaf(path, p)}" for p in parts]
            elif isinstance(module, RowParallelLinear):
                parts = {None: (0, module.weight.shape[0])}
                names = [path]
                in_start = module.in_start
            else:
                continue
            quantized = [quant.quantizes(name) for name in names]
            if any(quantized) and not all(quantized):
                raise ValueError(
                    f"{names} are loaded into one fused layer, so they must be "
                    "quantized alike; the checkpoint quantizes only some"
                )
            if all(quantized):
                self.layers[path] = _QuantLayer(module, module.weight.shape[1], parts, in_start)
        self._check_shapes()

    def _check_shapes(self) -> None:
        if self.quant.method != "awq":
            return
        for path, layer in self.layers.items():
            for part, (_, size) in layer.parts.items():
                if size % AWQ_PACK:
                    raise ValueError(
                        f"AWQ: {path} {part or ''} holds {size} output features "
                        f"on this rank, not a multiple of {AWQ_PACK}"
                    )
            if layer.in_features % self.quant.group_size:
                raise ValueError(
                    f"AWQ: {path} holds {layer.in_features} input features on this rank, not "
                    f"a whole number of groups of {self.quant.group_size}; use a tp_size "
                    "that splits the input dimension on group boundaries"
                )

    def free_weights(self) -> None:
        """Replace each quantized layer's plain weight by an empty one (only `in` survives)."""
        for layer in self.layers.values():
            weight = layer.module.weight
            layer.module.weight = nn.Parameter(
                torch.empty((0, layer.in_features), dtype=weight.dtype, device=weight.device),
                requires_grad=False,
            )

    def _locate(self, name: str) -> tuple[_QuantLayer, str | None, str] | None:
        """Checkpoint name -> (layer, part, suffix) when it is a tensor of a quantized layer."""
        module_path, _, suffix = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        part = None
        if leaf in STACKED_PARTS:
            fused, part = STACKED_PARTS[leaf]
            module_path = f"{parent}.{fused}"
        layer = self.layers.get(module_path)
        suffixes = AWQ_SUFFIXES if self.quant.method == "awq" else FP8_SUFFIXES
        if layer is None or suffix not in suffixes:
            return None
        return layer, part, suffix

    def select(self, name: str) -> Index | None:
        """`checkpoint_slice` for quantized tensors too: the plain weight's slice, translated
        to the tensor's layout."""
        located = self._locate(name)
        if located is None:
            return self.model.checkpoint_slice(name)
        layer, _, suffix = located
        base = self.model.checkpoint_slice(f"{name.rpartition('.')[0]}.weight")
        if base is None or suffix == "input_scale":
            return None  # another stage's layer; activations are not quantized
        if suffix == "weight":
            if not self.quant.from_checkpoint and len(base) == 2:
                # Quantizing at load: scales over whole rows, so every tp_size quantizes
                # alike; this rank cuts its columns after (one layer's rows, briefly).
                return base[:1]
            return base
        if suffix == "weight_scale":
            if not self.quant.fp8_per_channel:
                return ()  # a scalar: every rank reads it
            return base if len(base) == 1 else (slice(None),)  # scales follow output rows
        return _awq_slice(suffix, base, self.quant.group_size)

    def wrap(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Consume the quantized layers' tensors, yield the rest; when the stream ends every
        quantized layer has its prepared weight (or this raises naming what is missing)."""
        for name, tensor in weights:
            located = self._locate(name)
            if located is None:
                yield name, tensor
                continue
            layer, part, suffix = located
            if suffix != "input_scale":
                self._fill(layer, part, suffix, tensor)
        missing = [
            f"{path}/{part}:{kind}"
            for path, layer in self.layers.items()
            for part, kind in self._needed(layer)
            if (part, kind) not in layer.filled
        ]
        if missing:
            raise ValueError(
                f"quantized checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}"
            )
        for layer in self.layers.values():
            layer.module.packed_weight = self._prepared(layer)
            layer.buffers.clear()

    def _needed(self, layer: _QuantLayer) -> list[tuple[str | None, str]]:
        if self.quant.method == "awq":
            kinds = AWQ_SUFFIXES
        else:
            kinds = ("weight", "weight_scale") if self.quant.from_checkpoint else ("weight",)
        return [(part, kind) for part in layer.parts for kind in kinds]

    def _fill(
        self, layer: _QuantLayer, part: str | None, suffix: str, tensor: torch.Tensor
    ) -> None:
        device = layer.module.weight.device
        if not layer.buffers:
            layer.buffers = self._allocate(layer, device)
        offset, size = layer.parts[part]
        if self.quant.method == "awq":
            _fill_awq(layer, offset, size, suffix, tensor.to(device))
        elif suffix == "weight" and not self.quant.from_checkpoint:
            q, scale = quantize_fp8_per_channel(tensor.to(device))
            if layer.in_start is not None:
                q = q[:, layer.in_start : layer.in_start + layer.in_features]
            _copy_rows(layer.buffers["weight"], offset, size, q, f"{part} weight")
            _copy_rows(layer.buffers["scale"], offset, size, scale, f"{part} scale")
            layer.filled.add((part, "weight_scale"))
        elif suffix == "weight":
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"FP8 checkpoint: {part or ''} weight is {tensor.dtype}, expected {FP8_DTYPE}"
                )
            _copy_rows(layer.buffers["weight"], offset, size, tensor.to(device), f"{part} weight")
        else:  # weight_scale: a scalar (expanded to the part's rows) or [rows, 1]
            scale = tensor.to(device, torch.float32).reshape(-1)
            if scale.numel() == 1:
                scale = scale.expand(size)
            _copy_rows(layer.buffers["scale"], offset, size, scale, f"{part} weight_scale")
        layer.filled.add((part, suffix))

    def _allocate(self, layer: _QuantLayer, device: torch.device) -> dict[str, torch.Tensor]:
        out, inp = layer.out_features, layer.in_features
        if self.quant.method == "fp8":
            return {
                "weight": torch.empty(out, inp, dtype=FP8_DTYPE, device=device),
                "scale": torch.empty(out, dtype=torch.float32, device=device),
            }
        groups = inp // self.quant.group_size
        return {
            "qweight": torch.empty(inp, out // AWQ_PACK, dtype=torch.int32, device=device),
            "qzeros": torch.empty(groups, out // AWQ_PACK, dtype=torch.int32, device=device),
            "scales": torch.empty(groups, out, dtype=torch.float16, device=device),
        }

    def _prepared(self, layer: _QuantLayer) -> Fp8Weight | AwqWeight:
        b = layer.buffers
        if self.quant.method == "fp8":
            return Fp8Weight(b["weight"], b["scale"])
        return AwqWeight(b["qweight"], b["qzeros"], b["scales"], self.quant.group_size)


def _copy_rows(
    target: torch.Tensor, offset: int, size: int, tensor: torch.Tensor, what: str
) -> None:
    rows = target[offset : offset + size]
    if rows.shape != tensor.shape:
        raise ValueError(f"{what}: expected {tuple(rows.shape)}, got {tuple(tensor.shape)}")
    rows.copy_(tensor)


def _fill_awq(
    layer: _QuantLayer, offset: int, size: int, suffix: str, tensor: torch.Tensor
) -> None:
    """AWQ tensors are [in or groups, out (/ 8)]: a part is a range of columns."""
    target = layer.buffers[suffix]
    pack = 1 if suffix == "scales" else AWQ_PACK
    cols = target[:, offset // pack : (offset + size) // pack]
    if cols.shape != tensor.shape:
        raise ValueError(f"AWQ {suffix}: expected {tuple(cols.shape)}, got {tuple(tensor.shape)}")
    cols.copy_(tensor)


def _awq_slice(suffix: str, base: Index, group_size: int) -> Index:
    """The plain weight's slice (rows of [out, in], or columns for row-parallel layers)
    -> the slice of an AWQ tensor, whose layout is [in, out]."""
    pack = 1 if suffix == "scales" else AWQ_PACK
    per_row = 1 if suffix == "qweight" else group_size  # in features per AWQ row
    if len(base) == 1:  # column-parallel: a range of output features
        start, stop = _bounds(base[0], pack, "output features")
        return (slice(None), slice(start, stop))
    start, stop = _bounds(base[1], per_row, "input features")
    return (slice(start, stop),)


def _bounds(cut: slice, unit: int, what: str) -> tuple[int | None, int | None]:
    if cut.start is None and cut.stop is None:
        return None, None
    if cut.start % unit or cut.stop % unit:
        raise ValueError(
            f"AWQ: this rank's {what} [{cut.start}, {cut.stop}) do not fall on "
            f"whole {unit}s; choose a tp_size that splits on group boundaries"
        )
    return cut.start // unit, cut.stop // unit
