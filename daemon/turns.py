"""Taking turns: what is scarce (a pool chunk, a copy thread) goes round-robin between owners, not first come.

An owner is one client, one rank. Eight ranks snapshot at the same step; served first come,
first served, the last rank's copy would wait behind the seven others' whole snapshots
and its fence with them (bench/many_ranks.py measured a rank waiting behind six). In turns,
each owner waiting gets one thing before any owner gets a second, so no snapshot waits
behind more than one other's. All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Generic, TypeVar

T = TypeVar("T")


class Turns(Generic[T]):
    """Owners waiting for a ``T``, each in its own line; ``hand`` gives one to the owner next in turn."""

    def __init__(self, unclaimed: Callable[[T], None]) -> None:
        self._unclaimed = unclaimed
        """Takes back what was handed to a wait cancelled meanwhile, when nobody else waits for it."""
        self._lines: dict[str, collections.deque[asyncio.Future[T]]] = {}
        """Waiters per owner; dict order is the turn order."""

    def __bool__(self) -> bool:
        """Whether anyone waits (those whose wait was cancelled may still be counted until the next ``hand``)."""
        return bool(self._lines)

    def waiting(self) -> int:
        return sum(1 for line in self._lines.values() for f in line if not f.done())

    async def wait(self, owner: str) -> T:
        """Wait in ``owner``'s line for what ``hand`` gives it; one handed to a wait cancelled meanwhile is handed on."""
        fut = asyncio.get_running_loop().create_future()
        self._lines.setdefault(owner, collections.deque()).append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and not self.hand(fut.result()):
                self._unclaimed(fut.result())
            raise

    def hand(self, item: T) -> bool:
        """Give ``item`` to the first waiter of the owner next in turn (that owner goes to the back of the line);
        False if nobody waits."""
        while self._lines:
            owner = next(iter(self._lines))
            line = self._lines.pop(owner)
            while line and line[0].done():  # cancelled
                line.popleft()
            if not line:
                continue
            fut = line.popleft()
            if line:
                self._lines[owner] = line
            fut.set_result(item)
            return True
        return False


class Slots:
    """``count`` slots (the copy threads), taken in turns between owners."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._turns: Turns[None] = Turns(self._give_back)

    def _give_back(self, _: None) -> None:
        self._free += 1

    @asynccontextmanager
    async def turn(self, owner: str) -> AsyncIterator[None]:
        if self._free and not self._turns:
            self._free -= 1
        else:
            await self._turns.wait(owner)
        try:
            yield
        finally:
            if not self._turns.hand(None):
                self._give_back(None)
