"""Batched LoRA for multi-LoRA serving: each row of a step (a token) may belong to another
adapter, and every LoRA-capable linear layer adds, in place, for each row i whose slot
`s = slots[i]` is >= 0:

    out[i] += (x[i] @ lora_a[s].T) @ lora_bt[s]

Layouts (the caller prepares them, all contiguous, one dtype): x `[n, in_f]`; lora_a
`[S, R, in_f]` (S adapter slots, R the largest rank: a smaller adapter is zero-padded);
lora_bt `[S, R, out_f]` (B transposed, the adapter's scaling already folded in); out
`[n, out_f]`; slots `[n]` int32 or int64, negative (-1) for a row without an adapter. Rows
without an adapter are never written. Dtypes: fp32 and bf16, fp16 too on CUDA (on CPU it
takes the torch path).

| function | what | math |
|---|---|---|
| `lora_reference_` | the definition: torch, a pass per distinct slot | fp32, one rounding |
| `lora_grouped_` | fallback: one sort, two matmuls per slot, one scatter | CPU fp32, CUDA x's |
| `lora_apply_` | the dispatcher | the kernel it picks |

`lora_apply_` runs the Triton shrink/expand kernels (`kernels/lora_triton.py`) for CUDA
tensors, the C kernel (`kernels/cpu_lora.c`) for CPU tensors in fp32/bf16 when
`kernels.cpu_native` builds it here, and `lora_grouped_` otherwise. Both kernels round as
the reference does (fp32 shrink and expand, out + delta rounded once) and differ from it
only in the order of fp32 sums. `lora_grouped_` multiplies in fp32 on CPU, so it rounds as
the reference too (torch's CPU bf16 matmuls of these skinny shapes took far longer than
widening to fp32 and multiplying there, for 8 rows, 576 -> 16 -> 960); on
CUDA it multiplies in x's dtype, which rounds the shrink's `[rows, R]` and the expand's
`[rows, out_f]` products to bf16/fp16 (half an ulp each) before the add.

Argument errors (shapes, dtypes, devices, layout) raise ValueError, as does a slot >= S
where the slots are read on the host. `lora_apply_` on CUDA never reads them there (no
sync, so a step can be graph-captured): a slot outside 0..S-1 then counts as no adapter.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu_native

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOT_DTYPES = (torch.int32, torch.int64)
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # cpu_lora.c's dtype codes


def check_lora_args(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments have the layouts of the module docstring."""
    if x.dim() != 2 or lora_a.dim() != 3 or lora_bt.dim() != 3 or slots.dim() != 1:
        raise ValueError(
            f"x {tuple(x.shape)} must be [n, in_f], lora_a {tuple(lora_a.shape)} "
            f"[S, R, in_f], lora_bt {tuple(lora_bt.shape)} [S, R, out_f] and "
            f"slots {tuple(slots.shape)} [n]"
        )
    n, in_f = x.shape
    num_slots, rank, out_f = lora_bt.shape
    if lora_a.shape != (num_slots, rank, in_f) or out.shape != (n, out_f) or (slots.shape[0] != n):
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
            f"lora_bt {tuple(lora_bt.shape)}, out {tuple(out.shape)}, slots "
            f"{tuple(slots.shape)}; need lora_a [S, R, {in_f}], out [{n}, out_f] "
            f"for lora_bt [S, R, out_f], slots [{n}]"
        )
    if x.dtype not in FLOAT_DTYPES or any(t.dtype != x.dtype for t in (out, lora_a, lora_bt)):
        raise ValueError(
            f"x, lora_a, lora_bt and out must share one of {FLOAT_DTYPES}, got "
            f"{x.dtype}, {lora_a.dtype}, {lora_bt.dtype}, {out.dtype}"
        )
    if slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"slots must be one of {SLOT_DTYPES}, got {slots.dtype}")
    tensors = {"out": out, "x": x, "lora_a": lora_a, "lora_bt": lora_bt, "slots": slots}
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, strides {tensor.stride()}")


def slot_counts(slots: torch.Tensor, num_slots: int) -> list[int]:
    """Rows per slot, [no adapter, slot 0, .., slot S-1] (one host sync); ValueError for a
    slot >= num_slots."""
    counts = torch.bincount(slots.clamp(min=-1).to(torch.int64) + 1, minlength=num_slots + 1)
    if counts.shape[0] > num_slots + 1:
        raise ValueError(f"slots must be < {num_slots} (the adapter slots), got {int(slots.max())}")
    return counts.tolist()


def lora_reference_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The definition (module docstring), per distinct slot: its rows' shrink and expand in
    fp32, and out's rows replaced by `(out + delta)` rounded once to out's dtype."""
    check_lora_args(out, x, lora_a, lora_bt, slots)
    for slot, count in enumerate(slot_counts(slots, lora_a.shape[0])[1:]):
        if count == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        delta = (x[rows].float() @ lora_a[slot].float().T) @ lora_bt[slot].float()
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def lora_grouped_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The reference's sum with the rows grouped by adapter, in fp32 on CPU and in x's dtype
    on CUDA (module docstring: the roundings)."""
    check_lora_args(out, x, lora_a, lora_bt, slots)
    _grouped_(out, x, lora_a, lora_bt, slots)


def _grouped_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """One stable sort of the rows by slot, one gather of x, a shrink and an expand matmul
    per slot into one delta buffer, and one gather-add-scatter of out's rows."""
    counts = slot_counts(slots, lora_a.shape[0])
    if counts[0] == slots.shape[0]:
        return
    dtype = x.dtype if x.is_cuda else torch.float32
    order = torch.sort(slots.clamp(min=-1), stable=True).indices[counts[0] :]
    rows = x[order].to(dtype)
    delta = torch.empty((rows.shape[0], out.shape[1]), dtype=dtype, device=out.device)
    start = 0
    for slot, count in enumerate(counts[1:]):
        if count:
            end = start + count
            torch.matmul(
                rows[start:end] @ lora_a[slot].to(dtype).T,
                lora_bt[slot].to(dtype),
                out=delta[start:end],
            )
            start = end
    out.index_copy_(0, order, (out[order] + delta).to(out.dtype))  # promoted: one rounding


def lora_apply_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """out += the LoRA products of each row's adapter, in place (module docstring): the
    Triton kernels on CUDA, the C kernel on CPU (fp32/bf16; `lib`: another build of
    cpu_lora, for tests), else `lora_grouped_`. Returns at once for n == 0; the C kernel
    returns after one scan of the slots when every row is -1."""
    check_lora_args(out, x, lora_a, lora_bt, slots)
    if x.shape[0] == 0:
        return
    if x.is_cuda:
        from kernels.lora_triton import launch_lora_

        launch_lora_(out, x, lora_a, lora_bt, slots)
        return
    if x.device.type == "cpu" and x.dtype in _C_DTYPES:
        lib = lib or cpu_native.library("cpu_lora")
        if lib is not None:
            _apply_c_(lib, out, x, lora_a, lora_bt, slots.to(torch.int32))
            return
    _grouped_(out, x, lora_a, lora_bt, slots)


def _apply_c_(
    lib: ctypes.CDLL,
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """cpu_lora.c's `lora_apply` on checked CPU tensors, slots int32."""
    num_slots, rank, out_f = lora_bt.shape
    code = lib.lora_apply(
        _C_DTYPES[x.dtype],
        x.data_ptr(),
        lora_a.data_ptr(),
        lora_bt.data_ptr(),
        slots.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        out_f,
        rank,
        num_slots,
        max(1, torch.get_num_threads()),
    )
    if code == -1:
        raise ValueError(f"slots must be < {num_slots} (the adapter slots), got {int(slots.max())}")
    if code:
        raise MemoryError("the LoRA kernel could not allocate its scratch memory")
