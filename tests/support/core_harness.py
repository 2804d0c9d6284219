"""Helpers shared by the scheduler core tests: requests, made-up steps, invariant checks."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from protos.block_hash import BlockHash
from protos.step import ModelRunnerOutput, RequestId, SampledToken, SamplingParams, SchedulerOutput
from scheduler_svc.core import kv_cache_manager
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request, RequestEvent, RequestStatus

EOS = 2
_WAITING_STATES = {RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED}


def make_request(
    request_id: str,
    prompt_len: int = 0,
    max_tokens: int = 4,
    prompt: list[int] | None = None,
    min_tokens: int = 0,
    **kwargs: object,
) -> Request:
    """A request whose prompt is `prompt`, or `prompt_len` distinct tokens 10, 11, ...,
    that EOS ends (once `min_tokens` exist)."""
    return Request(
        request_id=RequestId(request_id),
        prompt_token_ids=list(prompt) if prompt is not None else list(range(10, 10 + prompt_len)),
        sampling=SamplingParams(min_tokens=min_tokens, stop_token_ids=(EOS,)),
        max_tokens=max_tokens,
        **kwargs,
    )


def make_samples(
    leader_id: str, n: int, prompt: list[int], max_tokens: int = 4, **kwargs: object
) -> list[Request]:
    """n samples of one prompt: `leader_id` leads, `leader_id#i` fork from it."""
    leader = make_request(leader_id, prompt=prompt, max_tokens=max_tokens, **kwargs)
    forks = [
        make_request(
            f"{leader_id}#{i}",
            prompt=prompt,
            max_tokens=max_tokens,
            fork_of=RequestId(leader_id),
            **kwargs,
        )
        for i in range(1, n)
    ]
    return [leader, *forks]


def fake_step(
    scheduler: Scheduler,
    output: SchedulerOutput,
    token_for: dict[str, int] | Callable[[str], int] | None = None,
) -> ModelRunnerOutput:
    """Samples a token for every request whose scheduled tokens reached its end (7 unless
    `token_for` says otherwise)."""
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            if callable(token_for):
                token = token_for(request_id)
            else:
                token = (token_for or {}).get(request_id, 7)
            sampled[request_id] = SampledToken(token)
    return ModelRunnerOutput(output.step_id, sampled)


def step(
    scheduler: Scheduler, token_for: dict[str, int] | Callable[[str], int] | None = None
) -> tuple[SchedulerOutput, list[RequestEvent]]:
    """One whole step with invariant checks after schedule() and after update()."""
    output = scheduler.schedule()
    check_invariants(scheduler)
    events = scheduler.update(output, fake_step(scheduler, output, token_for))
    check_invariants(scheduler)
    return output, events


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return outputs
        _, events = step(scheduler)
        for event in events:
            outputs.setdefault(event.request_id, []).extend(t.token_id for t in event.new_tokens)
    raise AssertionError("did not finish")


def check_invariants(scheduler: Scheduler) -> None:
    """Queues partition the live requests; block references, sharing and swap space agree."""
    _check_queues(scheduler)
    _check_device_blocks(scheduler)
    _check_sharing(scheduler)
    _check_swap_blocks(scheduler)


def _check_queues(scheduler: Scheduler) -> None:
    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in scheduler.waiting]
    importing = set(scheduler._importing)  # waiting outside the queue for their KV's pull
    assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
    assert not set(running) & set(waiting), "a request is both running and waiting"
    assert not importing & (set(running) | set(waiting)), "an importing request is queued"
    assert set(running) | set(waiting) | importing == set(scheduler.requests)
    assert len(running) <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
    block_size = scheduler.config.block_size
    for request in scheduler.waiting:
        assert request.status in _WAITING_STATES, request.status
        if request.block_ids:  # its KV was pulled from another group: exactly that KV's blocks
            assert request.status is RequestStatus.WAITING and request.num_computed_tokens
            assert len(request.block_ids) == -(-request.num_computed_tokens // block_size)
        elif request.status is not RequestStatus.SWAPPED:
            assert request.num_computed_tokens == 0


def _check_device_blocks(scheduler: Scheduler) -> None:
    pool, block_size = scheduler.kv.pool, scheduler.config.block_size
    holders = Counter(b for r in scheduler.requests.values() for b in r.block_ids)
    holders.update(b for held in scheduler.held.values() for b in held.block_ids)
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) == holders[block_id], f"block {block_id} ref count"
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert set(free) == {b for b in range(pool.num_blocks) if holders[b] == 0}
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert pool.num_used_blocks == len(+holders)
    speculative = scheduler.config.speculative
    lookahead = speculative.num_speculative_tokens if speculative is not None else 0
    if scheduler.spec is not None:  # a draft model's room for its proposals' KV
        lookahead += scheduler.spec.proposal_room
    for request in scheduler.running:
        # Exactly the blocks the computed (and scheduled) tokens need: nothing leaks. When
        # speculating, a request keeps the slots of its rejected drafts (its next tokens'),
        # and a draft model's room, no more.
        needed = -(-request.num_computed_tokens // block_size)
        assert (
            needed
            <= len(request.block_ids)
            <= -(-(request.num_computed_tokens + lookahead) // block_size)
        )
        assert len(set(request.block_ids)) == len(request.block_ids)


def _check_sharing(scheduler: Scheduler) -> None:
    """A block in two tables is a computed full block of the same token prefix in each, and
    is cached or shared by one n > 1 group; a cached block holds its hash's tokens."""
    pool, block_size = scheduler.kv.pool, scheduler.config.block_size
    places: dict[int, list[tuple[Request, int]]] = defaultdict(list)
    for request in scheduler.requests.values():
        for index, block_id in enumerate(request.block_ids):
            places[block_id].append((request, index))
    hashes: dict[RequestId, list[bytes]] = {}
    for block_id, holders in places.items():
        block_hash = pool.block_hash(block_id)
        if len(holders) > 1:
            groups = {r.fork_of or r.request_id for r, _ in holders}
            assert block_hash is not None or len(groups) == 1, f"block {block_id} shared"
            prefixes = {tuple(r.all_token_ids[: (i + 1) * block_size]) for r, i in holders}
            assert len(prefixes) == 1, f"block {block_id} shared by different prefixes"
        for request, index in holders:
            imported = scheduler._importing.get(request.request_id)
            # An importing request's prefix-cache hits are computed; the rest is being pulled.
            num_computed = (
                imported.first_index * block_size
                if imported is not None
                else request.num_computed_tokens
            )
            if len(holders) > 1 or block_hash is not None:
                assert (index + 1) * block_size <= num_computed, (
                    f"block {block_id} shared or cached before its tokens were computed"
                )
            if block_hash is not None:
                if request.request_id not in hashes:
                    hashes[request.request_id] = _chain_hashes(
                        request.all_token_ids,
                        block_size,
                        lambda i, r=request: scheduler.kv._block_images(r, i),
                    )
                assert hashes[request.request_id][index] == block_hash, (
                    f"cached block {block_id} holds other tokens than {request.request_id}'s"
                )


def _check_swap_blocks(scheduler: Scheduler) -> None:
    kv, block_size = scheduler.kv, scheduler.config.block_size
    held: list[int] = []
    for request in scheduler.requests.values():
        swap_ids = kv.swap_block_ids(request.request_id)
        if request.status is RequestStatus.SWAPPED:
            assert not request.block_ids
            assert len(swap_ids) == -(-request.num_computed_tokens // block_size) > 0
        else:
            assert not swap_ids
        held += swap_ids
    assert len(held) == len(set(held)), "a swap block is held twice"
    assert set(kv._state) <= set(scheduler.requests), "KV bookkeeping of a finished request"
    # Swap blocks read by the step in flight come back at the next schedule().
    pending = len(scheduler._swap_blocks_to_free)
    assert kv.swap.num_free_blocks + len(held) + pending == kv.swap.num_blocks


def assert_all_free(scheduler: Scheduler) -> None:
    """No request holds anything: every device block is free (cached or fresh)."""
    assert not scheduler.requests
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks
    assert scheduler.kv.swap.num_free_blocks == scheduler.kv.swap.num_blocks
    # No per-request bookkeeping outlives its request.
    assert not scheduler.kv._state and not scheduler.waiting._keys
    assert not scheduler._pending_forks and not scheduler._on_workers


def _chain_hashes(
    token_ids: list[int], block_size: int, extra: Callable[[int], bytes] = lambda index: b""
) -> list[BlockHash]:
    """The block hashes the core computes (through its module, so monkeypatches apply);
    `extra(index)`: what else block `index`'s hash covers (its images' content)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(
            kv_cache_manager.hash_block_tokens(
                hashes[-1] if hashes else None,
                token_ids[start : start + block_size],
                extra(start // block_size),
            )
        )
    return hashes


class FakeWorker:
    """Plays the workers' side of the step contract on a model KV cache.

    Each KV slot holds the identity of the token prefix it was computed for. A step applies
    the swap-outs, swap-ins and copies, then checks that every computed position of every
    scheduled request holds its prefix (prefix hits, forks and swaps included) and writes the
    scheduled positions, never into a block that is shared or cached. The block tables and
    tokens are rebuilt from the step messages alone (new requests in full, then diffs).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        config = scheduler.config
        self.scheduler = scheduler
        self.block_size = config.block_size
        self.kv: list[list[object]] = [[None] * config.block_size for _ in range(config.num_blocks)]
        self.swap: list[list[object]] = [
            [None] * config.block_size for _ in range(config.num_swap_blocks)
        ]
        self.tables: dict[RequestId, list[int]] = {}
        self.tokens: dict[RequestId, list[int]] = {}

    def execute(self, output: SchedulerOutput, sample: Callable[[str], int]) -> ModelRunnerOutput:
        pool = self.scheduler.kv.pool
        for request_id in output.finished_request_ids:
            self.tables.pop(request_id)
            self.tokens.pop(request_id)
        for device, swap in output.blocks_to_swap_out:
            self.swap[swap] = list(self.kv[device])
        for swap, device in output.blocks_to_swap_in:
            # A fork may already share a block swapped in this step: it reads it after this.
            assert pool.block_hash(device) is None, f"swap-in over cached block {device}"
            self.kv[device] = list(self.swap[swap])
        for src, dst in output.blocks_to_copy:
            self._check_private(pool, dst)
            self.kv[dst] = list(self.kv[src])
        starts: dict[RequestId, int] = {}
        for new in output.new_requests:
            assert new.request_id not in self.tables, f"{new.request_id} sent twice"
            self.tables[new.request_id] = list(new.block_ids)
            self.tokens[new.request_id] = list(new.token_ids)
            starts[new.request_id] = new.num_computed_tokens
        for cached in output.cached_requests:
            self.tables[cached.request_id].extend(cached.new_block_ids)
            starts[cached.request_id] = cached.num_computed_tokens
        sampled = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            table, tokens = self.tables[request_id], self.tokens[request_id]
            assert table == self.scheduler.requests[request_id].block_ids
            start = starts[request_id]
            for pos in range(start):
                assert self._slot(table, pos) == tuple(tokens[: pos + 1]), (request_id, pos)
            for pos in range(start, start + num_tokens):
                block_id = table[pos // self.block_size]
                self._check_private(pool, block_id)
                self.kv[block_id][pos % self.block_size] = tuple(tokens[: pos + 1])
            if start + num_tokens == len(tokens):
                token = sample(request_id)
                tokens.append(token)
                sampled[request_id] = SampledToken(token)
        return ModelRunnerOutput(output.step_id, sampled)

    def _slot(self, table: list[int], pos: int) -> object:
        return self.kv[table[pos // self.block_size]][pos % self.block_size]

    @staticmethod
    def _check_private(pool: BlockPool, block_id: int) -> None:
        assert pool.ref_count(block_id) == 1, f"write into shared block {block_id}"
        assert pool.block_hash(block_id) is None, f"write into cached block {block_id}"
