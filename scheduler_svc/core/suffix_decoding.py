"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's `"method": "suffix"`, after
Arctic Inference's SuffixDecodingCache): drafts are the likeliest continuation of the
tokens' ending, counted over what was written before, in two trees.

- A request's own tree holds its prompt and, as they arrive, its output tokens: what it may
  copy from itself (a quoted document, code being edited, a list being repeated). Its output
  goes here too, so with `suffix_decoding_max_cached_requests == 0` it still drafts from
  what it wrote.
- The global tree holds the outputs of every running request and of the last
  `suffix_decoding_max_cached_requests` finished ones (oldest evicted first), so requests
  like earlier ones (agent loops, the same question again) draft from earlier answers.
  With 0 there is no global tree.

A tree is a suffix trie cut at `suffix_decoding_max_tree_depth` tokens: a path from the root
is a token string, its `count` the number of its occurrences and its `total` the number of
those that continue (into its children, whose counts sum to it). An occurrence that ends
where it is, like the tokens' own ending, which is always in its tree, adds to `count` but
not to `total`, so it does not dilute the odds of a continuation; nodes whose count drops to
zero are deleted, so no child has count zero. A string that occurred once is not spelled out
as nodes: it hangs off its deepest shared node as a tail, its sequence and a position, and
only a second occurrence turns the tail's head into a node. So ordinary text costs a few
nodes per token rather than one per token and depth.

Drafting: every suffix of the tokens' last `depth - 1` (match length m) that occurred before
with a continuation is a candidate, not only the longest: every suffix occurs in the own
tree (as the ending itself, which does not continue), a longer match may have no
continuation where a shorter one has, and a long match leaves little of the depth to draft
(m + drafts <= depth). From each, the draft follows the child with the highest count (ties:
the lowest token id, a function of the counts alone), its probability the product of
count / total along the way, until it falls below `suffix_decoding_min_token_prob`, the
tree ends, or it has min(max_drafts, floor(max_spec_factor * m)) tokens, vLLM's and
Arctic's bound, with no minimum: a one-token match is weak evidence and drafts
floor(factor) tokens (one at the default); a factor of 0 drafts nothing. The draft with the
highest score (the sum of its probabilities, the expected number kept) wins; ties go to the
longer match, then to the request's own tree.

The counts choose each draft's length, so `observe` keeps no back-off: halving after a miss,
as ngram does, would cut drafts the counts still call likely, and a wrong draft costs one
row of a step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pagemesh.runtime.speculative_config import SpeculativeConfig

# Keeps floor(max_spec_factor * m) from losing a token to float error (0.1 * 30 < 3): vLLM's.
_EPSILON = 1e-6


class _Node:
    """A token string that occurred more than once (or still occurs once after an
    eviction): `count` occurrences, `total` of them continuing into `children`; `best` is
    the token of the child with the highest count (ties: the lowest token), None when not
    known (recounted when needed)."""

    __slots__ = ("best", "children", "count", "total")

    def __init__(self, count: int) -> None:
        self.children: dict[int, _Node | _Tail] = {}
        self.count = count
        self.total = 0
        self.best: int | None = None


class _Tail:
    """The occurrence of `seq` from `start`, up to the depth: through nodes to `parent` (at
    depth pos - start), then alone along seq[pos:]. While it has tokens there it is
    parent.children[seq[pos]] and grows with seq for free; with none it ends at `parent`."""

    __slots__ = ("parent", "pos", "seq", "start")
    count = 1  # a tail is one occurrence

    def __init__(self, parent: _Node, seq: list[int], pos: int) -> None:
        self.parent, self.seq, self.pos, self.start = parent, seq, pos, pos


class _Sequence:
    """A sequence being added to a tree: its tokens, and its occurrences that can still
    grow (those starting in its last depth - 1 tokens), oldest first."""

    __slots__ = ("growing", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.growing: deque[_Tail] = deque()


class _Place(NamedTuple):
    """Where a match ends: at `node`, or inside `tail`, whose next token is tail.seq[next]."""

    node: _Node | None
    tail: _Tail | None
    next: int


class _Choice(NamedTuple):
    tokens: list[int]
    score: float
    match_len: int


def _promote(node: _Node, token: int, count: int) -> None:
    """Keeps `node.best` right after the child `token` grew to `count`."""
    best = node.best
    if best is None:
        if len(node.children) == 1:
            node.best = token
    elif best != token:
        other = node.children[best].count
        if count > other or (count == other and token < best):
            node.best = token


def _best_token(node: _Node) -> int:
    if node.best is None:
        node.best = min(node.children.items(), key=lambda item: (-item[1].count, item[0]))[0]
    return node.best


class _SuffixTree:
    """Every token string of at most `depth` tokens in the sequences added, with counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0)

    def extend(self, seq: _Sequence, tokens: Iterable[int]) -> None:
        """Appends `tokens` to `seq`: O(depth) per token, each growing occurrence one step."""
        for token in tokens:
            self._append(seq, token)

    def _append(self, seq: _Sequence, token: int) -> None:
        tokens, growing = seq.tokens, seq.growing
        end = len(tokens)
        tokens.append(token)
        growing.append(_Tail(self.root, tokens, end))
        for occurrence in growing:
            if occurrence.pos == end:  # it ends at a node: the token is its next step
                self._step(occurrence, token)
        if end + 1 - growing[0].start >= self.depth:
            growing.popleft()

    def _step(self, occurrence: _Tail, token: int) -> None:
        node = occurrence.parent
        node.total += 1
        child = node.children.get(token)
        if child is None:  # the first to continue so: it hangs there as a tail
            node.children[token] = occurrence
            _promote(node, token, 1)
            return
        if isinstance(child, _Tail):  # one other occurrence: its head becomes a shared node
            shared = self._split(node, token, child)
        else:
            shared = child
            shared.count += 1
        occurrence.parent, occurrence.pos = shared, occurrence.pos + 1
        _promote(node, token, shared.count)

    def _split(self, node: _Node, token: int, tail: _Tail) -> _Node:
        """A node for `tail`'s head, counting it and the occurrence arriving there; the
        tail, one token shorter, hangs below it (or ends at it). The tail object stays the
        same, so a sequence still growing it finds it where it now is."""
        shared = _Node(2)
        node.children[token] = shared
        tail.parent, tail.pos = shared, tail.pos + 1
        if tail.pos < min(tail.start + self.depth, len(tail.seq)):
            following = tail.seq[tail.pos]
            shared.children[following] = tail
            shared.total, shared.best = 1, following
        return shared

    def remove(self, tokens: list[int]) -> None:
        """Takes out every occurrence in `tokens`, a sequence added whole that no longer
        grows: counts drop along each one's path and what reaches zero is deleted."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children[token]
                node.total -= 1
                if node.best == token:
                    node.best = None  # it may no longer lead: recounted when next needed
                if child.count == 1:  # only this occurrence was there (with all below)
                    del node.children[token]
                    break
                assert type(child) is _Node
                child.count -= 1
                node = child

    def locate(self, tokens: list[int], begin: int, end: int) -> _Place | None:
        """Where tokens[begin:end] ends in the tree; None if it never occurred."""
        node = self.root
        for index in range(begin, end):
            child = node.children.get(tokens[index])
            if child is None:
                return None
            if isinstance(child, _Tail):
                seq, stop = child.seq, min(child.start + self.depth, len(child.seq))
                rest = end - index - 1
                at = child.pos + 1
                if at + rest > stop or seq[at : at + rest] != tokens[index + 1 : end]:
                    return None
                return _Place(None, child, at + rest)
            node = child
        return _Place(node, None, 0)

    def draft(self, place: _Place, budget: int, min_prob: float) -> tuple[list[int], float]:
        """The greedy draft from `place`, at most `budget` tokens, and its score."""
        node, tail, at = place
        drafted: list[int] = []
        prob = 1.0
        score = 0.0
        while len(drafted) < budget:
            if tail is not None:  # one occurrence: its tokens follow with the same odds
                stop = min(tail.start + self.depth, len(tail.seq), at + budget - len(drafted))
                for token in tail.seq[at:stop]:
                    drafted.append(token)
                    score += prob
                break
            assert node is not None
            if not node.total:
                break
            token = _best_token(node)
            child = node.children[token]
            prob *= child.count / node.total
            if prob < min_prob:
                break
            drafted.append(token)
            score += prob
            if isinstance(child, _Tail):
                tail, at = child, child.pos + 1
            else:
                node = child
        return drafted, score

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every string's count, tails spelled out: two trees holding the same occurrences
        give equal dicts whatever their shape (for tests)."""
        found: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for token, child in node.children.items():
                if isinstance(child, _Node):
                    found[path + (token,)] = child.count
                    stack.append((path + (token,), child))
                    continue
                stop = min(child.start + self.depth, len(child.seq))
                for end in range(child.pos + 1, stop + 1):
                    found[path + tuple(child.seq[child.pos : end])] = 1
        return found


def _growing_places(seq: _Sequence) -> list[tuple[int, _Place]]:
    """The places of the sequence's ending's suffixes (match length, place) that continue
    somewhere. One inside a tail is the ending alone, which does not continue."""
    n = len(seq.tokens)
    return [
        (n - occ.start, _Place(occ.parent, None, 0))
        for occ in seq.growing
        if occ.pos == n and occ.parent.total
    ]


class _Request:
    __slots__ = ("num_prompt_tokens", "own", "shared", "tree")

    def __init__(
        self, num_prompt_tokens: int, tree: _SuffixTree, own: _Sequence, shared: _Sequence | None
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.tree = tree  # the request's own tree, of `own`: its prompt, then its output
        self.own = own
        self.shared = shared  # its output in the global tree; None without one


class SuffixProposer:
    """Suffix decoding drafts per request; NgramProposer's interface. A call costs
    O(new tokens x depth + depth x drafts); a request's first call builds its tree,
    O(prompt x depth) at worst."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._depth = config.suffix_decoding_max_tree_depth
        self._max_cached = config.suffix_decoding_max_cached_requests
        self._global = _SuffixTree(self._depth) if self._max_cached > 0 else None
        self._requests: dict[str, _Request] = {}
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # finished outputs, oldest first

    def max_drafts(self, request_id: str) -> int:
        """num_speculative_tokens: the trees choose each draft's length below it."""
        return self.config.num_speculative_tokens

    def propose(
        self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_drafts: int
    ) -> list[int]:
        """Up to `max_drafts` tokens likely to follow prompt + output; none when nothing
        matches. The output's new tokens go into the trees first, whatever `max_drafts`."""
        request = self._updated(request_id, prompt, output)
        if max_drafts <= 0:
            return []
        best = self._choose(
            request.tree, _growing_places(request.own), max_drafts, _Choice([], 0.0, 0)
        )
        if request.shared is not None:
            assert self._global is not None
            # Match length `depth`, longer than any: the global tree must score higher.
            best = self._choose(
                self._global,
                self._shared_places(request),
                max_drafts,
                _Choice(best.tokens, best.score, self._depth),
            )
        return best.tokens

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Nothing: each draft's length comes from its counts (see the module's docstring)."""

    def forget(self, request_id: str) -> None:
        """The request ended: its tree goes; its output (as far as `propose` saw it) stays
        in the global tree as a cached response, the oldest evicted beyond the limit."""
        request = self._requests.pop(request_id, None)
        if request is None or request.shared is None or not request.shared.tokens:
            return
        assert self._global is not None
        self._cached[request_id] = request.shared.tokens
        while len(self._cached) > self._max_cached:
            self._global.remove(self._cached.popitem(last=False)[1])

    def _updated(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> _Request:
        request = self._requests.get(request_id)
        num_prompt = len(prompt)
        if (
            request is None
            or request.num_prompt_tokens != num_prompt
            or len(request.own.tokens) > num_prompt + len(output)
        ):
            request = self._start(request_id, prompt)
        first = len(request.own.tokens) - num_prompt
        if first < len(output):
            new = output[first:]
            request.tree.extend(request.own, new)
            if request.shared is not None:
                assert self._global is not None
                self._global.extend(request.shared, new)
        return request

    def _start(self, request_id: str, prompt: Sequence[int]) -> _Request:
        """A request's state from its prompt, after taking out of the global tree what the
        same id put there before (its running output, or its cached response)."""
        old = self._requests.pop(request_id, None)
        if old is not None:
            tokens = old.shared.tokens if old.shared is not None else None
        else:
            tokens = self._cached.pop(request_id, None)
        if tokens and self._global is not None:
            self._global.remove(tokens)
        tree, own = _SuffixTree(self._depth), _Sequence()
        tree.extend(own, prompt)
        shared = _Sequence() if self._global is not None else None
        request = self._requests[request_id] = _Request(len(prompt), tree, own, shared)
        return request

    def _shared_places(self, request: _Request) -> list[tuple[int, _Place]]:
        """The ending's suffixes found in the global tree: those within the output from the
        request's own occurrences there, longer ones (reaching into the prompt) by walks."""
        assert request.shared is not None and self._global is not None
        places = _growing_places(request.shared)
        tokens = request.own.tokens
        n = len(tokens)
        for match_len in range(len(request.shared.tokens) + 1, min(self._depth - 1, n) + 1):
            place = self._global.locate(tokens, n - match_len, n)
            if place is None:
                break  # nor any longer one: the tree holds each string's suffixes
            places.append((match_len, place))
        return places

    def _choose(
        self, tree: _SuffixTree, places: list[tuple[int, _Place]], max_drafts: int, best: _Choice
    ) -> _Choice:
        """`best` or a better draft from `places`: a higher score, or an equal one from a
        longer match. Largest budgets first, so most places are skipped unwalked."""
        factor = self.config.suffix_decoding_max_spec_factor
        min_prob = self.config.suffix_decoding_min_token_prob
        ranked = sorted(
            (
                (min(max_drafts, int(factor * m + _EPSILON), self._depth - m), m, place)
                for m, place in places
            ),
            key=lambda item: (-item[0], -item[1]),
        )
        for budget, match_len, place in ranked:
            if budget <= 0 or budget < best.score:
                break  # nor can any after it: a draft scores at most its length
            if budget == best.score and match_len < best.match_len:
                continue
            drafted, score = tree.draft(place, budget, min_prob)
            if score > best.score or (score == best.score and match_len > best.match_len):
                best = _Choice(drafted, score, match_len)
        return best
