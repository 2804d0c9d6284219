"""Suffix decoding's proposer (scheduler_svc/core/suffix_decoding.py): drafts from a
request's own tokens and from earlier requests' outputs, checked by hand on small cases and
against a brute-force reference that counts every substring afresh at each call."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from pagemesh.runtime.speculative_config import SpeculativeConfig
from scheduler_svc.core.suffix_decoding import SuffixProposer, _Node, _SuffixTree

BIG = 150_000  # token ids as large as real vocabularies'


def suffix(**settings: float) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", **settings)  # type: ignore[arg-type]


# -- the reference: every substring counted from scratch ----------------------------------


def substring_counts(seqs: Sequence[Sequence[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def reference_best(
    counts: Counter[tuple[int, ...]],
    tokens: Sequence[int],
    config: SpeculativeConfig,
    max_drafts: int,
    best: tuple[list[int], float, int],
) -> tuple[list[int], float, int]:
    """The module docstring's rule, spelled out: every match length, greedy drafts, the
    highest score, ties to the longer match."""
    depth = config.suffix_decoding_max_tree_depth
    children: dict[tuple[int, ...], dict[int, int]] = {}
    for path, count in counts.items():
        children.setdefault(path[:-1], {})[path[-1]] = count
    for m in range(1, min(depth - 1, len(tokens)) + 1):
        path = tuple(tokens[len(tokens) - m :])
        if path not in counts:
            continue
        budget = min(max_drafts, int(config.suffix_decoding_max_spec_factor * m + 1e-6), depth - m)
        drafted: list[int] = []
        prob, score = 1.0, 0.0
        while len(drafted) < budget and children.get(path):
            kids = children[path]
            token = min(kids, key=lambda t: (-kids[t], t))
            prob *= kids[token] / sum(kids.values())
            if prob < config.suffix_decoding_min_token_prob:
                break
            drafted.append(token)
            score += prob
            path += (token,)
        if score > best[1] or (score == best[1] and m > best[2]):
            best = (drafted, score, m)
    return best


def reference_propose(
    prompt: Sequence[int],
    output: Sequence[int],
    global_seqs: Sequence[Sequence[int]] | None,
    config: SpeculativeConfig,
    max_drafts: int,
) -> list[int]:
    if max_drafts <= 0:
        return []
    depth = config.suffix_decoding_max_tree_depth
    tokens = list(prompt) + list(output)
    best = reference_best(
        substring_counts([tokens], depth), tokens, config, max_drafts, ([], 0.0, 0)
    )
    if global_seqs is not None:
        best = reference_best(
            substring_counts(global_seqs, depth),
            tokens,
            config,
            max_drafts,
            (best[0], best[1], depth),
        )
    return best[0]


def check_tree(tree: _SuffixTree) -> None:
    """Totals are the children's counts, no count is zero, a known best leads."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        counts = {token: child.count for token, child in node.children.items()}
        assert node.total == sum(counts.values())
        assert all(count > 0 for count in counts.values())
        if node.best is not None:
            assert node.best == min(counts, key=lambda t: (-counts[t], t))
        stack.extend(c for c in node.children.values() if type(c) is _Node)


# -- behaviour, by hand -------------------------------------------------------------------


def test_drafts_copy_a_repeated_span_of_the_prompt() -> None:
    span = [BIG + i for i in range(10)]
    prompt = span + [7] + span[:5]
    proposer = SuffixProposer(suffix())
    assert proposer.propose("r", prompt, [], 24) == span[5:]  # 5 matched: 5 drafts
    assert proposer.propose("r", prompt, [], 3) == span[5:8]
    # One more token matched: six drafts, through the span's end into what followed it.
    assert proposer.propose("r", prompt, [span[5]], 24) == span[6:] + [7, span[0]]


def test_the_continuation_with_the_highest_count_wins() -> None:
    proposer = SuffixProposer(suffix(suffix_decoding_min_token_prob=0.0))
    prompt = [5, 6, 1, 9, 5, 6, 2, 9, 5, 6, 2, 9, 5, 6]  # "5 6" went on to 2 twice, 1 once
    assert proposer.propose("r", prompt, [], 1) == [2]
    assert proposer.propose("r", prompt, [], 2) == [2, 9]


def test_min_token_prob_cuts_a_draft() -> None:
    prompt = [5, 1, 7, 5, 2, 8, 5, 3, 9, 5]  # "5" went on to 1, 2 and 3: a third each
    for min_prob, drafts in ((0.3, [1]), (0.4, [])):  # ties: the lowest token
        proposer = SuffixProposer(suffix(suffix_decoding_min_token_prob=min_prob))
        assert proposer.propose("r", prompt, [], 4) == drafts
    # "1" went on to 2 twice of three, "1 2" to 4 and 5 once each: 2/3, then 1/3.
    prompt = [10, 1, 2, 4, 11, 1, 2, 5, 12, 1, 3, 6, 13, 1]
    for min_prob, drafts in ((0.3, [2, 4, 11, 1]), (0.5, [2]), (0.7, [])):
        proposer = SuffixProposer(
            suffix(suffix_decoding_min_token_prob=min_prob, suffix_decoding_max_spec_factor=4.0)
        )
        assert proposer.propose("r", prompt, [], 4) == drafts


def test_max_spec_factor_bounds_the_length_by_the_match() -> None:
    span = list(range(100, 116))
    prompt = span + [7] + span[:6]  # a match of 6 tokens, 10 more to copy
    for factor, num_drafts in ((0.5, 3), (1.0, 6), (2.0, 12), (0.0, 0)):
        proposer = SuffixProposer(suffix(suffix_decoding_max_spec_factor=factor))
        assert proposer.propose("r", prompt, [], 24) == (span + [7] + span)[6 : 6 + num_drafts]


def test_the_tree_depth_bounds_match_plus_drafts() -> None:
    span = list(range(100, 116))
    prompt = span + [7] + span[:6]
    proposer = SuffixProposer(suffix(suffix_decoding_max_tree_depth=8))
    # A 6-token match leaves 2 of the depth; a 4-token one 4 (and factor 1 allows 4).
    assert proposer.propose("r", prompt, [], 24) == span[6:10]
    assert (
        SuffixProposer(suffix(suffix_decoding_max_tree_depth=1)).propose("r", prompt, [], 24) == []
    )


def test_nothing_matches_no_drafts() -> None:
    proposer = SuffixProposer(suffix())
    assert proposer.propose("r", [1, 2, 3, 4], [5], 24) == []
    assert proposer.propose("r", [1, 2, 3, 4], [5, 1], 0) == []  # tokens taken, no drafts
    assert proposer.propose("r", [1, 2, 3, 4], [5, 1], 24) == [2]
    assert proposer.propose("e", [], [], 24) == []
    assert proposer.max_drafts("r") == 24
    proposer.observe("r", 4, 0)
    assert proposer.max_drafts("r") == 24


def test_a_later_request_drafts_from_an_earlier_answer() -> None:
    answer = [BIG + i for i in range(12)]
    for max_cached, expected in ((10, answer[4:8]), (0, [])):
        proposer = SuffixProposer(suffix(suffix_decoding_max_cached_requests=max_cached))
        for n in range(1, len(answer) + 1):
            proposer.propose("a", [1, 2, 3], answer[:n], 24)
        proposer.forget("a")
        assert proposer.propose("b", [9, 9] + answer[:4], [], 24) == expected
        # A running request's output is drafted from too.
        proposer.propose("c", [4, 5], answer[:4], 24)
        assert proposer.propose("d", [answer[0]], [answer[1]], 1) == (
            answer[2:3] if max_cached else []
        )


def test_fifo_eviction_takes_out_exactly_the_oldest_answer() -> None:
    answers = {"a": [1, 2, 3, 4, 1, 2, 5], "b": [2, 3, 4, 9, 2, 3], "c": [3, 4, 1, 2, 3]}
    proposer = SuffixProposer(suffix(suffix_decoding_max_cached_requests=2))
    for request_id, answer in answers.items():
        proposer.propose(request_id, [7, 7], answer, 24)
        proposer.forget(request_id)
    tree = proposer._global
    assert tree is not None
    assert tree.counts() == substring_counts([answers["b"], answers["c"]], 24)
    check_tree(tree)
    fresh = SuffixProposer(suffix(suffix_decoding_max_cached_requests=2))
    for request_id in "bc":
        fresh.propose(request_id, [7, 7], answers[request_id], 24)
        fresh.forget(request_id)
    for pattern in ([1, 2], [4, 1], [2, 3, 4], [3, 4], [9]):
        assert proposer.propose("q", [8] + pattern, [], 24) == fresh.propose(
            "q", [8] + pattern, [], 24
        )
    # "a" again: its old answer, if cached, would go first; "b" is evicted as it ends.
    proposer.propose("b", [7, 7], [], 24)
    assert tree.counts() == substring_counts([answers["c"]], 24)
    proposer.forget("b")
    assert tree.counts() == substring_counts([answers["c"]], 24)  # no output: not cached


def test_a_shorter_output_starts_the_request_over() -> None:
    proposer = SuffixProposer(suffix())
    proposer.propose("r", [1, 2, 3, 1], [2, 3, 4, 5], 24)
    assert proposer.propose("r", [1, 2, 3, 1], [2], 24) == [3, 1]  # not 3 4 5 from before
    assert proposer._global is not None
    assert proposer._global.counts() == substring_counts([[2]], 24)
    assert proposer.propose("r", [1, 2, 3], [1], 24) == [2]  # a new prompt: over again
    assert proposer._global.counts() == substring_counts([[1]], 24)


# -- properties: incremental equals from scratch equals the reference ---------------------


@pytest.mark.parametrize("seed", range(12))
def test_feeding_tokens_one_by_one_equals_one_call(seed: int) -> None:
    rng = random.Random(seed)
    config = suffix(
        suffix_decoding_max_tree_depth=rng.choice([3, 6, 24]),
        suffix_decoding_min_token_prob=rng.choice([0.0, 0.1, 0.3]),
    )
    prompt = [rng.randrange(4) for _ in range(rng.randrange(40))]
    output = [rng.randrange(4) for _ in range(60)]
    stepwise = SuffixProposer(config)
    n = 0
    while n < len(output):
        n = min(len(output), n + rng.randint(1, 5))
        drafts = stepwise.propose("r", prompt, output[:n], 8)
        assert drafts == SuffixProposer(config).propose("r", prompt, output[:n], 8)
        assert drafts == reference_propose(prompt, output[:n], [output[:n]], config, 8)


@pytest.mark.parametrize("seed", range(30))
def test_many_requests_match_the_reference(seed: int) -> None:
    """Requests interleave, end, restart and are evicted; every draft and the global tree's
    counts equal the reference's, built from what should be in the trees."""
    rng = random.Random(seed)
    config = suffix(
        num_speculative_tokens=rng.choice([1, 4, 24]),
        suffix_decoding_max_tree_depth=rng.choice([1, 2, 3, 5, 8, 24]),
        suffix_decoding_max_cached_requests=rng.choice([0, 1, 2, 3]),
        suffix_decoding_max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
        suffix_decoding_min_token_prob=rng.choice([0.0, 0.1, 0.4]),
    )
    vocab = rng.choice([2, 3, 5])
    proposer = SuffixProposer(config)
    running: dict[str, tuple[list[int], list[int]]] = {}  # prompt, output seen
    cached: dict[str, list[int]] = {}  # in FIFO order
    for _ in range(120):
        request_id = f"r{rng.randrange(5)}"
        if request_id in running and rng.random() < 0.15:
            proposer.forget(request_id)
            prompt, output = running.pop(request_id)
            if output and config.suffix_decoding_max_cached_requests:
                cached[request_id] = output
                while len(cached) > config.suffix_decoding_max_cached_requests:
                    del cached[next(iter(cached))]
            continue
        if request_id not in running or rng.random() < 0.05:  # (re)starts
            cached.pop(request_id, None)
            old = len(running[request_id][0]) if request_id in running else -1
            prompt = [
                rng.randrange(vocab) for _ in range(rng.choice([n for n in range(12) if n != old]))
            ]  # another length: a restart
            output = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
        else:
            prompt, output = running[request_id]
            output = output + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        running[request_id] = (prompt, output)
        max_drafts = rng.randrange(config.num_speculative_tokens + 1)
        global_seqs = None
        if config.suffix_decoding_max_cached_requests:
            global_seqs = [*cached.values(), *(o for _, o in running.values())]
        assert proposer.propose(request_id, prompt, output, max_drafts) == reference_propose(
            prompt, output, global_seqs, config, max_drafts
        )
        if proposer._global is not None:
            assert global_seqs is not None
            assert proposer._global.counts() == substring_counts(
                global_seqs, config.suffix_decoding_max_tree_depth
            )
            check_tree(proposer._global)
