"""A byte counter's rate over a recent window, for ``status``: what moves now, not an average since the start."""

from __future__ import annotations

import collections

RATE_WINDOW_S = 2.0
"""How far back a rate looks: long enough to smooth one piece's copy, short enough to show a stall."""
SAMPLE_EVERY_S = 0.1
"""Samples closer together than this are not kept: a status poll in a tight loop keeps the deque short."""


class RecentRate:
    """Bytes per second of a growing counter over about the last RATE_WINDOW_S seconds, sampled when asked.

    The base is the newest sample at least RATE_WINDOW_S old (the start, until there is one):
    since every earlier reading was sampled or came after a sample, the rate is above 0
    whenever the counter grew since any earlier reading, and 0 only after a window without progress.
    """

    def __init__(self, start: float) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(start, 0)])

    def rate(self, now: float, value: int) -> int:
        if now - self._samples[-1][0] >= SAMPLE_EVERY_S:
            self._samples.append((now, value))
        while len(self._samples) > 1 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, v0 = self._samples[0]
        return int((value - v0) / (now - t0)) if now > t0 else 0


def average(nbytes: int, seconds: float) -> int:
    """Bytes per second over a finished phase."""
    return int(nbytes / seconds) if seconds > 0 else 0
