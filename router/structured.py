"""Structured output at the router: a client's `OutputConstraint` compiled into the one
grammar format the workers apply (llguidance's), and checked against the model's real
vocabulary before anything is scheduled.

llguidance (pip, no dependencies, CPU) rather than xgrammar: one library covers every kind
the APIs accept (JSON Schema, regex, Lark and GBNF grammars, choices), its matcher can be
advanced over tokens already generated (what a resumed request needs) and computes a
request's mask in tens of microseconds with no per-token Python, and it builds its
vocabulary view from the same Hugging Face tokenizer the router already has. A grammar it
cannot compile is refused here with its own message, which names what is wrong.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence

from pagemesh.api.options.constraint import CONSTRAINT_KINDS, OutputConstraint
from pagemesh.runtime.tokenizer import Tokenizer

MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 1_000_000  # a schema or grammar past this is refused unread
CACHED_GRAMMARS = 256  # compiled and checked grammars kept, least recently used dropped
# JSON as json.dumps writes it: ", " and ": ", no other whitespace. Flexible whitespace lets a
# model pad forever with newlines and tabs (a small model did, never closing the object);
# a schema may still ask for other settings through llguidance's "x-guidance" key.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}


class ConstraintError(ValueError):
    """A constraint that cannot be applied; the message says what to fix."""


class GrammarCompiler:
    """Compiles constraints for one model: its tokenizer, vocabulary size and EOS ids. The
    vocabulary view (llguidance's LLTokenizer, slow to build) is made on first use."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._views: dict[tuple[int, tuple[int, ...]], object] = {}
        self._compiled: OrderedDict[tuple[OutputConstraint, int, tuple[int, ...]], str] = (
            OrderedDict()
        )

    def compile(
        self, constraint: OutputConstraint, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> str:
        """The llguidance grammar of `constraint` (Lark text, or llguidance's JSON), checked
        against the model's
        vocabulary. Raises ConstraintError saying what is wrong. Blocking (the first call
        builds the vocabulary view, which is slow): the router calls it on a worker thread."""
        key = (constraint, vocab_size, tuple(eos_token_ids))
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        grammar = to_grammar(constraint)
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            grammar, self.vocabulary(vocab_size, tuple(eos_token_ids))
        )
        if is_error:
            raise ConstraintError(
                f"the {_NAMES.get(constraint.kind, 'constraint')} does not "
                f"compile: {messages[0] if messages else 'no reason given'}"
            )
        self._compiled[key] = grammar
        if len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return grammar

    def vocabulary(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> object:
        key = (vocab_size, eos_token_ids)
        if key not in self._views:
            self._views[key] = llguidance_tokenizer(
                self.tokenizer.hf, vocab_size, list(eos_token_ids)
            )
        return self._views[key]


def llguidance_tokenizer(hf_tokenizer: object, vocab_size: int, eos_token_ids: list[int]) -> object:
    """llguidance's view of a Hugging Face fast tokenizer, padded to the model's vocabulary
    (its logits' width), ending on the model's EOS ids."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        hf_tokenizer,
        n_vocab=vocab_size,  # type: ignore[arg-type]
        eos_token=eos_token_ids or None,
    )


def to_grammar(constraint: OutputConstraint) -> str:
    """The llguidance grammar (Lark text, or llguidance's JSON) of a constraint, checked for shape
    only (the
    vocabulary check is GrammarCompiler.compile's). Raises ConstraintError."""
    from llguidance import LLMatcher, grammar_from

    kind, value = constraint.kind, constraint.value
    if kind not in CONSTRAINT_KINDS:
        raise ConstraintError(
            f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}; got {kind or 'none'}"
        )
    if kind == "choice":
        return grammar_from("choice", json.dumps(list(_choices(value))))
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if not isinstance(value, str) or not value.strip():
        raise ConstraintError(f"the {_NAMES[kind]} is empty")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(
            f"the {_NAMES[kind]} is {len(value):,} characters; at most "
            f"{MAX_CONSTRAINT_CHARS:,} are accepted"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(
                "the JSON schema must be a JSON object (or true/false), "
                f"not {type(schema).__name__}"
            )
        return LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    try:
        return grammar_from("grammar", value)  # Lark, or GBNF converted to it
    except ValueError as exc:
        raise ConstraintError(f"the grammar is neither Lark nor GBNF: {exc}") from None


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConstraintError("choice must be a list of strings")
    if not 1 <= len(value) <= MAX_CHOICES:
        raise ConstraintError(f"choice must have 1 to {MAX_CHOICES} strings, got {len(value)}")
    if not all(isinstance(c, str) and c for c in value):
        raise ConstraintError("every choice must be a non-empty string")
    num_chars = sum(map(len, value))
    if num_chars > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(
            f"the choices are {num_chars:,} characters together; at most "
            f"{MAX_CONSTRAINT_CHARS:,} are accepted"
        )
    for index, choice in enumerate(value):
        try:
            choice.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConstraintError(
                f"choice {index} is not valid Unicode ({exc.reason}); send UTF-8 text"
            ) from None
    return tuple(value)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (for grammars built here, e.g. forced tool calls)."""
    return '"' + re.sub(r'(["\\])', r"\\\1", text).replace("\n", "\\n") + '"'
