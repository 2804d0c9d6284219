"""The fuzzer's requests are drawn from (seed, index) alone: the same in every run, every
kind drawable, and a drawn GenerateRequest spec builds the protobuf it describes. No mesh."""

from __future__ import annotations

from hypothesis import strategies as st

from bench.fuzz.drawing import draw
from bench.fuzz.plan import KINDS, Plan
from bench.fuzz.probes import generate_request
from bench.fuzz.specs import GrpcGenerate, ModelFacts, Storm

FACTS = ModelFacts("tiny", vocab_size=512, max_model_len=2048)


def test_a_draw_depends_on_seed_and_index_alone() -> None:
    strategy = st.lists(st.text(), min_size=2)
    assert draw(strategy, 7, 3) == draw(strategy, 7, 3)
    assert (
        len({repr(draw(strategy, 7, i)) for i in range(20)}) > 15
    )  # not the same value over again
    assert draw(strategy, 7, 3) != draw(strategy, 8, 3)


def test_a_plan_is_reproducible_and_draws_every_kind() -> None:
    plan, again = Plan(FACTS, 1024, seed=5), Plan(FACTS, 1024, seed=5)
    probes = list(plan.probes(150))
    assert [p.kind for p in probes[: len(KINDS)]] == list(KINDS)  # each kind at least once
    assert [repr(p.spec) for p in probes] == [repr(again.probe(p.index).spec) for p in probes]
    assert sum(p.num_requests for p in probes) >= 150
    storms = [p.spec for p in probes if isinstance(p.spec, Storm)]
    assert storms and all(5 <= len(s.clients) <= 30 for s in storms)


def test_grpc_specs_build_the_request_they_describe() -> None:
    spec = GrpcGenerate(
        {
            "prompt": ("ids_repeat", 5, 3),
            "request_id": "r",
            "n": 2,
            "sampling": {"temperature": float("nan"), "seed": 2**64 - 1},
            "stopping": {"max_tokens": 4, "stop": ["a", ""], "ignore_eos": True},
        }
    )
    request = generate_request(spec.fields)
    assert list(request.token_ids.ids) == [5, 5, 5] and request.request_id == "r" and request.n == 2
    assert (
        request.sampling.seed == 2**64 - 1
        and request.sampling.temperature != request.sampling.temperature
    )
    assert list(request.stopping.stop) == ["a", ""] and request.stopping.ignore_eos
    plan = Plan(FACTS, 1024, seed=1, weights={"grpc_fields": 1.0})
    for index in range(60):  # every drawn spec fits the protobuf's types
        generate_request(plan.probe(index).spec.fields)
