"""The batched LoRA kernels (`kernels/lora.py`: the C kernel `cpu_lora.c`, the torch grouped
path, the Triton kernels in the interpreter) against `lora_reference_`.

Each case mixes 8 adapter slots over the rows, unsorted and sorted, with rows of no adapter
(-1) and a slot whose adapter has half the rank (zero-padded), on an `out` filled with
random values: the add is in place, and the rows of no adapter must keep their bits.

Tolerances: fp32 1e-5 of the largest output (the kernels sum in another order). bf16 and
fp16 are compared with the reference's own rounding of the fp32 result: a different sum
order moves a value next to a rounding boundary by one unit in the last place, and Triton's
interpreter rounds fp32 -> bf16 toward zero, which is one unit too; so one ulp everywhere,
plus the fp32 tolerance where out + delta cancels to near zero. The CPU paths round to
nearest as the reference does, so there 99% of the values must also be equal to the bit (a
kernel that rounded down would pass the ulp check alone).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu_native, lora
from tests.worker_svc.test_cpu_native_builds import (
    X86_LEVELS,
    _skip_unless_runnable,
    _skip_unless_x86,
    needs_compiler,
)

NUM_SLOTS = 8
HALF_RANK_SLOT = 3  # its adapter's rank is half the padded rank
SHAPES = [(576, 960), (1536, 576), (64, 128)]  # (in_f, out_f)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def lora_case(
    n: int,
    in_f: int,
    out_f: int,
    rank: int,
    dtype: torch.dtype,
    *,
    sort: bool = False,
    num_slots: int = NUM_SLOTS,
    seed: int = 0,
):
    """(out, x, lora_a, lora_bt, slots int32) with outputs of magnitude ~1-10; row 0 has an
    adapter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_f, generator=g)
    lora_a = torch.randn(num_slots, rank, in_f, generator=g) * in_f**-0.5
    lora_bt = torch.randn(num_slots, rank, out_f, generator=g) * rank**-0.5
    if num_slots > HALF_RANK_SLOT:
        lora_a[HALF_RANK_SLOT, rank // 2 :] = 0
        lora_bt[HALF_RANK_SLOT, rank // 2 :] = 0
    slots = torch.randint(-1, num_slots, (n,), generator=g, dtype=torch.int32)
    slots[:1] = seed % num_slots  # a single row has an adapter too
    if sort:
        slots = slots.sort().values
    out = torch.randn(n, out_f, generator=g) * 4
    return tuple(t.to(dtype) for t in (out, x, lora_a, lora_bt)) + (slots,)


def assert_matches(
    actual: torch.Tensor,
    expected: torch.Tensor,
    before: torch.Tensor,
    slots: torch.Tensor,
    *,
    nearest: bool = True,
) -> None:
    untouched = slots < 0
    assert torch.equal(actual[untouched], before[untouched])
    if actual.dtype == torch.float32:
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)
        return
    # One ulp of the larger magnitude (the interpreter may round down across a binade), plus
    # fp32's sum-order error, which is all there is where out + delta cancels to near zero.
    magnitude = torch.maximum(actual.float().abs(), expected.float().abs())
    ulp = torch.exp2(
        torch.floor(torch.log2(magnitude.clamp(min=1e-30))) - MANTISSA_BITS[actual.dtype]
    )
    fp32_error = 1e-5 * expected.float().abs().max().item()
    excess = (actual.float() - expected.float()).abs() - ulp - fp32_error
    assert excess.max().item() <= 0, f"off by more than one ulp: {excess.max().item()}"
    if nearest and not untouched.all():  # to nearest, not down: all but boundary values exact
        same = (actual == expected)[~untouched].float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of the values equal the reference's"


def check_against_reference(apply, case, *, nearest: bool = True) -> None:
    out, x, lora_a, lora_bt, slots = case
    expected = out.clone()
    lora.lora_reference_(expected, x, lora_a, lora_bt, slots)
    actual = out.clone()
    apply(actual, x, lora_a, lora_bt, slots)
    assert_matches(actual, expected, out, slots, nearest=nearest)


def assert_all_unassigned_is_a_no_op(apply, dtype: torch.dtype) -> None:
    out, x, lora_a, lora_bt, slots = lora_case(9, 64, 96, 8, dtype)
    slots = torch.full_like(slots, -1)
    actual = out.clone()
    apply(actual, x, lora_a, lora_bt, slots)
    assert torch.equal(actual, out)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("in_f,out_f", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_c_kernel_matches_the_reference(n, in_f, out_f, rank, dtype, monkeypatch):
    monkeypatch.setattr(lora, "_grouped_", None)  # the C kernel must run, not the fallback
    for sort in (False, True):
        case = lora_case(n, in_f, out_f, rank, dtype, sort=sort, seed=n + rank)
        check_against_reference(lora.lora_apply_, case)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_c_kernel_edges(dtype, monkeypatch):
    monkeypatch.setattr(lora, "_grouped_", None)
    # Ranks off the kernel's rank tile, columns past the last full chunk and an in_f off the
    # vector pair: each tail path; int64 slots; a single slot; more rows than threads need.
    for n, in_f, out_f, rank in [(5, 72, 100, 5), (33, 40, 7, 3), (130, 200, 330, 12)]:
        case = lora_case(n, in_f, out_f, rank, dtype, seed=n)
        check_against_reference(lora.lora_apply_, case)
        out, x, lora_a, lora_bt, slots = case
        check_against_reference(lora.lora_apply_, (out, x, lora_a, lora_bt, slots.long()))
    check_against_reference(lora.lora_apply_, lora_case(20, 64, 64, 4, dtype, num_slots=1))
    assert_all_unassigned_is_a_no_op(lora.lora_apply_, dtype)
    empty = lora_case(0, 64, 96, 8, dtype)
    lora.lora_apply_(*empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "n,in_f,out_f,rank",
    [(1, 576, 960, 16), (64, 1536, 576, 8), (300, 64, 128, 64), (7, 72, 100, 5)],
)
def test_grouped_path_matches_the_reference(n, in_f, out_f, rank, dtype):
    for sort in (False, True):
        case = lora_case(n, in_f, out_f, rank, dtype, sort=sort, seed=n)
        check_against_reference(lora.lora_grouped_, case)
    assert_all_unassigned_is_a_no_op(lora.lora_grouped_, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_without_the_c_kernel_the_dispatcher_takes_the_grouped_path(dtype, monkeypatch):
    monkeypatch.setattr(cpu_native, "library", lambda name: None)
    check_against_reference(lora.lora_apply_, lora_case(40, 64, 96, 8, dtype, seed=2))
    # fp16 on CPU: no C kernel for it, whatever the build.
    monkeypatch.undo()
    check_against_reference(lora.lora_apply_, lora_case(40, 64, 96, 8, torch.float16, seed=2))


def test_bad_arguments_raise_value_errors():
    out, x, lora_a, lora_bt, slots = lora_case(6, 64, 96, 8, torch.float32)
    bad_slot = slots.clone()
    bad_slot[2] = NUM_SLOTS
    cases = {
        "shapes do not fit": (out[:, :90], x, lora_a, lora_bt, slots),
        "must share one of": (out, x.double(), lora_a, lora_bt, slots),
        "slots must be one of": (out, x, lora_a, lora_bt, slots.float()),
        "must be contiguous": (
            out,
            x,
            lora_a,
            lora_bt.transpose(1, 2).contiguous().transpose(1, 2),
            slots,
        ),
        "must be \\[n, in_f\\]": (out, x[None], lora_a, lora_bt, slots),
        "slots must be < 8": (out, x, lora_a, lora_bt, bad_slot),
    }
    for apply in (lora.lora_apply_, lora.lora_grouped_, lora.lora_reference_):
        for message, args in cases.items():
            kept = args[0].clone()
            with pytest.raises(ValueError, match=message):
                apply(*args)
            assert torch.equal(args[0], kept)  # nothing written before the error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "n,in_f,out_f,rank",
    [(1, 64, 96, 8), (7, 48, 40, 16), (40, 64, 160, 32), (70, 32, 200, 5), (100, 72, 140, 72)],
)
def test_triton_kernels_in_the_interpreter_match_the_reference(n, in_f, out_f, rank, dtype):
    pytest.importorskip("triton")
    from kernels.lora_triton import lora_triton_

    case = lora_case(n, in_f, out_f, rank, dtype, num_slots=4, seed=n)
    check_against_reference(lora_triton_, case, nearest=False)  # the interpreter rounds down
    if n == 1:
        assert_all_unassigned_is_a_no_op(lora_triton_, dtype)


@needs_compiler
@pytest.mark.parametrize("level", list(X86_LEVELS))
def test_each_isa_level_of_the_c_kernel_matches_the_reference(level, tmp_path, monkeypatch):
    _skip_unless_x86()
    config = dataclasses.replace(cpu_native.current_config(), cache_dir=tmp_path)
    lib = cpu_native._build("cpu_lora", (f"-march={level}",), config)
    _skip_unless_runnable(level)
    monkeypatch.setattr(lora, "_grouped_", None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the threaded path too, on a one-core machine
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n, in_f, out_f, rank in [
                (1, 576, 960, 16),
                (64, 1536, 576, 8),
                (300, 64, 128, 64),
                (7, 72, 100, 5),
            ]:
                case = lora_case(n, in_f, out_f, rank, dtype, seed=n)
                check_against_reference(lambda *args: lora.lora_apply_(*args, lib=lib), case)
    finally:
        torch.set_num_threads(before)
