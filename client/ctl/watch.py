"""``datastatesctl status --watch``: a live view of the daemon, refreshed until Ctrl-C or ``count`` views.

Each snapshot shows a bar for its bytes copied into the daemon and one for its bytes
flushed to the file, with the daemon's recent rates and the time left at that rate; each
tier transfer in flight shows a bar, with a rate measured here between two refreshes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .sizes import human_size

FINISHED_SHOWN = 8
"""Durable or failed snapshots kept in view, newest first, under the pending ones."""


def _eta(left: int, bps: float) -> str:
    if left <= 0:
        return "done"
    if bps <= 0:
        return "-"
    seconds = left / bps
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _bar(done: int, total: int) -> Group:
    return Group(ProgressBar(total=max(total, 1), completed=min(done, total), width=24),
                 Text(f"{100 * done / max(total, 1):.0f}%  {human_size(done)}", style="dim"))


class _TierRates:
    """Bytes per second of each tier transfer, from the progress seen at the previous refresh."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def rate(self, key: tuple[str, str], done: int) -> float:
        now = time.monotonic()
        before = self._seen.get(key)
        self._seen[key] = (now, done)
        return (done - before[1]) / (now - before[0]) if before and now > before[0] else 0.0


def view(status: dict[str, Any], tier_rates: _TierRates) -> Group:
    """One frame of the live view."""
    d = status["daemon"]
    mem = d["host_memory"]
    head = Text(f"datastatesd pid {d['pid']} on {d['endpoint']}  up {d['uptime_s']} s"
                + ("  (draining)" if d["draining"] else ""), style="bold")
    pool = Table.grid(padding=(0, 1))
    pool.add_row("host memory", ProgressBar(total=mem["budget_bytes"] // mem["chunk_size"] or 1,
                                            completed=mem["chunks_copying"] + mem["chunks_flushing"], width=24),
                 f"{mem['chunks_copying']} copying, {mem['chunks_flushing']} waiting to be flushed, "
                 f"{mem['chunks_free']} free, of {human_size(mem['budget_bytes'])} ({mem['waiting_copies']} copies waiting)")

    snaps = Table(title="snapshots", title_justify="left", expand=False)
    for col in ("id", "tag", "state", "copied", "flushed", "copy rate", "flush rate", "ETA", "total"):
        snaps.add_column(col)
    pending = [s for s in status["snapshots"] if s["state"] in ("copying", "flushing")]
    finished = [s for s in status["snapshots"] if s not in pending][-FINISHED_SHOWN:]
    for s in pending + finished[::-1]:
        left = s["total_bytes"] - s["flushed_bytes"]
        snaps.add_row(str(s["id"]), s["tag"], s["state"] if not s["error"] else Text(s["state"], style="red"),
                      _bar(s["copied_bytes"], s["total_bytes"]), _bar(s["flushed_bytes"], s["total_bytes"]),
                      f"{human_size(s['copy_bps'])}/s", f"{human_size(s['flush_bps'])}/s",
                      _eta(left, s["flush_bps"]) if s["state"] in ("copying", "flushing") else "-",
                      human_size(s["total_bytes"]))
    parts: list[Any] = [head, pool, snaps]

    moving = [(e["tag"], t) for e in status["tier_transfers"]["tags"] for t in e["tiers"] if t["state"] == "transferring"]
    if moving:
        tiers = Table(title="tier transfers", title_justify="left")
        for col in ("tag", "tier", "copied", "rate", "ETA"):
            tiers.add_column(col)
        for tag, t in moving:
            bps = tier_rates.rate((tag, t["tier"]), t["bytes_done"])
            tiers.add_row(tag, t["tier"], _bar(t["bytes_done"], t["bytes_total"]), f"{human_size(bps)}/s",
                          _eta(t["bytes_total"] - t["bytes_done"], bps))
        parts.append(tiers)
    parts.append(Text(f"{status['pending']} snapshot(s), {status['commits_pending']} commit(s), "
                      f"{status['tier_transfers']['pending']} tier transfer(s) pending; {len(status['committed'])} "
                      "tag(s) committed", style="dim"))
    return Group(*parts)


def watch(fetch: Callable[[], dict[str, Any]], interval: float, count: int | None) -> None:
    """Show ``fetch()`` every ``interval`` seconds, ``count`` times (None: until Ctrl-C)."""
    rates = _TierRates()
    shown = 0
    with Live(view(fetch(), rates), console=Console(), auto_refresh=False) as live:
        shown += 1
        try:
            while count is None or shown < count:
                time.sleep(interval)
                live.update(view(fetch(), rates), refresh=True)
                shown += 1
        except KeyboardInterrupt:
            pass
