"""``datastatesctl``: inspect and steer the node's daemon from a shell or a job script."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from datastates.protocol import messages as m
from datastates.protocol.descriptors import Tier
from datastates.protocol.endpoint import resolve_endpoint
from datastates.protocol.errors import DaemonNotRunning, DatastatesError
from datastates.protocol.storage import backend_for
from datastates.protocol.format import check_tag
from datastates.protocol.retention import prune

from ..connection import Connection, daemon_status
from ..locate import tier_roots
from ..reader.stream import verify
from .catalog import list_tags
from .sizes import human_size

POLL_S = 0.2
DEFAULT_CONNECT_TIMEOUT = 5.0
MAX_INTERVAL_S = 86400.0
"""The longest ``--interval`` of ``status --watch``: a day between refreshes."""


def _interval(text: str) -> float:
    """``--interval``: seconds, positive and finite; -1 or nan would reach ``time.sleep`` as a traceback."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_INTERVAL_S):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0 and at most {MAX_INTERVAL_S:g}")
    return value


def _count(text: str) -> int:
    """``--count``: how many refreshes, at least one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} refreshes: give at least 1")
    return value


def render(status: dict[str, Any]) -> str:
    d = status["daemon"]
    mem = d["host_memory"]
    lines = [
        f"datastatesd pid {d['pid']} on {d['endpoint']}  up {d['uptime_s']} s"
        + ("  (draining)" if d["draining"] else ""),
        f"host memory: {human_size(mem['budget_bytes'])} in chunks of {human_size(mem['chunk_size'])}:"
        f" {mem['chunks_copying']} copying, {mem['chunks_flushing']} waiting to be flushed, {mem['chunks_free']} free"
        f" (peak {human_size(mem['peak_in_use_bytes'])} in use, {mem['waiting_copies']} copies waiting)",
        f"pending snapshots: {status['pending']}   pending commits: {status['commits_pending']}",
        _replica_line(status["replicas"]),
        "",
        f"clients ({len(status['clients'])}):",
    ]
    lines += [f"  {c['id']:<14} {c['name']:<20} pid {c['pid']:<8} rank {c['rank']}/{c['world_size']} node {c['node_rank']}"
              f"  {c['host']}  regions {c['regions']}" for c in status["clients"]]
    lines += [f"  lost: {c['id']} {c['name']} pid {c['pid']} ({c['how']}, {c['pending_snapshots']} snapshot(s) were pending"
              + (f", {c['abandoned_snapshots']} snapshot(s) failed uncopied" if c["abandoned_snapshots"] else "")
              + ")" for c in status["clients_lost"]]
    lines += [f"  gathering: tag {g['tag']} ranks {g['committed_ranks']} of {g['local_ranks']} local, {g['nodes']} node(s)"
              for g in status["tags_gathering"]]
    lines += ["", "snapshots:", f"  {'id':>5} {'state':<9} {'copied':>9} {'flushed':>9} {'total':>10} {'rate':>11}  tag / path"]
    for s in status["snapshots"]:
        total = s["total_bytes"] or 1
        lines.append(
            f"  {s['id']:>5} {s['state']:<9} {100 * s['copied_bytes'] / total:>8.0f}% {100 * s['flushed_bytes'] / total:>8.0f}%"
            f" {human_size(s['total_bytes']):>10} {human_size(s['throughput_bps']) + '/s':>11}  {s['tag']}  {s['path']}"
            + (f"\n        error: {s['error']}" if s["error"] else "")
        )
    tiers = status["tier_transfers"]
    if tiers["tiers"]:
        lines += ["", "tiers: " + ", ".join(f"{t['name']} {t['path']}" + ("" if t["shared"] else " (node-local)")
                                            for t in tiers["tiers"]), f"  {'tag':<24} " + "  ".join(
            f"{t['name']:<22}" for t in tiers["tiers"])]
        lines[-2:-2] = [f"  tier {name} cannot be written: {why}" for name, why in tiers.get("problems", {}).items()] + \
            ([] if tiers.get("checked", True) else ["  object store tiers: start-up check under way"]) + \
            ([f"  the upload process ended and was started again ({tiers['uploader']['started']} in all): see the "
              "daemon's log"] if tiers.get("uploader", {}).get("started", 0) > 1 else [])
        for e in tiers["tags"]:
            cells = {c["tier"]: c for c in e["tiers"]}
            lines.append(f"  {e['tag']:<24} " + "  ".join(f"{_tier_cell(cells.get(t['name'])):<22}" for t in tiers["tiers"]))
    lines += ["", "committed tags:"]
    lines += [f"  {c['tag']:<24} {c['files']} file(s)  {c['marker']}" for c in status["committed"]]
    return "\n".join(lines)


def _replica_line(replicas: dict[str, Any]) -> str:
    """The replica budget's use: when it is full, new files' restores read storage."""
    if replicas["policy"] == "none":
        return "replicas: off (memory_restore: none)"
    return (f"replicas: {len(replicas['replicas'])} held, {human_size(replicas['used_bytes'])} of"
            f" {human_size(replicas['budget_bytes'])} memory_restore_budget used"
            f" ({human_size(replicas['spare_bytes'])} spares)"
            + (f", {replicas['released']} released for newer files" if replicas.get("released") else ""))


def _tier_cell(transfer: dict[str, Any] | None) -> str:
    """One tag on one tier: its state, with progress while it is transferred."""
    if transfer is None:
        return "-"
    if transfer["state"] == "transferring":
        return f"transferring {100 * transfer['bytes_done'] / max(1, transfer['bytes_total']):.0f}%"
    return transfer["state"]


def _tag_files(target: str, root: str) -> list[str]:
    """The files to verify: ``target`` itself, or every file the commit markers of a tag list.

    ``target`` is a checkpoint file, a folder holding a tag's marker, or a tag name found
    under ``root``. A listed file that is missing is still returned, so it is reported. A
    marker this user may not trust (``distrust``: another user's, a FIFO) is skipped, saying why.
    """
    store = backend_for(target)
    if not store.is_folder(target) and not store.exists(target):  # a tag's name, looked for under ``root``
        return backend_for(root).tag_files_named(root, check_tag(target), _skipped)
    return store.files_at(target, _skipped)


def _skipped(path: str, why: str) -> None:
    print(f"skipped  {path}: not a commit marker of this user's: {why}", file=sys.stderr)


def _verify(target: str, root: str) -> int:
    failures = 0
    for path in _tag_files(target, root):
        try:
            entries, nbytes = verify(path)
            print(f"ok       {path}: {entries} entries, {human_size(nbytes)} checked")
        except (DatastatesError, OSError) as exc:
            failures += 1
            print(f"CORRUPT  {path}: {getattr(exc, 'message', exc)}")
    return 1 if failures else 0


def _ls(root: str, endpoint: str | None, timeout: float) -> int:
    """Tags of ``root``, on every storage tier it spans; the daemon, when one answers, names the tiers and its replicas."""
    root = backend_for(root).absolute(root)
    try:
        status = daemon_status(endpoint, timeout)
        replicas = [r for r in status["replicas"]["replicas"] if r["committed"]]
        tiers = [Tier(**t) for t in status["tier_transfers"]["tiers"]]
    except DatastatesError:
        replicas, tiers = [], []
    places = [(t, p) for t, p in tier_roots(root, tiers) if backend_for(p).is_folder(p)]
    if not places:
        raise FileNotFoundError(f"no folder {root}")
    entries = []
    for tier, place in places:
        in_memory = {r["tag"] for r in replicas if os.path.dirname(os.path.dirname(r["path"])) == place}
        entries += [(e, tier.name if tier else "-") for e in list_tags(place, in_memory)]
    entries.sort(key=lambda row: row[0].order_ns, reverse=True)
    print(f"{'tag':<28} {'state':<12} {'size':>11} {'files':>5}  {'tier':<10} {'where':<16} age")
    for e, tier in entries:
        where = "storage+memory" if e.in_memory else "storage"
        print(f"{e.tag:<28} {e.state:<12} {human_size(e.size):>11} {e.files:>5}  {tier:<10} {where:<16} {_age(e.age_s)}")
    if not entries:
        print(f"(no tags under {root})")
    return 0


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def _prune(root: str, keep_last: int, dry_run: bool) -> int:
    gone = prune(backend_for(root).absolute(root), keep_last, dry_run=dry_run)
    for folder in gone:
        print(f"{'would delete' if dry_run else 'deleted'} {folder}")
    print(f"{len(gone)} tag(s) {'to prune' if dry_run else 'pruned'}; the {keep_last} newest committed kept")
    return 0


def _convert(folder: str, to: str, out: str, weights_only: bool) -> int:
    if to == "dcp":  # a checkpoint DCP saved through datastates, as DCP's own FileSystemWriter lays one out
        from datastates.integrations.dcp import to_filesystem

        print(f"wrote {to_filesystem(folder, out)}")
        return 0
    from .convert import convert_tag  # torch: only the commands that read checkpoints pay for it

    for path in convert_tag(folder, to, out, weights_only):
        print(f"wrote {path}")
    return 0


def _status(conn: Connection, timeout: float) -> dict[str, Any]:
    return conn.call(m.Status(), timeout).status


def _first_status(conn: Connection, timeout: float | None) -> dict[str, Any]:
    """The first status: with ``--connect-timeout S`` given, a daemon not listening yet (still starting, as a job
    script launched it a moment ago) is waited for up to S s; without it, that is an error at once."""
    deadline = time.monotonic() + (timeout or 0)
    while True:
        try:
            return _status(conn, DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout)
        except DaemonNotRunning:
            if timeout is None or time.monotonic() >= deadline:
                raise
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="datastatesctl", description="Inspect and control the node's datastatesd.")
    parser.add_argument("--endpoint", help="daemon endpoint (default: $DATASTATES_ENDPOINT, else the default node config's)")
    parser.add_argument("--connect-timeout", type=float, default=None, metavar="S",
                        help=f"how long to wait for the daemon to answer (default {DEFAULT_CONNECT_TIMEOUT:g}); given, "
                             "also how long to wait for one that is still starting")
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="clients, pending snapshots and tier transfers with progress, committed tags")
    p_status.add_argument("--json", action="store_true", help="machine-readable output")
    p_status.add_argument("--watch", action="store_true",
                          help="a live view: a bar per snapshot (copied, flushed) and per tier transfer, with rates "
                               "and time left, refreshed until Ctrl-C")
    p_status.add_argument("--interval", type=_interval, default=1.0, metavar="S",
                          help=f"--watch: seconds between refreshes (above 0, at most {MAX_INTERVAL_S:g})")
    p_status.add_argument("--count", type=_count, default=None, metavar="N", help="--watch: stop after N refreshes (>= 1)")
    p_wait = sub.add_parser("wait", help="wait until no snapshot, commit or tier transfer is pending")
    p_wait.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds (exit 1)")
    sub.add_parser("shutdown", help="drain every pending snapshot, then stop the daemon")
    p_verify = sub.add_parser("verify", help="check a checkpoint file, or every file of a committed tag (no daemon needed)")
    p_verify.add_argument("target", help="a checkpoint file, a tag's folder, or a tag name under --root")
    p_verify.add_argument("--root", default=".", help="where a tag given by name is looked for (default: .)")
    p_ls = sub.add_parser("ls", help="the tags under a root: state, size, storage tier, where (storage, daemon memory), age")
    p_ls.add_argument("root")
    p_prune = sub.add_parser("prune", help="delete the committed tags under a root older than the --keep-last newest")
    p_prune.add_argument("root")
    p_prune.add_argument("--keep-last", type=int, required=True, metavar="N", help="committed tags to keep (>= 1)")
    p_prune.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    p_convert = sub.add_parser("convert", help="write a committed tag as plain torch.save or safetensors files, or a "
                                               "checkpoint DCP saved through datastates in DCP's own layout")
    p_convert.add_argument("tag", help="the tag's folder")
    p_convert.add_argument("--to", required=True, help="torch, safetensors, or dcp (DCP's FileSystemWriter layout, for "
                                                       "stock dcp.load; an unknown format is refused)")
    p_convert.add_argument("--out", required=True, help="the folder to write into")
    p_convert.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                           help="unpickle any object (runs code the file's author chose): only for files you trust")
    args = parser.parse_args(argv)

    offline = {
        "verify": lambda: _verify(args.target, args.root),
        "ls": lambda: _ls(args.root, args.endpoint, args.connect_timeout or DEFAULT_CONNECT_TIMEOUT),
        "prune": lambda: _prune(args.root, args.keep_last, args.dry_run),
        "convert": lambda: _convert(args.tag, args.to, args.out, args.weights_only),
    }
    if args.command in offline:
        try:
            return offline[args.command]()
        except DatastatesError as exc:
            print(f"datastatesctl: error: {exc.message}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as exc:
            print(f"datastatesctl: error: {exc}", file=sys.stderr)
            return 2

    try:
        conn = Connection(resolve_endpoint(args.endpoint))
    except DatastatesError as exc:  # a tcp endpoint without its CURVE variables
        print(f"datastatesctl: error: {exc.message}", file=sys.stderr)
        return 2
    reply_s = args.connect_timeout or DEFAULT_CONNECT_TIMEOUT
    try:
        first = _first_status(conn, args.connect_timeout)
        if args.command == "status" and args.watch:
            from .watch import watch  # rich: only the live view pays for it

            watch(lambda: _status(conn, reply_s), args.interval, args.count)
        elif args.command == "status":
            print(json.dumps(first, indent=1) if args.json else render(first))
        elif args.command == "wait":
            deadline = None if args.timeout is None else time.monotonic() + args.timeout
            while True:
                status = _status(conn, reply_s)
                transfers = status["tier_transfers"]["pending"]
                if not status["pending"] and not status["commits_pending"] and not transfers:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    print(f"datastatesctl: still pending after {args.timeout} s: {status['pending']} snapshot(s), "
                          f"{status['commits_pending']} commit(s), {transfers} tier transfer(s)", file=sys.stderr)
                    return 1
                time.sleep(POLL_S)
            failed = [s for s in status["snapshots"] if s["state"] == "failed"]  # the job's, as the daemon lives with it
            for s in failed:
                print(f"datastatesctl: snapshot {s['id']} of {s['path']} failed: {s['error']}", file=sys.stderr)
            return 1 if failed else 0
        elif args.command == "shutdown":  # the first status failed fast if there is no daemon; the drain may take long
            conn.call(m.Shutdown(), None)
            print("datastatesd drained and stopped")
    except DatastatesError as exc:
        print(f"datastatesctl: error: {exc.message}", file=sys.stderr)
        return 2
    finally:
        conn.close()
    return 0

