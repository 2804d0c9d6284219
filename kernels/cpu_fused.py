"""The decoder layer's elementwise ops, fused in C for CPU, each beside its torch reference.

Unfused, a SmolLM2 layer runs about twenty small torch ops between its matmuls (the
residual add, RMSNorm's pow/mean/rsqrt/mul/mul, rotary's gathers, cats, negs and
multiplies, SiLU and its multiply), each a dispatch and a pass over memory with a fresh
tensor: a tenth of a 2,048-token prefill step and of a decode step at 64 requests
(`python -m bench.step_profile`). Each op here is one C kernel (one file each, built by
`cpu_native.py`) that does one pass:

| op | C kernel | torch reference (same signature, same rounding) |
|---|---|---|
| `add_rms_norm` | `cpu_rmsnorm.c` | `add_rms_norm_reference` |
| `rotary_` | `cpu_rotary.c` | `rotary_reference_` |
| `silu_mul` | `cpu_silu_mul.c` | `silu_mul_reference` |
| `store_kv` | `cpu_store_kv.c` | `kernels/reference.py`'s `store_kv` |
| `argmax` (greedy sampling) | `cpu_argmax.c` | `torch.argmax(x, dim=-1)` |
| `apply_token_bitmask_` (structured output) | `cpu_token_mask.c` |
`apply_token_bitmask_reference_` |
| `argmax_masked` (constrained greedy sampling) | `cpu_token_mask.c` | `argmax_masked_reference` |

The references are the definitions, written as transformers computes (LlamaRMSNorm,
`apply_rotary_pos_emb`, `act_fn(gate) * up`), and every kernel is tested against them
(`tests/worker_svc/test_cpu_fused.py`). The kernels round as those torch ops do, op by op, in
bf16 too; what differs is only the order of a norm's sum of squares (~1e-7 relative) and
SiLU's exp (within 2 ulp of expf). Each entry point takes the C kernel for CPU tensors in
fp32 or bf16 when the kernels build here and are enabled (`cpu_native.configure`; the
worker reads `PAGEMESH_NATIVE_KERNELS=0` to turn them off), and the reference otherwise
(fp16, CUDA, no compiler).
"""

from __future__ import annotations

import torch

from kernels import cpu_native, reference

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ROTARY_MAX_HEAD_DIM = 512  # cpu_rotary.c's bf16 table rows on the stack


def _library(name: str, *tensors: torch.Tensor, lib=None):
    """The built kernel library `name` (or `lib`, another build of it, for tests) if every
    tensor suits it, else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return None
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    return lib or cpu_native.library(name)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, width], residual or None) -> (weight * norm(residual + x), residual + x).

    As transformers: the residual add in the model's dtype (`residual + hidden`), the norm
    in fp32 cast back before the weight multiply (LlamaRMSNorm). With residual None the sum
    is x itself. The C kernel writes the sum into `residual` in place; the reference
    returns it as a new tensor (callers use the returned one either way)."""
    summed = x if residual is None else residual + x
    x32 = summed.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(summed.dtype), summed


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, lib=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `add_rms_norm_reference`; the C kernel adds into `residual` in place."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    lib = _library("cpu_rmsnorm", *tensors, lib=lib)
    if lib is None or x.dim() != 2 or not all(t.is_contiguous() for t in tensors):
        return add_rms_norm_reference(x, residual, weight, eps)
    rows, width = x.shape
    if weight.shape != (width,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"residual {None if residual is None else tuple(residual.shape)}"
        )
    out = torch.empty_like(x)
    lib.add_rms_norm(
        _DTYPES[x.dtype],
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        width,
        eps,
        _threads(),
    )
    return out, (x if residual is None else residual)


def rotary_tables(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 tables' rows at `positions` as [tokens, 1, head_dim] in `dtype` (cast before
    use, as transformers does, so bf16 products round alike)."""
    return (
        cos_cache[positions].to(dtype).unsqueeze(1),
        sin_cache[positions].to(dtype).unsqueeze(1),
    )


def rotary_reference_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """x [tokens, heads, head_dim] <- x * cos + rotate_half(x) * sin, in place, with cos/sin
    the fp32 tables' rows at `positions` cast to x's dtype (`tables`, when given, are those
    rows already, from `rotary_tables`: computed once per step, not per layer)."""
    cos, sin = tables or rotary_tables(cos_cache, sin_cache, positions, x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * cos + rotated * sin)


def has_rotary_kernel(x: torch.Tensor) -> bool:
    """Whether `rotary_` on x (and tensors like it) runs the C kernel."""
    return _library("cpu_rotary", x) is not None


def rotary_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    lib=None,
) -> None:
    """As `rotary_reference_`. x may be a view (q or k inside the qkv output): its heads
    must be contiguous, its tokens any stride apart."""
    lib = _library("cpu_rotary", x, lib=lib)
    num_tokens, num_heads, head_dim = x.shape
    if (
        lib is None
        or x.stride(2) != 1
        or x.stride(1) != head_dim
        or head_dim > ROTARY_MAX_HEAD_DIM
        or cos_cache.dtype != torch.float32
        or positions.dtype != torch.int64
        or not (
            cos_cache.is_contiguous() and sin_cache.is_contiguous() and positions.is_contiguous()
        )
    ):
        rotary_reference_(x, positions, cos_cache, sin_cache, tables)
        return
    code = lib.rotary_inplace(
        _DTYPES[x.dtype],
        x.data_ptr(),
        num_tokens,
        x.stride(0),
        num_heads,
        head_dim,
        positions.data_ptr(),
        cos_cache.data_ptr(),
        sin_cache.data_ptr(),
        cos_cache.shape[0],
        _threads(),
    )
    if code:
        raise ValueError(f"rotary: a position is outside the tables' {cos_cache.shape[0]} rows")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] (gate | up) -> silu(gate) * up [rows, width]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, *, lib=None) -> torch.Tensor:
    """As `silu_mul_reference`."""
    lib = _library("cpu_silu_mul", gate_up, lib=lib)
    if lib is None or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        return silu_mul_reference(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    lib.silu_mul(
        _DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, width, _threads()
    )
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    lib=None,
) -> None:
    """As `reference.store_kv`. key/value may be views (k and v inside the qkv output):
    each token's heads contiguous, tokens any stride apart."""
    lib = _library("cpu_store_kv", key, value, k_cache, v_cache, lib=lib)
    num_tokens = key.shape[0]
    row = key.shape[1] * key.shape[2]
    if (
        lib is None
        or key.shape != value.shape
        or key.shape[1:] != k_cache.shape[2:]
        or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (key, value))
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    size = key.element_size()
    code = lib.store_kv(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0) * size,
        value.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        num_tokens,
        row * size,
        k_cache.shape[0] * k_cache.shape[1],
        _threads(),
    )
    if code:
        raise ValueError(
            f"store_kv: a slot is outside the cache's {k_cache.shape[0] * k_cache.shape[1]} slots"
        )


def argmax(logits: torch.Tensor, *, lib=None) -> torch.Tensor:
    """As `logits.argmax(dim=-1)` for fp32 [rows, vocab] (rows may be strided): int64 [rows]."""
    lib = _library("cpu_argmax", logits, lib=lib)
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[1] == 0
    ):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        out.data_ptr(),
        _threads(),
    )
    return out


def apply_token_bitmask_(
    logits: torch.Tensor, rows: list[int], bits: torch.Tensor, *, lib=None
) -> None:
    """In place: in each row `rows[k]` of logits [num_rows, vocab], -inf for every token
    whose bit is clear in bits[k] (int32 [len(rows), words], llguidance's layout: token i is
    bit i % 32 of word i // 32) and for tokens past 32 * words."""
    if not rows:
        return
    lib = _library("cpu_token_mask", logits, lib=lib)
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bits.device.type != "cpu"
    ):
        apply_token_bitmask_reference_(logits, rows, bits)
        return
    bits = bits.to(torch.int32).contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    lib.apply_token_bitmask(
        logits.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        index.data_ptr(),
        len(rows),
        bits.data_ptr(),
        bits.shape[1],
        _threads(),
    )


def apply_token_bitmask_reference_(
    logits: torch.Tensor, rows: list[int], bits: torch.Tensor
) -> None:
    """`apply_token_bitmask_` in torch ops, on any device (the bits are unpacked there)."""
    vocab = logits.shape[1]
    bits = bits.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def argmax_masked(
    logits: torch.Tensor, rows: list[int], bits: torch.Tensor, *, lib=None
) -> torch.Tensor:
    """int64 [len(rows)]: `argmax` of each row `rows[k]` of fp32 logits after
    `apply_token_bitmask_` with bits[k], without copying or changing the logits."""
    lib = _library("cpu_token_mask", logits, lib=lib)
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bits.device.type != "cpu"
        or not rows
    ):
        return argmax_masked_reference(logits, rows, bits)
    bits = bits.to(torch.int32).contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), dtype=torch.int64)
    lib.argmax_masked_rows(
        logits.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        index.data_ptr(),
        len(rows),
        bits.data_ptr(),
        bits.shape[1],
        out.data_ptr(),
        _threads(),
    )
    return out


def argmax_masked_reference(
    logits: torch.Tensor, rows: list[int], bits: torch.Tensor
) -> torch.Tensor:
    masked = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
    apply_token_bitmask_reference_(masked, list(range(len(rows))), bits)
    return masked.argmax(dim=-1)
