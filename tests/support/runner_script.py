"""Driving a `ModelRunner` step by step as a scheduler would, and the transformers
reference it is compared with: shared by the runner, parallel, Triton and quantization
tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from protos.step import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    SamplingParams,
    SchedulerOutput,
)
from worker_svc.runner import ModelRunner

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class ScriptedRequest:
    """One request as a toy scheduler sees it."""

    request_id: str
    prompt: list[int]
    join_step: int
    prefill_chunk: int | None = None  # at most this many prompt tokens per step
    outputs: list[int] = field(default_factory=list)
    sampled: list[SampledToken] = field(default_factory=list)  # with logprobs when asked
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    num_sent: int = 0  # tokens the runner has been told about


def scripted_requests(vocab_size: int, late_joiner: bool = True) -> list[ScriptedRequest]:
    """The continuous-batching script of the parallel and MoE tests: two requests at once
    (one prefilled in chunks of 8), one joining at step 2, one at step 4 in chunks of 7,
    and (`late_joiner`) a one-token prompt at step 11."""
    requests = [
        ScriptedRequest("a", random_prompt(9, vocab_size, 1), join_step=0),
        ScriptedRequest("b", random_prompt(21, vocab_size, 2), join_step=0, prefill_chunk=8),
        ScriptedRequest("c", random_prompt(5, vocab_size, 3), join_step=2),
        ScriptedRequest("d", random_prompt(16, vocab_size, 4), join_step=4, prefill_chunk=7),
    ]
    if late_joiner:
        requests.append(ScriptedRequest("e", random_prompt(1, vocab_size, 5), join_step=11))
    return requests


def drive(
    runner: ModelRunner,
    requests: list[ScriptedRequest],
    num_new_tokens: int,
    sampling: SamplingParams | None = None,
) -> None:
    """Schedule `requests` like a continuous-batching scheduler until each has
    `num_new_tokens` outputs: joins at `join_step`, chunked prefill, block allocation from
    a shuffled free list, and freeing (and reuse) of finished requests' blocks."""
    free_blocks = list(range(runner.num_blocks))
    random.Random(0).shuffle(free_blocks)
    finished: list[str] = []
    step_id = 0
    while any(len(r.outputs) < num_new_tokens for r in requests):
        new, cached, scheduled = [], [], {}
        for r in requests:
            if r.join_step > step_id or len(r.outputs) >= num_new_tokens:
                continue
            num_tokens = len(r.prompt) + len(r.outputs) - r.num_computed
            if r.prefill_chunk is not None:
                num_tokens = min(num_tokens, r.prefill_chunk)
            num_blocks_needed = -(-(r.num_computed + num_tokens) // BLOCK_SIZE)
            new_blocks = [free_blocks.pop() for _ in range(num_blocks_needed - len(r.block_ids))]
            r.block_ids += new_blocks
            known = r.prompt + r.outputs
            if r.sent:
                cached.append(
                    CachedRequestData(r.request_id, new_blocks, r.num_computed, known[r.num_sent :])
                )
            else:
                new.append(
                    NewRequestData(
                        r.request_id,
                        known,
                        len(r.prompt),
                        list(r.block_ids),
                        r.num_computed,
                        sampling or GREEDY,
                    )
                )
                r.sent = True
            r.num_sent = len(known)
            scheduled[r.request_id] = num_tokens
        output = runner.execute_step(SchedulerOutput(step_id, new, cached, scheduled, finished))
        finished = []
        expect_sampled = set()
        for r in requests:
            if r.request_id not in scheduled:
                continue
            r.num_computed += scheduled[r.request_id]
            if r.num_computed == len(r.prompt) + len(r.outputs):
                expect_sampled.add(r.request_id)
                r.sampled.append(output.sampled[r.request_id])
                r.outputs.append(r.sampled[-1].token_id)
            if len(r.outputs) >= num_new_tokens:
                finished.append(r.request_id)
                free_blocks += r.block_ids
        assert set(output.sampled) == expect_sampled, f"step {step_id}"
        step_id += 1


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (length,), generator=generator).tolist()


def padded_decode_matches(
    runner: ModelRunner, requests: list[ScriptedRequest], size: int, fix_plan=None
) -> None:
    """After `drive`: the next decode step of `requests` (each one's last output as its new
    token), run through the model unpadded and then padded to `size` rows in CUDA graphs'
    static buffers (worker_svc/cuda_graphs.py), agrees row for row, and the padding writes
    nothing into the KV cache. `fix_plan(metadata, size)`: how the backend attends in a
    graph (the Triton backend's fixed decode plan); None attends as an eager step does."""
    from worker_svc.batch import build_batch
    from worker_svc.cuda_graphs import StaticDecodeInputs

    for r in requests:
        runner.requests[r.request_id].token_ids.append(r.outputs[-1])
    scheduled = {r.request_id: 1 for r in requests}
    batch = build_batch(
        runner.requests, scheduled, runner.block_size, runner.device, runner.block_tables
    )
    with torch.inference_mode():
        eager, _ = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.metadata, runner.backend
        )
        cache_after_eager = [c.clone() for c in runner.kv_caches]
        max_blocks = -(-runner.metadata.max_model_len // runner.block_size)
        inputs = StaticDecodeInputs(size + 3, max_blocks, runner.device)
        inputs.load(batch.input_ids, batch.positions, batch.metadata, size)
        metadata = inputs.metadata(size)
        if fix_plan is not None:
            fix_plan(metadata, size)
        padded, _ = runner.model(
            inputs.input_ids[:size],
            inputs.positions[:size],
            runner.kv_caches,
            metadata,
            runner.backend,
        )
    n = len(requests)
    assert padded.shape[0] == size
    torch.testing.assert_close(padded[:n], eager, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(padded[n:]).all()  # a pad attends to one key of block 0
    for before, after in zip(cache_after_eager, runner.kv_caches, strict=True):
        assert torch.equal(before, after), "a padded row wrote into the KV cache"
