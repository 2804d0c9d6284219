"""Stop strings: cut the streamed text at the first occurrence of any of them.

Text arrives in chunks and a stop string may span several, so the checker holds back the
longest tail that is still the beginning of some stop string (never more than
`max(len(stop)) - 1` characters) and releases it once it can no longer start a match.
"""

from __future__ import annotations


class StopChecker:
    """Feeds text through, withholding what might begin a stop string.

    Invariants: the text returned by `feed` and `flush` concatenates to the fed text, cut
    just before the earliest occurrence of any stop string (the stop string itself is not
    emitted). Once stopped, `feed` returns ("", True) and `flush` returns "".
    """

    def __init__(self, stop: list[str]):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = list(dict.fromkeys(stop))
        self._max_held_chars = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self.matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string has matched)."""
        if self.stopped:
            return "", True
        if not self._stop:
            return new_text, False
        text = self._held + new_text
        match = self._earliest_match(text)
        if match is not None:
            start, self.matched_stop = match
            self._held = ""
            return text[:start], True
        num_held_chars = self._num_chars_to_hold(text)
        self._held = text[len(text) - num_held_chars :]
        return text[: len(text) - num_held_chars], False

    def flush(self) -> str:
        """Release held text when the request ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the leftmost match; the longest stop string wins a tie."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
                best = (start, stop)
        return best

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for num_chars in range(min(len(text), self._max_held_chars), 0, -1):
            tail = text[len(text) - num_chars :]
            if any(stop.startswith(tail) for stop in self._stop):
                return num_chars
        return 0
