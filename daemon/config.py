"""node.yaml: the daemon's every knob, checked once at start.

With no file, the defaults below serve a single-node job out of the box. An unknown key
or a bad value stops the daemon with a ConfigError that names it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from datastates.protocol import security
from datastates.protocol.endpoint import resolve_endpoint
from datastates.protocol.descriptors import Tier
from datastates.protocol.storage import backend_for
from datastates.protocol.errors import ConfigError, InvalidRequestError
from datastates.protocol.fileio import PAGE

from datastates.protocol.paths import default_root, home_tier, within, writable_by_others

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TIER_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
UPLOAD_PRIORITIES = ("low", "idle")
"""``storage.upload_priority``: the upload process at nice 19, or under SCHED_IDLE."""
_TCP_RE = re.compile(r"^tcp://(\*|[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")

HISTORY = 64
"""Commits, skipped tags and tier transfers remembered for ``status`` and for commits that follow."""
SNAPSHOT_HISTORY = 256
"""Finished snapshots kept for ``status`` and for a WAIT that names them."""
LOST_HISTORY = 256
"""Clients taken as gone, listed in ``status``."""


def parse_size(value: Any, key: str) -> int:
    """Bytes from an int or a string such as '2GiB' or '512MB'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE_RE.match(str(value)) if isinstance(value, str) else None
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}: {value!r} is not a size (use bytes, or e.g. 512MiB, 2GiB)", key=key)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def default_copy_threads() -> int:
    """memcpy nearly doubles from 1 to 2 threads; past that the disk, not the copy, limits."""
    return max(2, min(8, _cores() // 8))


def default_flush_threads() -> int:
    """O_DIRECT writes peak at about 2 threads on one local disk; parallel file systems want more."""
    return max(2, min(16, _cores() // 4))


def _default_roots() -> list[str]:
    """This user's own folder in the temp dir (made 0700), and the working folder unless others may write in it."""
    cwd = os.path.realpath(os.getcwd())
    return [os.path.realpath(default_root()), *([cwd] if not writable_by_others(cwd) else [])]


@dataclass(frozen=True)
class StorageConfig:
    roots: list[str] = field(default_factory=_default_roots)
    """Folders a client may write under; anything else is refused. The tiers' paths are always allowed."""
    keep_last: int | None = None
    """After each commit, keep only this many newest committed tags beside it (None: keep all)."""
    tiers: list[Tier] = field(default_factory=list)
    """Fastest first; empty: no tiers, every root is its own single level."""
    upload_priority: str = "low"
    """The CPU priority of the upload process (object store tiers): ``low``, nice 19, a small share of a busy core, so
    uploads go on behind a trainer that keeps every core busy; ``idle``, SCHED_IDLE, only CPU nothing else wants, so
    such a trainer loses nothing to them, and they wait for its pauses (the newest tag still supersedes the older)."""

    @property
    def written(self) -> list[str]:
        """Everywhere this daemon writes: the roots, and the object store tiers."""
        return self.roots + [t.path for t in self.tiers if t.path not in self.roots]

    def tier_of(self, path: str) -> int | None:
        """The index of the tier ``path`` (resolved) lies in, if any."""
        return home_tier(self.tiers, path)

    def shared(self, path: str) -> bool:
        """Whether every node sees ``path``: a tier not marked otherwise, or a plain root."""
        tier = self.tier_of(path)
        return tier is None or self.tiers[tier].shared

    def keep_last_at(self, path: str) -> int | None:
        tier = self.tier_of(path)
        if tier is not None and self.tiers[tier].keep_last is not None:
            return self.tiers[tier].keep_last
        return self.keep_last


@dataclass(frozen=True)
class CurveConfig:
    server_secret_key: str | None = None
    """The daemon's secret certificate (the .key_secret file of zmq.auth.create_certificates)."""
    authorized_clients: str | None = None
    """A folder of client public certificates (*.key): the only clients a tcp endpoint admits."""


@dataclass(frozen=True)
class NodeConfig:
    endpoint: str = field(default_factory=resolve_endpoint)
    """Default: $DATASTATES_ENDPOINT, else an ipc:// socket in a per-user runtime folder."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    host_memory: int = 2 << 30
    """The most host memory the daemon ever holds for copies; copies wait for flushes beyond it."""
    chunk_size: int = 64 << 20
    """The unit of copying and writing; the host pool is host_memory / chunk_size of them."""
    copy_threads: int = field(default_factory=default_copy_threads)
    flush_threads: int = field(default_factory=default_flush_threads)
    direct_io: bool = True
    """Write data with O_DIRECT where the file system allows it (falls back by itself)."""
    prefault: bool = True
    """Map and touch the whole pool at start, in the background, instead of on first use."""
    pin_host_memory: bool = True
    """Where CUDA is present, page-lock each pool chunk once (cudaHostRegister), so GPU copies run async."""
    memory_restore: str = "latest"
    """``latest``: keep each rank's newest committed snapshot in /dev/shm for restores; ``none``: off."""
    memory_restore_budget: int = 2 << 30
    """The most /dev/shm the replicas take; a snapshot over it is not kept (restores read storage)."""
    commit_timeout: float = 600.0
    """In a multi-rank job, how long a commit waits for the node's other ranks, and across nodes for the others' done markers."""
    client_timeout: float = 30.0
    """A client silent this long (clients heartbeat every sixth of it) is taken as gone, and its memory released."""
    fence_timeout: float = 600.0
    """How long a GPU snapshot's copy waits for the kernels its trainer queued before ``snapshot()``; a trainer
    that is gone or gave up fails it at once."""
    max_clients: int = 512
    """Clients registered at once; a HELLO beyond it is refused (``too_many_clients``), so no trainer can make
    the daemon run out of descriptors for everyone else."""
    allow_tcp: bool = False
    """A tcp:// endpoint is reachable from other hosts, so it must be asked for, and needs curve keys."""
    allow_shared_root: bool = False
    """A root other users may write in (``/tmp``, a group folder) lets them swap a tag folder for a link or plant
    a tag, so it must be asked for."""
    curve: CurveConfig = field(default_factory=CurveConfig)
    log_level: str = "info"

    @property
    def chunks(self) -> int:
        return self.host_memory // self.chunk_size


_SIZES = {"host_memory", "chunk_size", "memory_restore_budget"}
MEMORY_RESTORE_POLICIES = ("latest", "none")
_LEVELS = {"debug", "info", "warning", "error"}


def _check_keys(data: dict, cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})", key=unknown[0])


def _positive_int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}: {value!r} is not a positive integer", key=key)
    return value


def from_mapping(data: dict | None) -> NodeConfig:
    data = dict(data or {})
    _check_keys(data, NodeConfig, "")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SIZES:
            kwargs[key] = parse_size(value, key)
        elif key in ("copy_threads", "flush_threads", "max_clients"):
            kwargs[key] = _positive_int(value, key)
        elif key == "endpoint":
            kwargs[key] = value
        elif key in ("direct_io", "prefault", "pin_host_memory", "allow_tcp", "allow_shared_root"):
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: {value!r} is not true or false", key=key)
            kwargs[key] = value
        elif key in ("client_timeout", "commit_timeout", "fence_timeout"):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key}: {value!r} is not a positive number of seconds", key=key)
            kwargs[key] = float(value)
        elif key == "memory_restore":
            if value not in MEMORY_RESTORE_POLICIES:
                raise ConfigError(f"memory_restore: {value!r} is not one of {list(MEMORY_RESTORE_POLICIES)}", key=key)
            kwargs[key] = value
        elif key == "log_level":
            if str(value).lower() not in _LEVELS:
                raise ConfigError(f"log_level: {value!r} is not one of {sorted(_LEVELS)}", key=key)
            kwargs[key] = str(value).lower()
        elif key == "storage":
            kwargs[key] = _storage(value)
        elif key == "curve":
            kwargs[key] = _curve(value)
    cfg = NodeConfig(**kwargs)
    _check_endpoint(cfg)
    _check_roots(cfg)
    if cfg.chunk_size < PAGE or cfg.chunk_size % PAGE:
        raise ConfigError(f"chunk_size: {cfg.chunk_size} must be a positive multiple of {PAGE}", key="chunk_size")
    if cfg.host_memory < cfg.chunk_size:
        raise ConfigError(
            f"host_memory: {cfg.host_memory} is smaller than one chunk ({cfg.chunk_size}); raise it or lower chunk_size",
            key="host_memory",
        )
    return cfg


def make_roots(cfg: NodeConfig) -> None:
    """Make each missing root, mode 0700 (at start, not when a config is only checked), and check it again."""
    for root in cfg.storage.roots:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"storage.roots: cannot make {root}: {exc.strerror}", key="storage.roots") from None
    _check_roots(cfg)


def _check_roots(cfg: NodeConfig) -> None:
    """Refuse a root other users may write in, unless ``allow_shared_root``; a missing one is made later (0700)."""
    for root in cfg.storage.roots:
        try:
            shared = writable_by_others(root)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"storage.roots: cannot read {root}: {exc.strerror}", key="storage.roots") from None
        if shared and not cfg.allow_shared_root:
            raise ConfigError(
                f"storage.roots: {root} is shared: {shared}. Other users could then swap a tag folder for a link "
                "or plant a tag there; use a folder of your own (made 0700), or set allow_shared_root: true",
                key="allow_shared_root")


def _storage(value: Any) -> StorageConfig:
    if not isinstance(value, dict):
        raise ConfigError("storage: must be a mapping with 'roots' and/or 'tiers'", key="storage")
    _check_keys(value, StorageConfig, "storage: ")
    tiers = _tiers(value.get("tiers", []))
    roots = value.get("roots", [r for t in tiers for r in backend_for(t.path).root_folders(t.path)] or _default_roots())
    if not isinstance(roots, list) or not roots or not all(isinstance(r, str) and os.path.isabs(r) for r in roots):
        raise ConfigError(f"storage.roots: {roots!r} must be a non-empty list of absolute paths", key="storage.roots")
    keep_last = value.get("keep_last")
    if keep_last is not None:
        keep_last = _positive_int(keep_last, "storage.keep_last")
    roots = [os.path.realpath(r) for r in roots]
    roots += [r for t in tiers for r in backend_for(t.path).root_folders(t.path) if r not in roots]
    priority = value.get("upload_priority", "low")
    if priority not in UPLOAD_PRIORITIES:
        raise ConfigError(f"storage.upload_priority: {priority!r} must be one of {', '.join(UPLOAD_PRIORITIES)}",
                          key="storage.upload_priority")
    return StorageConfig(roots=roots, keep_last=keep_last, tiers=tiers, upload_priority=priority)


def _tiers(value: Any) -> list[Tier]:
    """Fastest first; names unique, paths absolute and none inside another (a tier transfer must land on another tier)."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError("storage.tiers: must be a list of mappings with 'name' and 'path'", key="storage.tiers")
    tiers = []
    for i, raw in enumerate(value):
        where = f"storage.tiers[{i}]"
        _check_keys(raw, Tier, f"{where}: ")
        name, path = raw.get("name"), raw.get("path")
        if not isinstance(name, str) or not _TIER_NAME_RE.match(name):
            raise ConfigError(f"{where}.name: {name!r} must be a short name of letters, digits, '_' or '-'",
                              key=f"{where}.name")
        path = _tier_path(path, i, f"{where}.path")
        keep_last = raw.get("keep_last")
        shared = raw.get("shared", True)
        if not isinstance(shared, bool):
            raise ConfigError(f"{where}.shared: {shared!r} is not true or false", key=f"{where}.shared")
        place = {k: raw.get(k, "") for k in ("endpoint", "region")}
        for key, value in place.items():
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{key}: {value!r} must be a string, and only an s3:// tier has one",
                                  key=f"{where}.{key}")
        tier = Tier(name=name, path=path, shared=shared, **place,
                    keep_last=None if keep_last is None else _positive_int(keep_last, f"{where}.keep_last"))
        checks = [backend_for(path).check_tier(tier)]
        checks += [backend_for(tiers[-1].path).check_next(tiers[-1], tier)] if tiers else []
        for key, why in checks:
            if why:
                raise ConfigError(f"{where}.{key}: {why}", key=f"{where}.{key}")
        for other in tiers:
            if other.name == tier.name:
                raise ConfigError(f"{where}.name: {name!r} names two tiers", key=f"{where}.name")
            if within(tier.path, other.path) or within(other.path, tier.path):
                raise ConfigError(f"{where}.path: {tier.path} and tier {other.name!r} ({other.path}) lie inside one "
                                  "another; each tier needs its own folder", key=f"{where}.path")
        tiers.append(tier)
    return tiers


def _tier_path(path: Any, index: int, key: str) -> str:
    """A tier's path: an absolute folder, resolved; or, below the first tier, an object store address."""
    if not isinstance(path, str):
        raise ConfigError(f"{key}: {path!r} must be an absolute path or s3://bucket/prefix", key=key)
    try:
        return backend_for(path).tier_path(path, first=index == 0)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc.message}", key=key) from None
    except InvalidRequestError as exc:  # a scheme no backend serves
        raise ConfigError(f"{key}: {path!r}: {exc.message}", key=key) from None


def _curve(value: Any) -> CurveConfig:
    if not isinstance(value, dict):
        raise ConfigError("curve: must be a mapping with 'server_secret_key' and 'authorized_clients'", key="curve")
    _check_keys(value, CurveConfig, "curve: ")
    for key, path in value.items():
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ConfigError(f"curve.{key}: {path!r} must be an absolute path", key=f"curve.{key}")
    return CurveConfig(**value)


def _check_endpoint(cfg: NodeConfig) -> None:
    """ipc:// always; tcp:// only when asked for with allow_tcp, and with CURVE keys that load."""
    endpoint = cfg.endpoint
    if isinstance(endpoint, str) and endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if not isinstance(endpoint, str) or not security.is_tcp(endpoint):
        raise ConfigError(f"endpoint: {endpoint!r} must be ipc://PATH, or tcp://HOST:PORT with allow_tcp and curve keys",
                          key="endpoint")
    match = _TCP_RE.match(endpoint)
    if not match or not 1 <= int(match.group(2)) <= 65535:
        raise ConfigError(f"endpoint: {endpoint!r} must be tcp://HOST:PORT with a fixed port from 1 to 65535", key="endpoint")
    if not cfg.allow_tcp:
        raise ConfigError(
            f"endpoint: {endpoint} is a tcp endpoint, which other hosts can reach; set allow_tcp: true, with "
            "curve.server_secret_key and curve.authorized_clients (see docs/security.md), or use an ipc:// endpoint",
            key="allow_tcp",
        )
    for key, fix in (("server_secret_key", "the daemon's secret certificate (NAME.key_secret)"),
                     ("authorized_clients", "a folder of the clients' public certificates (*.key)")):
        if getattr(cfg.curve, key) is None:
            raise ConfigError(f"curve.{key}: a tcp endpoint needs CURVE keys; give {fix} (see docs/security.md)",
                              key=f"curve.{key}")
    security.load_keypair(cfg.curve.server_secret_key, "curve.server_secret_key")
    security.authorized_keys(cfg.curve.authorized_clients, "curve.authorized_clients")


def load(path: str | None) -> NodeConfig:
    """The config at ``path``, or the defaults when ``path`` is None."""
    if path is None:
        return from_mapping({})
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read node config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return from_mapping(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.message}", **exc.detail) from None
