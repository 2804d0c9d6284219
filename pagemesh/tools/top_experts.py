"""The hot experts of mixture-of-experts groups, for `pagemesh top`: from the workers'
`pagemesh:worker_moe_expert_tokens_total{group, layer, expert}` counters, each group's
experts that took the largest share of their layer's tokens over the refresh window (since
the workers started where the window routed nothing). A share of 1 / experts is an even load; an
expert
balancer (vLLM's EPLB) moves or copies the ones far above it."""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.runtime import metrics

EXPERT_TOKENS = metrics.counter_sample(metrics.EXPERT_TOKENS)

# source ("<kind>:<id>") -> sample name -> [(labels, value)], as top_snapshot parses them.
ParsedMetrics = dict[str, dict[str, list[tuple[dict[str, str], float]]]]


@dataclass(frozen=True)
class HotExpert:
    layer: int
    expert: int
    share: float  # of its layer's routed tokens in the window, 0..1
    num_experts: int  # in that layer: 1 / num_experts is an even share

    def label(self) -> str:
        return f"L{self.layer}·E{self.expert} {self.share:.0%}"


def _loads(parsed: ParsedMetrics) -> dict[str, dict[tuple[str, int, int], float]]:
    """source -> {(group, layer, expert): tokens} of its scrape."""
    found: dict[str, dict[tuple[str, int, int], float]] = {}
    for source, samples in parsed.items():
        for labels, value in samples.get(EXPERT_TOKENS, ()):
            key = (labels.get("group", ""), int(labels["layer"]), int(labels["expert"]))
            found.setdefault(source, {})[key] = value
    return found


def hot_experts(
    prev: ParsedMetrics | None, cur: ParsedMetrics, limit: int = 2
) -> dict[str, list[HotExpert]]:
    """group -> its `limit` hottest experts (largest share of their layer's tokens), hottest
    first: over the window since `prev`, or since the workers started for a group that
    routed nothing in it (an idle mesh still shows where its load went). A worker whose
    counters went down restarted: its current value is its increase."""
    window = _ranked(_totals(prev if prev is not None else {}, cur), limit)
    since_start = _ranked(_totals({}, cur), limit)
    return {group: window.get(group) or hot for group, hot in since_start.items()}


def _totals(prev: ParsedMetrics, cur: ParsedMetrics) -> dict[tuple[str, int, int], float]:
    """(group, layer, expert) -> tokens routed between the two scrapes, over all workers."""
    before = _loads(prev)
    totals: dict[tuple[str, int, int], float] = {}
    for source, now in _loads(cur).items():
        then = before.get(source, {})
        for key, value in now.items():
            old = then.get(key, 0.0)
            totals[key] = totals.get(key, 0.0) + (value - old if value >= old else value)
    return totals


def _ranked(totals: dict[tuple[str, int, int], float], limit: int) -> dict[str, list[HotExpert]]:
    per_layer: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for (group, layer, expert), tokens in totals.items():
        per_layer.setdefault((group, layer), []).append((expert, tokens))
    ranked: dict[str, list[HotExpert]] = {}
    for (group, layer), experts in per_layer.items():
        layer_tokens = sum(tokens for _, tokens in experts)
        if layer_tokens <= 0:
            continue
        ranked.setdefault(group, []).extend(
            HotExpert(layer, expert, tokens / layer_tokens, len(experts))
            for expert, tokens in experts
        )
    return {
        group: sorted(hot, key=lambda h: (-h.share, h.layer, h.expert))[:limit]
        for group, hot in ranked.items()
    }
