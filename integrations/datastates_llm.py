"""DataStates-LLM's checkpoint API, through datastatesd: what DeepSpeed's ``datastates_ckpt`` config entry builds.

With ``"datastates_ckpt": {...}`` in a DeepSpeed config, DeepSpeed (0.18.1 and later)
does ``from datastates import CheckpointEngine``, builds ``CheckpointEngine(ds_config, rank)``
and drives it through its own wrapper (``DataStatesCheckpointEngine``): ``save(state, path)``
for each file, ``load(path, map_location)``, and ``wait(persist=True)`` at ``cleanup()``
only. That wrapper never fences the optimizer step and never commits before cleanup
(its ``get_commit_info()`` is None), so this engine does both itself:

- a global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
  waits until the daemon holds its copy of everything saved, the fence, then commits
  the tags saved so far; a save of a new tag, or of a file already saved in the open
  tag, commits the open tag first; exit commits what is left;
- a daemon lost at such a fence (dead, restarted, stalled past liveness) never stops
  training: one warning names the checkpoints lost with it, and the next save connects
  again (the client's reconnect); ``wait(True)``, ``commit`` and ``shutdown`` raise instead;
- the tag of a file is its ``global_step<N>`` (or Megatron ``iter_<N>``) folder, else its
  parent folder: the daemon writes the tag's marker there and the ``latest`` tracker
  beside it, which ``load_checkpoint(save_dir)`` reads.

Every rank that saves a file of a tag commits it; the daemon marks a tag of a job of
many ranks committed once all of them have. DeepSpeed without ZeRO saves the model on
data-parallel rank 0 only, so the other ranks never learn of the tag and it is never
committed: use ZeRO (stage 1 or more), or ``datastates.integrations.deepspeed``, whose
engine DeepSpeed calls on every rank.

``load`` reads each file fresh, and DeepSpeed copies the model in with ``load_state_dict``:
not in place, because this API never meets the model. DeepSpeed builds the engine from its
config and rank alone, and its wrapper's ``load(path, map_location)`` carries only a path.
For an in-place restore under DeepSpeed, assign ``DatastatesCheckpointEngine(model=engine)``
after ``deepspeed.initialize`` instead (integrations/deepspeed.py).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import sys
import time
import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from datastates.client.client import Client
from datastates.protocol.errors import CommitError, DaemonUnavailable, InvalidRequestError, WaitTimeout
from datastates.protocol.format import STAGING_RE, check_tag

from .pending_commits import PendingCommits
from .loading import MapLocation, load_any

log = logging.getLogger(__name__)

GiB = 1 << 30
CLIENT_KEYS = ("endpoint", "timeout", "liveness", "name", "on_busy", "fallback", "cpu_capture", "gpu_capture")
"""datastates' own keys in the config: ``Client``'s options."""
NO_MEANING = {
    "parser_threads": "the trainer parses nothing here: the daemon serializes and writes on its own threads "
                      "(copy_threads and flush_threads in node.yaml)",
    "pin_host_cache": "the daemon pins its own host memory (pin_host_memory in node.yaml)",
    "fast_cache_init": "the daemon's host memory is allocated once, at its start, not by the trainer",
}
"""DataStates-LLM keys that configure its in-process engine, which does not exist here."""
_TAG_FOLDER = re.compile(r"global_step\d+|iter_\d+")
POLL_S = 0.05
LOAD_TIMEOUT_S = 600.0
"""How long ``load`` waits, at most, for the versions of its path still being written or committed."""


def datastates_options(runtime_config: Any) -> dict[str, Any]:
    """The ``datastates_ckpt`` dict, from a DeepSpeed config object, a full DeepSpeed config dict, or the dict itself."""
    if runtime_config is None:
        return {}
    if hasattr(runtime_config, "datastates_config"):  # DeepSpeedConfig, or DataStates-LLM's test double of it
        runtime_config = runtime_config.datastates_config.config
    if isinstance(runtime_config, dict) and "datastates_ckpt" in runtime_config:
        runtime_config = runtime_config["datastates_ckpt"]
    if runtime_config is None or isinstance(runtime_config, bool):  # "datastates_ckpt": true
        return {}
    if not isinstance(runtime_config, dict):
        raise InvalidRequestError(f"datastates config: expected a dict or a DeepSpeed config, got {type(runtime_config).__name__}")
    known = {"host_cache_size", *NO_MEANING, *CLIENT_KEYS}
    unknown = sorted(set(runtime_config) - known)
    if unknown:
        raise InvalidRequestError(f"datastates config: unknown key(s) {unknown}; known: {sorted(known)}")
    return dict(runtime_config)


def tag_of(path: str) -> str:
    """The checkpoint a file belongs to: its nearest ``global_step<N>``/``iter_<N>`` folder, else its parent folder."""
    folder = os.path.dirname(path)
    for name in reversed(folder.split(os.sep)):
        if _TAG_FOLDER.fullmatch(name):
            return name
    return check_tag(os.path.basename(folder))


class CheckpointEngine:
    """DataStates-LLM's engine: ``save`` returns at once, the daemon copies while training goes on.

    ``runtime_config``: a DeepSpeed config (its ``datastates_ckpt`` entry is read) or a
    plain dict of the same keys. ``host_cache_size`` (GiB) is checked against the node
    daemon's host memory, which all ranks share (``host_memory`` in node.yaml);
    ``parser_threads``, ``pin_host_cache`` and ``fast_cache_init`` have no meaning here
    and are ignored with a warning; ``endpoint``, ``timeout``, ``liveness``, ``name``,
    ``on_busy``, ``fallback`` and the capture keys are ``Client``'s options. The client
    connects at construction, so a missing daemon fails ``deepspeed.initialize`` at once.

    Call order: ``save`` any number of times, then either the next optimizer step (its
    pre-hook fences and commits), ``wait()`` (the state may change again), ``wait(True)``
    or ``commit(tag)`` (durable and committed), and finally ``shutdown()``.
    """

    def __init__(self, runtime_config: Any = None, rank: int = 0, *, client: Client | None = None) -> None:
        self._closed = True  # until built: the finalizer of a half-built engine does nothing
        _mend_deepspeeds_wrapper()
        options = datastates_options(runtime_config)
        self.rank = int(rank)
        for key in sorted(set(options) & set(NO_MEANING)):
            log.warning("datastates config: %r is ignored: %s", key, NO_MEANING[key])
        self._own_client = client is None
        self.client = client or Client(**{k: options[k] for k in CLIENT_KEYS if k in options})
        if "host_cache_size" in options:
            try:
                self._check_host_cache(float(options["host_cache_size"]))
            except BaseException:
                if self._own_client:
                    self.client.close()
                raise
        self._open: dict[str, set[str]] = {}
        """Tags saved and not yet committed → the paths saved for each."""
        self._lost: dict[str, set[str]] = {}
        """Tags told lost with the daemon while still being saved → the paths saved or skipped for each: the rest of
        that checkpoint is not saved, since it cannot be whole again, until the next one begins (a save of another
        tag, or of one of these paths again: a fixed folder saved every time)."""
        self.load_timeout = LOAD_TIMEOUT_S
        self._commits = PendingCommits(f"rank {self.rank}")
        """Commits sent and not yet taken in: their failures are raised by the next save, wait(True) or shutdown."""
        ref = weakref.ref(self)
        self._hook = register_optimizer_step_pre_hook(
            lambda _opt, _args, _kwargs: _fence(ref))  # a weak reference: the hook never keeps the engine alive
        self._at_exit = functools.partial(_fence, ref, True)
        atexit.register(self._at_exit)  # commits what is left before the interpreter tears modules down
        self._closed = False

    def _check_host_cache(self, gib: float) -> None:
        budget = self.client.status()["daemon"]["host_memory"]["budget_bytes"]
        if budget < gib * GiB:
            log.warning("datastates config: host_cache_size %.4g GiB asks for more host memory than the node's daemon "
                        "holds (%.4g GiB, shared by all ranks): copies wait for memory; raise host_memory in node.yaml",
                        gib, budget / GiB)

    def save(self, state_dict: Any, path: str | os.PathLike) -> bool:
        """Hand ``state_dict`` to the daemon, to be written to ``path``; True once the message is sent.

        Tensors must not change in place until the next optimizer step, ``wait()`` or
        ``commit``: the daemon copies them while the next forward and backward run.
        """
        self._commits.settle()
        path = os.path.abspath(os.fspath(path))
        tag = tag_of(path)
        if any(open_tag != tag or path in paths for open_tag, paths in self._open.items()):
            self._step()  # a newer checkpoint begins, or this one is saved again: the open one is committed first
        lost = self._lost.get(tag)
        if lost is not None and path not in lost:  # part of it went with the daemon, as the job was told: the rest
            lost.add(path)                         # alone is no checkpoint
            return True
        self._lost.clear()
        try:
            self.client.snapshot(state_dict, path, tag=tag)
        except DaemonUnavailable as exc:  # a loss no fence met: said once, here, and training goes on
            self._lose({**self._opened(), tag: self._open.get(tag, set()) | {path}}, exc)
            return True
        self._open.setdefault(tag, set()).add(path)
        return True

    def wait(self, persist: bool = False) -> None:
        """``persist=False``: block until the daemon holds its copy of everything saved, so the state may change.
        ``persist=True``: also commit every tag saved so far and block until each is durable and committed."""
        self._copied()
        if persist:
            self._commit_open()
            self._commits.wait()

    def commit(self, tag: str) -> bool:
        """Commit ``tag`` (every file saved under its folder) and block until it is durable and committed; True."""
        if check_tag(tag) not in self._open:
            raise CommitError(f"commit({tag!r}): no file was saved for it; a file's tag is its global_step<N> or "
                              f"parent folder, and the tags saved and not committed are {sorted(self._open)}", tag=tag)
        self.wait(persist=True)
        return True

    def load(self, path: str | os.PathLike, map_location: MapLocation = None) -> Any:
        """The state at ``path``, once no snapshot of it is still being written, by this rank or any other of the node.

        Waits for the snapshots the daemon has taken in: one whose message is still on its
        way from another process is not seen. A new version of a committed ``path`` is
        waited for until its commit puts it in place (or it is given up), not only until
        it is written: till then ``path`` still holds the old version. A new version whose
        commit failed (kept by the daemon for a retry), or this engine's own not yet
        committed, is not waited for: ``path`` holds the committed version. The whole wait
        is bounded by ``load_timeout`` (``LOAD_TIMEOUT_S``, 600 s): past it, WaitTimeout
        names the path and the snapshots still pending.

        Reads datastates files and, for a job that switched, files ``torch.save`` wrote.
        DeepSpeed trusts its own checkpoint folder (its torch engine loads with
        ``weights_only=False``), and so does this engine, for DeepSpeed's own objects.
        """
        path = os.path.abspath(os.fspath(path))
        self._copied()  # the caller copies what it loads into tensors a snapshot may still be reading
        deadline = time.monotonic() + self.load_timeout
        while writing := [s for s in self.client.status()["snapshots"] if _writing(s, path, self.client.client_id)]:
            if time.monotonic() > deadline:
                raise WaitTimeout(f"load({path!r}): after {self.load_timeout:.0f} s, {len(writing)} version(s) of it are "
                                  "still being written or committed: " + ", ".join(
                                      f"{s['path']} (tag {s['tag']}, {s['state']}, commit {s['commit'] or 'none'})"
                                      for s in writing[:4]))
            time.sleep(POLL_S)
        return load_any(path, map_location, weights_only=False)

    def shutdown(self) -> None:
        """Commit what is saved, wait until it is durable, and close the client (unless it was given)."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        atexit.unregister(self._at_exit)
        try:
            self.wait(persist=True)
        finally:
            if self._own_client:
                self.client.close()

    def __del__(self) -> None:
        self._end()

    def _end(self) -> None:
        """``shutdown()`` from the finalizer or the exit handler: a failure is logged, never raised nor printed as a
        traceback at exit."""
        try:
            self.shutdown()
        except BaseException as exc:
            log.error("datastates: shutting down the checkpoint engine of rank %d failed: %s", self.rank, exc)

    def _copied(self) -> None:
        """``client.wait()``, the fence. A daemon lost meanwhile takes the open checkpoints with it: their snapshots
        were given up, so they are forgotten here, and the loss raised."""
        try:
            self.client.wait()
        except DaemonUnavailable:
            self._open.clear()
            raise

    def _step(self) -> None:
        """The fence of an optimizer step or of a save: commit the open checkpoints (or only wait, with none open).

        Raising here would break the trainer's step or save, so a daemon lost meanwhile (dead,
        restarted, stalled past liveness) is said once, as a warning naming the checkpoints lost
        with it; training goes on, and the client connects again at the next save.
        """
        opened = self._opened()  # the fence forgets them if it meets the loss
        try:
            if opened:
                self._commit_open()
            else:
                self._copied()
        except DaemonUnavailable as exc:
            self._lose(opened, exc)

    def _opened(self) -> dict[str, set[str]]:
        """The open checkpoints: tag → the paths saved for it (a copy)."""
        return {tag: set(paths) for tag, paths in self._open.items()}

    def _lose(self, lost: dict[str, set[str]], exc: DaemonUnavailable) -> None:
        """Say once that the checkpoints ``lost`` (tag → its paths saved so far) went with the daemon; the rest of
        each is not saved, until its next checkpoint begins."""
        self._commits.lost(sorted(lost), exc)
        self._lost = lost
        self._open.clear()

    def _commit_open(self) -> None:
        """Fence, then commit every open tag; their outcomes are taken in later."""
        if not self._open:
            return
        self._copied()
        for tag in list(self._open):
            try:
                fut = self.client.commit(tag)
            except DaemonUnavailable:  # the client found its daemon lost: the open checkpoints went with it
                self._open.clear()
                raise
            self._commits.add(tag, fut)
            del self._open[tag]


def _fence(ref: weakref.ref, persist: bool = False) -> None:
    """The optimizer step pre-hook (and the exit handler, ``persist=True``) of the engine ``ref`` names, if alive."""
    engine = ref()
    if engine is None or engine._closed:
        return
    if persist:
        engine._end()
    else:
        engine._step()


def _mend_deepspeeds_wrapper() -> None:
    """Give DeepSpeed's wrapper class a default ``ckpt_engine = None``.

    Its ``cleanup()`` deletes the instance's ``ckpt_engine``, and ``engine.destroy()`` and
    then the wrapper's finalizer both call it: the second raises AttributeError, printed
    as "Exception ignored in __del__" at every exit. With a class default it finds None.
    """
    wrapper = sys.modules.get("deepspeed.runtime.checkpoint_engine.datastates_checkpoint_engine")
    engine = getattr(wrapper, "DataStatesCheckpointEngine", None)
    if engine is not None and not hasattr(engine, "ckpt_engine"):
        engine.ckpt_engine = None


def _writing(snapshot: dict[str, Any], path: str, mine: str) -> bool:
    """Whether the daemon's ``snapshot`` (an entry of its status) is a version of ``path`` not yet readable there.

    One of ``path`` itself while it is copied or flushed; a new version of a committed
    ``path``, written in its tag's staging folder, until its commit switches it in (or it
    is abandoned): both remove the staging folder, so the old version is read until then.
    A durable new version is waited for only while its commit is to come (another client's,
    ``open``) or under way (``committing``): one whose commit failed waits for a retry that
    may never come, and one of this engine's own client (``mine``) is committed by no one
    while ``load`` waits.
    """
    written = snapshot["path"]
    if written == path:
        return snapshot["state"] in ("copying", "flushing")
    pending = snapshot["state"] in ("copying", "flushing") or snapshot["state"] == "durable" and (
        snapshot["commit"] == "committing" or snapshot["commit"] == "open" and snapshot["client"] != mine)
    return (pending and _staged_version(written, path) and os.path.isdir(_staging_folder(written))
            and snapshot["tag"] == tag_of(path))


def _staging_folder(written: str) -> str:
    """The staging folder (protocol/format.py, STAGING_RE) ``written`` lies in, or ""."""
    parts = written.split(os.sep)
    at = next((i for i, name in enumerate(parts) if STAGING_RE.fullmatch(name)), None)
    return os.sep.join(parts[:at + 1]) if at is not None else ""


def _staged_version(written: str, path: str) -> bool:
    """Whether ``written`` is a new version of ``path``: the same place below a staging folder beside its tag folder."""
    staging = _staging_folder(written)
    if not staging:
        return False
    rel = os.path.relpath(path, os.path.dirname(staging)).split(os.sep)
    return rel[0] != os.pardir and len(rel) > 1 and rel[1:] == os.path.relpath(written, staging).split(os.sep)
