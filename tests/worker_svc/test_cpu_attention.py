"""The CPU attention backend (`kernels/cpu_attention.py`) against the reference ops."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, cpu_decode, cpu_native, reference
from tests.support.paged_batch import assert_matches_reference, build_paged_batch
from worker_svc.attention import get_attention_backend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# Ragged contexts with partly filled last blocks; all-decode batches (the fast path), mixed
# decode + chunked-prefill + fresh-prefill batches, GQA / MQA / MHA, sliding windows.
@pytest.mark.parametrize(
    "seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size,dtype,window",
    [
        ([1, 8, 13, 30], [1, 1, 1, 1], 4, 4, 64, 8, F32, None),
        ([17, 5, 48], [1, 5, 10], 8, 2, 96, 16, F32, None),
        ([33, 64, 7], [33, 1, 3], 4, 1, 128, 32, BF16, None),
        ([130, 3], [1, 3], 2, 1, 64, 128, F16, None),
        ([9, 21, 40], [9, 1, 40], 6, 2, 24, 4, F32, 5),
        ([9, 21, 40], [1, 1, 1], 6, 2, 24, 4, F32, 7),
        ([144] * 16, [1] * 16, 8, 4, 64, 16, BF16, None),
    ],
)
@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch-only"])
def test_matches_reference(
    seq_lens,
    q_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    window,
    native,
    native_kernels,
):
    native_kernels(enabled=native)
    batch = build_paged_batch(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seq_lens)
    )
    scale = head_dim**-0.5
    # Like the reference, this backend needs finite values in unused slots (the cache is
    # allocated zeroed), so both get the copy with NaN zeroed.
    out = cpu_attention.paged_attention(*batch.reference_args(), scale, sliding_window=window)
    expected = reference.paged_attention(*batch.reference_args(), scale, sliding_window=window)
    assert_matches_reference(out, expected)


@pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler (cc/gcc/$CC) on PATH")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 64 and 128 have their own code
def test_c_kernel_never_reads_past_a_context(dtype, head_dim):
    # NaN in every slot no sequence owns (paged_batch): one read past a context shows.
    # Lengths cover partial blocks and a block's 4-token groups with 1-3 left over.
    batch = build_paged_batch([1, 16, 17, 50, 33, 7], [1] * 6, 8, 2, head_dim, 16, dtype, seed=3)
    for window in (None, 9):
        out = cpu_decode.paged_decode(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            window,
        )
        expected = reference.paged_attention(*batch.reference_args(), 0.125, sliding_window=window)
        assert_matches_reference(out, expected)


@pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler (cc/gcc/$CC) on PATH")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(
    "seq_lens,threads,window",
    [
        ([2000], 4, None),  # batch 1: one request's keys over four threads
        ([1000, 300, 5], 8, None),  # fewer requests than threads: 3, 2 and 1 parts
        ([1000, 300, 5], 8, 700),  # a window starting mid-block, spanning the parts
        ([129, 255], 3, None),  # parts of a block or so, a partly filled last one
    ],
)
def test_c_kernel_splits_few_long_contexts_across_threads(dtype, seq_lens, threads, window):
    # NaN in the slots no sequence owns, as above: a part reading past its run shows.
    batch = build_paged_batch(seq_lens, [1] * len(seq_lens), 9, 3, 64, 16, dtype, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.paged_decode(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            window,
        )
    finally:
        torch.set_num_threads(before)
    expected = reference.paged_attention(*batch.reference_args(), 0.125, sliding_window=window)
    assert_matches_reference(out, expected)


def test_without_a_compiler_the_build_says_so(tmp_path):
    config = cpu_native.NativeKernelConfig(
        compiler=str(tmp_path / "no-such-cc"), cache_dir=tmp_path / "cache"
    )
    with pytest.raises((RuntimeError, OSError)):
        cpu_native._build(config=config)


def test_rejects_heads_that_do_not_fit_the_cache():
    batch = build_paged_batch([4], [1], 3, 2, 8, 4)
    with pytest.raises(ValueError, match="does not fit a cache of 2 kv heads"):
        cpu_attention.paged_attention(*batch.reference_args(), 1.0)


def test_auto_backend_is_cpu_on_cpu():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("fast", "cpu")


@pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler (cc/gcc/$CC) on PATH")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 64 and 128 have their own code
@pytest.mark.parametrize("threads", [1, 3])
def test_one_c_call_for_a_mixed_batch(dtype, head_dim, threads):
    # Decodes, whole prompts, chunks after cached context, tiles (32 tokens) and key runs
    # (32 keys) with remainders, GQA groups of 1, 3 and 4 (rows not a whole vector), with
    # NaN in every slot no sequence owns: one read past a context or a causal edge shows.
    seq_lens, q_lens = [1, 70, 150, 45, 33, 9, 100], [1, 70, 67, 1, 33, 2, 31]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, kv_heads in ((9, 3), (4, 4), (8, 2)):
            batch = build_paged_batch(
                seq_lens, q_lens, heads, kv_heads, head_dim, 16, dtype, seed=heads
            )
            for window in (None, 20):
                out = cpu_decode.paged_attention(
                    batch.query,
                    batch.k_cache,
                    batch.v_cache,
                    batch.block_tables,
                    batch.seq_lens,
                    batch.query_start_loc,
                    0.125,
                    window,
                )
                expected = reference.paged_attention(
                    *batch.reference_args(), 0.125, sliding_window=window
                )
                assert_matches_reference(out, expected)
    finally:
        torch.set_num_threads(before)


def test_more_query_tokens_than_context_is_refused(native_kernels):
    batch = build_paged_batch([9, 4], [1, 4], 4, 2, 64, 16, F32, seed=1)
    lens = batch.seq_lens.clone()
    lens[1] = 3  # 4 query tokens cannot be the newest of 3
    for native in (True, False):
        native_kernels(enabled=native)
        with pytest.raises(ValueError, match="query tokens"):
            cpu_attention.paged_attention(
                batch.query,
                batch.k_cache,
                batch.v_cache,
                batch.block_tables,
                lens,
                batch.query_start_loc,
                0.1,
            )


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_whole_prompt_prefills_attend_to_the_steps_own_keys(dtype, native_kernels):
    # Without the C kernel (fp16, no compiler): three prompts with no cached context (two of
    # one length: one batched call), a chunk after a cached prefix, a decode. The fresh
    # prompts' cache slots are then poisoned: a finite, matching result shows they were read
    # from `key` / `value`, not the cache.
    native_kernels(enabled=False)
    seq_lens, q_lens = [5, 40, 40, 17, 9], [5, 40, 40, 3, 1]
    batch = build_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype, seed=11)
    args = list(batch.reference_args())
    k_cache, v_cache, tables, block_size = args[1].clone(), args[2].clone(), args[3], 16
    expected = reference.paged_attention(*args, 0.125)
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    key, value = flat_k[slots].clone(), flat_v[slots].clone()
    fresh_slots = slots[: 5 + 40 + 40]
    flat_k[fresh_slots] = float("nan")
    flat_v[fresh_slots] = float("nan")
    args[1], args[2] = k_cache, v_cache
    out = cpu_attention.paged_attention(*args, 0.125, key=key, value=value)
    assert_matches_reference(out, expected)


@pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler (cc/gcc/$CC) on PATH")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("window", [None, 6])
def test_short_query_runs_attend_as_the_decodes_they_stand_for(dtype, window):
    """Decodes verifying speculative drafts (and short chunks) match the reference; in bf16
    (no native mixed kernel) each row is the decode of its position, bit for bit."""
    seq_lens, q_lens = [30, 41, 52, 17], [1, 5, 9, 16]
    batch = build_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype, seed=4)
    out = cpu_attention.paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
        sliding_window=window,
    )
    expected = reference.paged_attention(*batch.reference_args(), 0.125, sliding_window=window)
    assert_matches_reference(out, expected)
    if dtype != BF16:
        return  # fp32's native mixed kernel: the reference's numbers, not the decode's bits
    row = 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        for j in range(q_len):
            alone = cpu_decode.paged_decode(
                batch.query[row : row + 1],
                batch.k_cache,
                batch.v_cache,
                batch.block_tables[s : s + 1],
                torch.tensor([seq_len - q_len + 1 + j], dtype=batch.seq_lens.dtype),
                0.125,
                window,
            )
            assert torch.equal(out[row], alone[0]), (s, j)
            row += 1
