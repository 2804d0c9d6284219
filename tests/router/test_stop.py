import random

import pytest

from router.stop import StopChecker


def feed_all(checker: StopChecker, chunks: list[str]) -> tuple[str, bool]:
    emitted = []
    stopped = False
    for chunk in chunks:
        text, stopped = checker.feed(chunk)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(checker.flush())
    return "".join(emitted), stopped


def reference(text: str, stop: list[str]) -> tuple[str, bool]:
    starts = [text.find(s) for s in stop if s in text]
    return (text[: min(starts)], True) if starts else (text, False)


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([])
    assert checker.feed("hello") == ("hello", False)
    assert checker.flush() == ""


def test_match_inside_one_chunk_cuts_before_stop():
    checker = StopChecker(["END"])
    assert checker.feed("abc END def") == ("abc ", True)
    assert checker.matched_stop == "END"
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""


def test_stop_spanning_chunks_is_held_then_cut():
    checker = StopChecker(["</s>"])
    assert checker.feed("hi <") == ("hi ", False)
    assert checker.feed("/") == ("", False)
    assert checker.feed("s>tail") == ("", True)


def test_held_prefix_released_when_it_stops_matching():
    checker = StopChecker(["</s>"])
    assert checker.feed("a </") == ("a ", False)
    assert checker.feed("b") == ("</b", False)


def test_flush_releases_held_text():
    checker = StopChecker(["STOP"])
    assert checker.feed("x ST") == ("x ", False)
    assert checker.flush() == "ST"
    assert not checker.stopped


def test_only_holds_tail_that_could_start_a_stop():
    checker = StopChecker(["abcdef"])
    assert checker.feed("zzzzzz") == ("zzzzzz", False)
    assert checker.feed("zzab") == ("zz", False)


def test_overlapping_prefix_restarts_match():
    # "aab" must match although the first "a" begins a failed attempt.
    checker = StopChecker(["aab"])
    assert feed_all(checker, ["a", "a", "a", "b", "c"]) == ("a", True)


def test_earliest_of_several_stops_wins():
    checker = StopChecker(["world", "lo w"])
    assert checker.feed("hello world") == ("hel", True)
    assert checker.matched_stop == "lo w"


def test_stop_found_in_held_text_plus_new_chunk():
    checker = StopChecker(["xyz", "y"])
    assert checker.feed("ax") == ("a", False)
    assert checker.feed("yq") == ("x", True)
    assert checker.matched_stop == "y"


def test_multichar_unicode_stop():
    checker = StopChecker(["你好"])
    assert feed_all(checker, ["说", "你", "好吗"]) == ("说", True)


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


@pytest.mark.parametrize("seed", range(200))
def test_random_chunking_matches_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert feed_all(StopChecker(stop), chunks) == reference(text, stop)
