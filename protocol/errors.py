"""Exceptions with one meaning each.

The daemon turns any of these into an ERROR reply carrying ``code``; the client maps the
code back to the same class and raises it, so both sides speak the same errors.
"""

from __future__ import annotations


class DatastatesError(Exception):
    """Base of every datastates error; ``code`` is its stable wire name."""

    code = "internal"

    def __init__(self, message: str, **detail: object) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class ProtocolError(DatastatesError):
    """A frame or message body that does not follow the protocol."""

    code = "protocol"


class VersionMismatchError(ProtocolError):
    """The peer speaks another protocol version."""

    code = "version_mismatch"


class UnknownMessageError(ProtocolError):
    """A message type this daemon does not know."""

    code = "unknown_message"


class UnknownClientError(DatastatesError):
    """A request from a client that never said HELLO, or that already left."""

    code = "unknown_client"


class InvalidRequestError(DatastatesError):
    """A well-formed message whose content makes no sense (bad tag, descriptor or bounds)."""

    code = "invalid_request"


class PathNotAllowedError(DatastatesError):
    """A checkpoint path outside the configured ``storage.roots``."""

    code = "path_not_allowed"


class SharedMemoryError(DatastatesError):
    """A shared-memory region that cannot be created or opened."""

    code = "shared_memory"


class TooManyClientsError(DatastatesError):
    """The daemon already serves ``max_clients`` clients: this HELLO is refused, the others are served."""

    code = "too_many_clients"


class StorageError(DatastatesError):
    """Writing a checkpoint file or marker failed (disk full, read-only, I/O error)."""

    code = "storage"


class SnapshotFailedError(DatastatesError):
    """A snapshot could not be copied or flushed; its files were not made visible."""

    code = "snapshot_failed"


class CommitError(DatastatesError):
    """A tag could not be committed: nothing was snapshotted for it, or one of its files failed."""

    code = "commit_failed"


class SnapshotSkippedError(DatastatesError):
    """A tag the daemon skipped under ``on_busy: skip``, because an older tag was still being written."""

    code = "skipped"


class ShuttingDownError(DatastatesError):
    """The daemon is draining and takes no new work."""

    code = "shutting_down"


class DaemonUnavailable(DatastatesError):
    """No daemon answered on the endpoint within the timeout."""

    code = "daemon_unavailable"


class DaemonNotRunning(DaemonUnavailable):
    """Nothing listens on the endpoint (no socket file, a refused connection): no daemon runs there.

    Said at once, before any timeout, by a client that never heard from a daemon on that
    endpoint. A DaemonUnavailable, so ``fallback="local"`` and every handler of it still apply.
    """

    code = "daemon_not_running"


class WaitTimeout(DatastatesError, TimeoutError):
    """A wait ran past its timeout; the work it waited for is still pending."""

    code = "timeout"


class ConfigError(DatastatesError):
    """A node config with an unknown key or a bad value."""

    code = "config"


class CorruptCheckpointError(DatastatesError):
    """A checkpoint file whose size, header or checksums do not match what it declares."""

    code = "corrupt"


class WeightsOnlyError(DatastatesError):
    """``load(weights_only=True)`` met an object its safe unpickler does not allow."""

    code = "weights_only"


class UnsupportedFormatError(DatastatesError):
    """A file that is not a datastates checkpoint, or of a format version this reader does not know."""

    code = "unsupported_format"


class CheckpointGoneError(DatastatesError):
    """A committed checkpoint was deleted (a prune, retention) while it was being restored, again and again."""

    code = "checkpoint_gone"


class StateMismatchError(InvalidRequestError):
    """A checkpoint does not fit the state it is restored into (``load(path, into=state)``): a key one side lacks,
    or a tensor of another shape or dtype. Raised before any byte of ``into`` is written."""

    code = "state_mismatch"


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[DatastatesError]] = {
    c.code: c for c in [DatastatesError, *_all_subclasses(DatastatesError)]
}


def error_from_code(code: str, message: str, detail: dict | None = None) -> DatastatesError:
    """Rebuild the exception a peer reported; an unknown code becomes the base class."""
    cls = ERRORS_BY_CODE.get(code, DatastatesError)
    return cls(message, **{k: v for k, v in (detail or {}).items() if k != "message"})
