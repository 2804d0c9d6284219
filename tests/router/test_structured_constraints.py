"""Output constraints at the router: every kind compiles to llguidance's grammar and travels
to the scheduler; what cannot compile is INVALID_ARGUMENT naming what is wrong, before any
scheduler sees the request."""

from __future__ import annotations

import json

import grpc
import pytest

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from protos.pagemesh.v1 import generate_pb2
from router.structured import ConstraintError, GrammarCompiler, to_grammar
from tests.support.bpe_folder import write_bpe_folder
from tests.support.scripted_router import Router, request, run

VOCAB_SIZE, EOS = 300, [2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


GOOD = {
    "json_schema": OutputConstraint(
        "json_schema",
        json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
    ),
    "json_object": OutputConstraint("json_object"),
    "regex": OutputConstraint("regex", r"[a-z]{3}\d"),
    "lark": OutputConstraint("grammar", 'start: "a" b*\nb: "b"'),
    "gbnf": OutputConstraint("grammar", 'root ::= "yes" | "no"'),
    "choice": OutputConstraint("choice", ("left", "right")),
}
BAD = {  # constraint, words the message must hold
    "schema not JSON": (OutputConstraint("json_schema", "{type: object"), "not valid JSON"),
    "schema not an object": (OutputConstraint("json_schema", "[1, 2]"), "must be a JSON object"),
    "unsupported keyword": (
        OutputConstraint(
            "json_schema", json.dumps({"type": "object", "dependentSchemas": {"a": {}}})
        ),
        "dependentSchemas",
    ),
    "bad regex": (OutputConstraint("regex", "(abc"), "regex does not compile"),
    "bad grammar": (OutputConstraint("grammar", "start: missing_rule"), "grammar does not compile"),
    "empty regex": (OutputConstraint("regex", " "), "regex is empty"),
    "no choices": (OutputConstraint("choice", ()), "1 to 1024 strings"),
    "empty choice": (OutputConstraint("choice", ("a", "")), "non-empty string"),
    "no kind": (OutputConstraint(""), "constraint kind must be one of"),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_every_kind_compiles_and_checks_against_the_vocabulary(
    name: str, tokenizer: Tokenizer
) -> None:
    grammar = GrammarCompiler(tokenizer).compile(GOOD[name], VOCAB_SIZE, EOS)
    assert grammar == to_grammar(GOOD[name]) and grammar


@pytest.mark.parametrize("name", list(BAD))
def test_what_cannot_compile_says_what_is_wrong(name: str, tokenizer: Tokenizer) -> None:
    constraint, words = BAD[name]
    with pytest.raises(ConstraintError, match=words):
        GrammarCompiler(tokenizer).compile(constraint, VOCAB_SIZE, EOS)


def test_the_constraint_reaches_the_scheduler_and_a_bad_one_never_does(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            scheduler = await router.add_scheduler("a")
            good = request(tokenizer, 3)
            good.stopping.ignore_eos = False
            good.constraint.regex = "[a-z]+"
            await router.generate(good)
            assert len(scheduler.requests) == 1
            assert scheduler.requests[0].grammar == to_grammar(OutputConstraint("regex", "[a-z]+"))
            for bad, words in (
                (generate_pb2.OutputConstraint(json_schema="{nope"), "not valid JSON"),
                (generate_pb2.OutputConstraint(regex="[z-a]"), "regex does not compile"),
                (generate_pb2.OutputConstraint(), "constraint kind must be one of"),
            ):
                pb = request(tokenizer, 3)
                pb.constraint.CopyFrom(bad)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await router.generate(pb)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert words in info.value.details()
            pb = request(tokenizer, 3)
            pb.constraint.json_object = True
            pb.stopping.ignore_eos = True
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(pb)
            assert "ignore_eos cannot be combined" in info.value.details()
            assert len(scheduler.requests) == 1  # none of the bad ones was sent

    run(scenario())


def test_choices_are_bounded_by_size_and_must_be_unicode() -> None:
    from router.structured import MAX_CONSTRAINT_CHARS

    with pytest.raises(ConstraintError, match="characters together"):
        to_grammar(OutputConstraint("choice", ("a" * MAX_CONSTRAINT_CHARS, "b")))
    with pytest.raises(ConstraintError, match="choice 1 is not valid Unicode"):
        to_grammar(OutputConstraint("choice", ("yes", "no\ud800")))
    assert to_grammar(OutputConstraint("choice", ("yes", "no")))
