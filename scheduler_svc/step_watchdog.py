"""When a step in flight is suspect: a bound taken from the distribution of recent steps.

A worker that is frozen (SIGSTOP, a wedged host) or cut off from the scheduler never answers
its step; neither do its peers, waiting for it in a collective. The step's own timeout
(--step-timeout-s, 300 s) is far too long to wait for that, and any fixed short one would
fail a long but healthy step (a big prefill). So the engine loop watches each step: once it
has run `suspect_after_s()` — `factor` times the 99th percentile of recent step times,
clamped to [min_s, max_s] — it asks every worker of the group, and keeps asking every
`probe_interval_s`, whether it answers at all (a health probe of `probe_timeout_s`). A
member that does not answer fails the step at once; a step whose members all answer is slow,
not hung, and goes on. A hang is thus declared within max_s + probe_timeout_s (8 s by
default) and never by the clock alone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WatchdogConfig:
    factor: float = 10.0  # a step is suspect after this many times the recent p99
    min_s: float = 1.0  # ... but not before this
    max_s: float = 6.0  # ... and at the latest after this
    probe_timeout_s: float = 2.0  # how long a member has to answer a probe
    probe_interval_s: float = 1.0  # between probes of a suspect step whose members answered
    window: int = 256  # recent steps the percentile is taken over

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError("watchdog bounds must satisfy 0 < min_s <= max_s")
        if self.factor < 1 or self.probe_timeout_s <= 0 or self.probe_interval_s <= 0:
            raise ValueError("watchdog factor must be >= 1 and probe times > 0")
        if self.window < 1:
            raise ValueError("watchdog window must be >= 1 step")

    @property
    def bound_s(self) -> float:
        """The longest a hung member goes unnoticed while a step waits on it."""
        return self.max_s + self.probe_timeout_s


class StepWatchdog:
    """Recent step times, and the age at which a step in flight becomes suspect."""

    def __init__(self, config: WatchdogConfig | None = None) -> None:
        self.config = config or WatchdogConfig()
        self._times_s: deque[float] = deque(maxlen=self.config.window)
        self.num_probes = 0  # probes of suspect steps since start
        self.num_slow_steps = 0  # suspect steps whose members all answered (went on)

    def observe(self, step_time_s: float) -> None:
        """A step that returned, with its time from dispatch to result (seconds)."""
        self._times_s.append(step_time_s)

    def p99_s(self) -> float | None:
        """The 99th percentile of recent step times; None before the first step."""
        if not self._times_s:
            return None
        ordered = sorted(self._times_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def suspect_after_s(self) -> float:
        """How long a step may run before its members are probed."""
        config = self.config
        p99 = self.p99_s()
        if p99 is None:  # no history: the first steps include warm-up, be patient
            return config.max_s
        return min(config.max_s, max(config.min_s, config.factor * p99))
