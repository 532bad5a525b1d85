"""The registry of connected clients and of the shared regions the daemon opened for each.

A region is opened once per client and handle. The cache keeps the regions that the
latest snapshot of each file name used (model_states.pt, optim_states.pt, ...), which are
the ones the next checkpoint will name again; a region no snapshot uses any longer is
dropped, and unmapped once no job still copies from it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from datastates.protocol import messages as m
from datastates.protocol.descriptors import SourceDesc
from datastates.protocol.errors import InvalidRequestError, UnknownClientError

from .sources import Region, open_region

_Key = tuple[str, str]


@dataclass
class ClientRecord:
    id: str
    identity: bytes
    pid: int
    name: str
    host: str
    connected: float = field(default_factory=time.monotonic)
    _regions: dict[_Key, Region] = field(default_factory=dict)
    _by_name: dict[str, set[_Key]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def regions_for(self, path: str, sources: list[SourceDesc]) -> list[Region]:
        """The mapped region of each source, opening only those not mapped yet."""
        with self._lock:
            out = []
            for desc in sources:
                key = (desc.kind, desc.handle)
                region = self._regions.get(key)
                if region is None:
                    region = open_region(desc)
                    if desc.handle:
                        self._regions[key] = region
                elif region.nbytes != desc.nbytes:
                    raise InvalidRequestError(
                        f"source {desc.handle!r} was {region.nbytes} bytes and is now declared {desc.nbytes}"
                    )
                out.append(region)
            self._by_name[os.path.basename(path)] = {(d.kind, d.handle) for d in sources if d.handle}
            live = set().union(*self._by_name.values())
            for key in [k for k in self._regions if k not in live]:
                del self._regions[key]
            return out

    def release(self) -> None:
        with self._lock:
            self._regions.clear()
            self._by_name.clear()

    def status(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "pid": self.pid,
            "host": self.host,
            "connected_s": round(time.monotonic() - self.connected, 1),
            "regions": len(self._regions),
        }


class ClientRegistry:
    def __init__(self) -> None:
        self._by_identity: dict[bytes, ClientRecord] = {}
        self._ids = itertools.count(1)

    def add(self, identity: bytes, hello: m.Hello) -> ClientRecord:
        old = self._by_identity.pop(identity, None)
        if old is not None:
            old.release()
        record = ClientRecord(
            id=f"c{next(self._ids)}-{hello.pid}", identity=identity, pid=hello.pid, name=hello.name[:128], host=hello.host[:128]
        )
        self._by_identity[identity] = record
        return record

    def get(self, identity: bytes) -> ClientRecord:
        record = self._by_identity.get(identity)
        if record is None:
            raise UnknownClientError("unknown client: send HELLO first (or the daemon restarted: reconnect)")
        return record

    def remove(self, identity: bytes) -> ClientRecord | None:
        record = self._by_identity.pop(identity, None)
        if record is not None:
            record.release()
        return record

    def status(self) -> list[dict[str, Any]]:
        return [c.status() for c in self._by_identity.values()]
