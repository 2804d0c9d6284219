"""The routing policies as pure decisions."""

from __future__ import annotations

import pytest

from protos.block_hash import hash_request_blocks
from router.routing import GroupLoad, PrefixIndex, RoutingConfig, RoutingPolicy


def groups(**outstanding: int) -> list[GroupLoad]:
    return [GroupLoad(name, outstanding_tokens=tokens) for name, tokens in outstanding.items()]


def hashes(tokens: list[int]) -> list:
    return hash_request_blocks(tokens, 4)


def test_round_robin_cycles_and_skips_excluded() -> None:
    router = RoutingPolicy(RoutingConfig("round_robin"))
    picks = [router.pick(groups(a=0, b=0, c=0)) for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    assert router.pick(groups(a=0, b=0), exclude=frozenset({"a"})) == "b"
    assert router.pick(groups(a=0), exclude=frozenset({"a"})) is None


def test_least_load_prefers_fewest_outstanding_tokens() -> None:
    router = RoutingPolicy(RoutingConfig("least_load"))
    assert router.pick(groups(a=500, b=20, c=300)) == "b"


def test_prefix_aware_follows_the_longest_prefix() -> None:
    router = RoutingPolicy(RoutingConfig("prefix_aware"))
    shared = list(range(100, 116))  # four blocks of 4
    router.record(hashes(shared + [1, 2, 3, 4]), "b")
    router.record(hashes(shared[:8] + [9, 9, 9, 9]), "a")
    assert router.pick(groups(a=0, b=0, c=0), hashes(shared + [5, 6, 7, 8])) == "b"
    assert router.pick(groups(a=0, b=0, c=0), hashes(shared[:8] + [9, 9, 9, 9])) in {"a", "b"}
    # No known prefix: least load decides.
    assert router.pick(groups(a=9, b=5, c=1), hashes([7] * 8)) == "c"


def test_prefix_aware_yields_when_its_group_is_overloaded() -> None:
    router = RoutingPolicy(
        RoutingConfig("prefix_aware", balance_abs_threshold_tokens=1000, balance_rel_threshold=1.5)
    )
    prompt = hashes(list(range(16)))
    router.record(prompt, "a")
    assert router.pick(groups(a=900, b=0), prompt) == "a"  # within the absolute slack
    assert router.pick(groups(a=5000, b=0), prompt) == "b"  # far busier: balance wins


def test_index_is_bounded_and_forgets_dead_groups() -> None:
    index = PrefixIndex(max_blocks=4)
    index.record(hashes(list(range(12))), "a")  # 3 blocks
    index.record(hashes(list(range(50, 62))), "b")  # 3 more: the oldest go
    assert len(index) == 4
    index.forget_group("b")
    assert index.match(hashes(list(range(50, 62))), ["a", "b"]) == {"a": 0, "b": 0}


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig("random")


def test_an_adapter_goes_to_its_holders_then_to_room_then_anywhere() -> None:
    router = RoutingPolicy(
        RoutingConfig("least_load", balance_abs_threshold_tokens=1000, balance_rel_threshold=1.5)
    )
    held, room, full = groups(a=300), groups(b=0), groups(c=0)
    assert [g.scheduler_id for g in router.adapter_groups(held, room, full)] == ["a"]
    assert [g.scheduler_id for g in router.adapter_groups([], room, full)] == ["b"]
    assert [g.scheduler_id for g in router.adapter_groups([], [], full)] == ["c"]
    # Every holder much busier than a group with room (by both thresholds): that group
    # loads the adapter too.
    busy = groups(a=5000, d=2000)
    assert [g.scheduler_id for g in router.adapter_groups(busy, groups(b=100), full)] == ["b"]
    # One holder within the bounds: the holders keep it (its weights are loaded there).
    some_busy = groups(a=5000, d=900)
    assert [g.scheduler_id for g in router.adapter_groups(some_busy, groups(b=100), full)] == [
        "a",
        "d",
    ]
