"""What ``datastatesctl status`` shows of a daemon: its every part's state, gathered in one dict."""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Protocol

from datastates.protocol.version import PROTOCOL_VERSION

from . import fsops
from .admissions import Admissions
from .clients import ClientRegistry
from .commit import CommitLedger
from .config import NodeConfig
from .connections import Connections, open_descriptors
from .gpus import gpus
from .memory import HostPool
from .replica.table import ReplicaStore
from .tiers import TierTransfers


class Parts(Protocol):
    """What the status shows of a daemon (``server.Daemon``, which imports this module)."""

    cfg: NodeConfig
    started: float
    draining: bool
    leftovers: list[str] | None
    pool: HostPool
    clients: ClientRegistry
    connections: Connections
    snapshots: Admissions
    ledger: CommitLedger
    transfers: TierTransfers
    replicas: ReplicaStore


def node_status(daemon: Parts) -> dict[str, Any]:
    """The STATUS reply's body: the daemon, its clients and connections, snapshots, commits, transfers, replicas."""
    commits = daemon.ledger.commit_states()
    snapshots = [{**s, "commit": commits.get(s["id"], "")} for s in daemon.snapshots.status()]
    cfg = daemon.cfg
    return {
        "daemon": {
            "pid": os.getpid(),
            "endpoint": cfg.endpoint,
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(time.monotonic() - daemon.started, 1),
            "draining": daemon.draining,
            "roots": cfg.storage.roots,
            "host_memory": daemon.pool.status(),
            "copy_threads": cfg.copy_threads,
            "gpus": gpus.status(),
            "flush_threads": cfg.flush_threads,
            "descriptors": descriptors(),
            "metadata_ops": fsops.counts(),
            "leftovers_removed": None if daemon.leftovers is None else {
                "count": len(daemon.leftovers), "paths": daemon.leftovers[:20]},
        },
        "clients": daemon.clients.status(),
        "connections": daemon.connections.status(),
        "clients_lost": list(daemon.clients.lost),
        "snapshots": snapshots,
        "pending": len(daemon.snapshots.pending()),
        "commits_pending": daemon.ledger.pending,
        "tags_gathering": daemon.ledger.groups(),
        "tier_transfers": daemon.transfers.status(),
        "replicas": daemon.replicas.status(),
        "committed": list(daemon.ledger.committed),
    }


def descriptors() -> dict[str, int]:
    """Open file descriptors and the limits on them: ZeroMQ aborts the daemon when an accept meets the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"open": open_descriptors(), "soft_limit": soft, "hard_limit": hard}
