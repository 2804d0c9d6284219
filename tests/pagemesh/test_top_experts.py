"""`pagemesh top`'s hot experts, from two scrapes of the workers' expert-token counters."""

from __future__ import annotations

from pagemesh.tools.top_experts import EXPERT_TOKENS, hot_experts


def scrape(group: str, layer_tokens: dict[int, list[float]]) -> dict:
    return {
        EXPERT_TOKENS: [
            ({"group": group, "layer": str(layer), "expert": str(e)}, value)
            for layer, tokens in layer_tokens.items()
            for e, value in enumerate(tokens)
        ]
    }


def test_the_hottest_share_of_the_window_wins_across_ranks_and_layers() -> None:
    # Two EP ranks each count their share of the tokens; layer 3's expert 1 takes 60%.
    prev = {
        "worker:a": scrape("g", {1: [10, 10, 10, 10], 3: [5, 5, 5, 5]}),
        "worker:b": scrape("g", {1: [10, 10, 10, 10], 3: [5, 5, 5, 5]}),
    }
    cur = {
        "worker:a": scrape("g", {1: [20, 20, 20, 20], 3: [10, 20, 10, 5]}),
        "worker:b": scrape("g", {1: [20, 20, 20, 20], 3: [10, 20, 10, 5]}),
    }
    hot = hot_experts(prev, cur)["g"]
    assert [(h.layer, h.expert) for h in hot] == [(3, 1), (1, 0)]
    assert abs(hot[0].share - 60 / 100) < 1e-9 and hot[0].num_experts == 4
    assert hot[0].label() == "L3·E1 60%"
    # Without an earlier scrape, or when the window routed nothing: since the start.
    assert hot_experts(None, cur)["g"][0].layer == 3
    assert hot_experts(cur, cur)["g"][0].layer == 3


def test_a_restarted_worker_counts_from_zero_and_dense_groups_are_absent() -> None:
    prev = {"worker:a": scrape("g", {0: [50, 50]})}
    cur = {"worker:a": scrape("g", {0: [1, 3]}), "worker:dense": {}}
    hot = hot_experts(prev, cur)
    assert [(h.expert, h.share) for h in hot["g"]] == [(1, 0.75), (0, 0.25)]
    assert set(hot) == {"g"}
