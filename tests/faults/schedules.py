"""Seeded fault schedules: a real daemon and a real trainer, faults at random points, then I1-I5 checked.

A schedule (``Schedule.draw(seed)``) is a few saves of a tag by the trainer
(tests/faults/schedule_trainer.py), each hit by at most one fault at a random delay into it:

- ``stall``: the daemon SIGSTOPped past the client's liveness, then SIGCONTed;
- ``kill_daemon``: kill -9, and a new daemon on the same endpoint;
- ``disk_full`` / ``read_only``: the root's file system filled up, or the run folder
  bind-mounted read-only, for the save and its commit;
- ``kill_trainer``: kill -9 of the trainer, and a new trainer;
- ``clock_step``: a committed marker rewritten as a node whose clock was an hour off would write it;
- ``twin``: a second trainer process saves the same files under the same tag at the same instant
  (two ranks that picked the same path);
- ``kill_prune``: ``datastatesctl prune --keep-last 1`` of the run folder killed -9 partway through
  deleting a tag (each older tag's folder first given a few thousand small files, so a kill lands
  mid-delete), then a second prune or a daemon restart must finish or undo it;
- ``dcp_twin``: the save made instead as two ``dcp.async_save`` calls of one checkpoint_id (the
  tag's folder) with no gap, two steps: one commits, whole, and the other is refused. Drawn for a
  fifth of the saves otherwise hit by no fault (not with ``fallback="local"``), with a generator of
  its own, so that a seed's other saves stay those it drew before.

Saves pick one of three tags, so the same tag and the same paths are saved again, and one
save in ten puts its files in another tag's folder (two tags sharing a path); one schedule
in four re-saves a single tag throughout (a rolling ``last``), and one in five runs with
``fallback="local"``. The daemon keeps replicas for restores in a budget a few saves fill, and
after each schedule a restore of the newest tag through the daemon must give the committed step. Each schedule writes its own run folder under the
root; daemon and trainer carry over between schedules unless a fault killed them.

``check`` then holds the run folder against what the trainer's log says ``wait()`` and
``commit()`` told it (see its docstring for what each invariant means here). A violation
carries the seed; ``shortest`` replays smaller schedules of the same seed to find the
shortest one that still shows it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch.distributed.checkpoint as dcp

import datastates
from datastates.client import Client, daemon_status
from datastates.client.reader.stream import verify
from datastates.integrations.dcp import METADATA, DatastatesStorageReader, rank_file
from datastates.protocol.format import TEMP_SUFFIX, TRACKER, CommitMarker
from datastates.protocol.tags import committed_tags, marker_paths, read_marker

from conftest import DATASTATESCTL, DaemonFactory, DaemonProc, sh
from schedule_trainer import dcp_state

TAGS = ("t0", "t1", "t2")
NAMES = ("model.pt", "optim.pt")
FAULTS = {"none": 30, "stall": 12, "kill_daemon": 10, "disk_full": 10, "read_only": 8, "kill_trainer": 10,
          "clock_step": 12, "twin": 8, "kill_prune": 6}
"""Each fault kind and its weight in a draw."""
NEEDS_ROOT = {"disk_full", "read_only"}
DCP_TWINS = 0.2
"""The share of saves drawn with no fault that are made as a ``dcp_twin`` instead (schedules without the fallback)."""
DCP_NAMES = (rank_file(0), METADATA)
LIVENESS = 0.75
KEEP_LAST = 2
CLOCK_STEP_NS = 3600 * 10**9
DAEMON = {"host_memory": "4MiB", "chunk_size": "1MiB", "flush_threads": 1, "direct_io": False, "log_level": "info",
          "client_timeout": 3, "memory_restore": "latest", "memory_restore_budget": "40MiB"}
"""A pool a few times smaller than a save, so a stall or a kill lands mid-copy as often as mid-flush; a
killed trainer is taken as gone within a second; replicas of about three saves fill the restore budget."""
PRUNE_FILLER = 3000
"""Small files put into each tag folder a ``kill_prune`` deletes, so the kill lands mid-delete."""
TRAINER = Path(__file__).with_name("schedule_trainer.py")


@dataclass(frozen=True)
class Save:
    tag: str
    folder_tag: str
    """The tag whose folder the files go to: ``tag`` itself, or another one (two tags sharing a path)."""
    names: tuple[str, ...]
    fault: str
    delay: float
    """Seconds into the save at which a timed fault hits."""

    def __str__(self) -> str:
        where = "" if self.folder_tag == self.tag else f" in {self.folder_tag}/"
        hit = "" if self.fault == "none" else f" + {self.fault} at {self.delay:.2f}s"
        return f"save {self.tag}{where} {'+'.join(self.names)}{hit}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    fallback: str | None
    saves: tuple[Save, ...]

    @staticmethod
    def draw(seed: int, faults: tuple[str, ...]) -> Schedule:
        rng = random.Random(seed)
        kinds = [k for k in FAULTS if k in faults]
        saves = []
        tags = (rng.choice(TAGS),) if rng.random() < 0.25 else TAGS  # a rolling tag, saved again and again
        for _ in range(rng.randint(2, 5)):
            tag = rng.choice(tags)
            folder_tag = rng.choice(tags) if rng.random() < 0.1 else tag
            names = NAMES if rng.random() < 0.7 else (rng.choice(NAMES),)
            fault = rng.choices(kinds, weights=[FAULTS[k] for k in kinds])[0]
            saves.append(Save(tag, folder_tag, names, fault, round(rng.uniform(0.0, 0.25), 3)))
        fallback = "local" if rng.random() < 0.2 else None
        apart = random.Random(-seed)  # draws no number of rng's: the seed's other saves stay as they were
        if fallback is None:
            saves = [Save(s.tag, s.tag, DCP_NAMES, "dcp_twin", s.delay)
                     if s.fault == "none" and apart.random() < DCP_TWINS else s for s in saves]
        return Schedule(seed, fallback, tuple(saves))

    def without(self, i: int) -> Schedule:
        return Schedule(self.seed, self.fallback, self.saves[:i] + self.saves[i + 1:])

    def __str__(self) -> str:
        lines = [f"seed {self.seed}" + (", fallback='local'" if self.fallback else "")]
        return "\n".join(lines + [f"  {n}. {s}" for n, s in enumerate(self.saves, 1)])


class Violation(AssertionError):
    pass


class Trainer:
    """The trainer process and its log of what ``wait()`` and ``commit()`` told it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        log.touch()
        self.proc = subprocess.Popen([sys.executable, str(TRAINER), str(log)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def call(self, **cmd: Any) -> dict[str, Any] | None:
        """The reply to ``cmd``; None if the trainer died first (a kill_trainer fault)."""
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        line = self.proc.stdout.readline()  # the trainer's own timeouts bound this
        return json.loads(line) if line else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


@dataclass
class Tally:
    schedules: int = 0
    saves: int = 0
    faults: collections.Counter = field(default_factory=collections.Counter)
    told: collections.Counter = field(default_factory=collections.Counter)
    held: int = 0
    """Leftovers a live daemon still held at a schedule's end, removed by the next daemon (I5)."""

    def __str__(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        told = ", ".join(f"{k} {v}" for k, v in sorted(self.told.items()))
        return (f"{self.schedules} schedules, {self.saves} saves; faults: {faults}; wait()/commit() told: {told}; "
                f"leftovers a live daemon held until the next one removed them: {self.held}")


class Node:
    """One node: a root (a small loop-mounted file system where we may mount), a daemon and a trainer."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mount: Path | None = None
        self.root = self._make_root()
        self.faults = tuple(k for k in FAULTS if self.mount is not None or k not in NEEDS_ROOT)
        self.factory = DaemonFactory(tmp)
        self.daemon = self.factory.start(storage={"roots": [str(self.root)], "keep_last": KEEP_LAST}, **DAEMON)
        self.trainers = 0
        self.trainer = self._new_trainer()
        self.step = 0
        self.tally = Tally()

    def _make_root(self) -> Path:
        if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
            root = self.tmp / "ckpt"
            root.mkdir()
            return root
        img, mnt = self.tmp / "fs.img", self.tmp / "mnt"
        mnt.mkdir()
        with img.open("wb") as f:
            f.truncate(160 << 20)
        if sh("mkfs.ext4", "-q", "-F", "-m", "0", img).returncode or sh("mount", "-o", "loop", img, mnt).returncode:
            root = self.tmp / "ckpt"
            root.mkdir()
            return root
        self.mount = mnt
        (mnt / "ckpt").mkdir()
        return mnt / "ckpt"

    def close(self) -> None:
        self.trainer.kill()
        self.daemon.proc.send_signal(signal.SIGCONT)
        self.factory.stop_all()
        if self.mount is not None:
            for _ in range(4):
                if not os.path.ismount(self.mount) or sh("umount", self.mount).returncode == 0:
                    continue
                sh("umount", "-l", self.mount)

    def _new_trainer(self) -> Trainer:
        self.trainers += 1
        return Trainer(self.tmp / f"trainer{self.trainers}.log")

    def _restart_daemon(self) -> None:
        self.daemon = self.factory.start(storage={"roots": [str(self.root)], "keep_last": KEEP_LAST},
                                         endpoint=self.daemon.endpoint, **DAEMON)

    def _connect(self, fallback: str | None) -> None:
        self.trainer.call(op="client", endpoint=self.daemon.endpoint, fallback=fallback, liveness=LIVENESS)

    # -- one schedule -------------------------------------------------------------------------------------

    def run(self, schedule: Schedule) -> None:
        """Run ``schedule`` in its own run folder, settle, check I1-I5, and remove the run folder if they hold."""
        run = self.root / f"s{schedule.seed}-{self.step + 1}"  # a replay of the seed gets a folder of its own
        run.mkdir()
        logs = [self.trainer]
        seen = len(self.trainer.events())  # the carried-over trainer's lines of earlier schedules
        saved: dict[int, Save] = {}
        twins: list[tuple[int, int]] = []
        pruned: dict[str, int] = {}
        killed_daemon = False
        self._connect(schedule.fallback)
        for save in schedule.saves:
            self.step += 1
            saved[self.step] = save
            self.tally.faults[save.fault] += 1
            killed_daemon |= save.fault in ("kill_daemon", "kill_prune")
            if save.fault == "twin":  # the twin saves the next step: both steps are the tag's, of the same files
                self.step += 1
                saved[self.step] = save
                twins.append((self.step - 1, self.step))
                reply = self._twin_save(save, run, self.step - 1, logs)
            elif save.fault == "dcp_twin":  # the second save is of the next step
                self.step += 1
                saved[self.step] = save
                twins.append((self.step - 1, self.step))
                reply = self.trainer.call(op="dcp_twin", step=self.step - 1, folder=str(run / save.tag))
            else:
                with self._fault(save, run):
                    reply = self.trainer.call(op="save", step=self.step, tag=save.tag,
                                              folder=str(run / save.folder_tag), names=list(save.names))
                if save.fault == "kill_prune":
                    self._kill_prune(run, random.Random(save.delay), pruned)
            if reply is None or self.trainer.proc.poll() is not None:  # killed: a new trainer takes over
                self.trainer.kill()
                self.trainer = self._new_trainer()
                logs.append(self.trainer)
                self._connect(schedule.fallback)
            elif save.fault in ("kill_daemon", "kill_prune"):
                self._connect(schedule.fallback)  # a new daemon does not know the old client
        self.trainer.call(op="close")
        events = logs[0].events()[seen:] + [e for t in logs[1:] for e in t.events()]
        self.tally.schedules += 1
        self.tally.saves += len(saved)
        self.tally.told.update(e["outcome"].split(":")[0] for e in events if "outcome" in e)
        try:
            self._settle(killed_daemon)
            check(run, saved, events, twins, pruned)
            self._check_restore(run)
            self._check_leftovers(run)
        except Violation:  # the run folder stays for a look, with what the trainer was told
            run.with_suffix(".log").write_text("".join(json.dumps(e) + "\n" for e in events))
            raise
        shutil.rmtree(run)

    def _twin_save(self, save: Save, run: Path, step: int, logs: list[Trainer]) -> dict[str, Any] | None:
        """``save`` by the trainer (``step``) and by a second trainer (``step + 1``) at the same instant; the
        trainer's reply. The second trainer's log joins ``logs``; it leaves once its commit is answered."""
        twin = self._new_trainer()
        logs.append(twin)
        twin.call(op="client", endpoint=self.daemon.endpoint, fallback=None, liveness=LIVENESS)
        replies: dict[int, dict[str, Any] | None] = {}

        def save_as(trainer: Trainer, s: int) -> None:
            replies[s] = trainer.call(op="save", step=s, tag=save.tag, folder=str(run / save.folder_tag),
                                      names=list(save.names))

        both = [threading.Thread(target=save_as, args=(t, s)) for t, s in ((self.trainer, step), (twin, step + 1))]
        for t in both:
            t.start()
        for t in both:
            t.join()
        twin.call(op="close")
        twin.kill()
        return replies[step]

    def _kill_prune(self, run: Path, rng: random.Random, pruned: dict[str, int]) -> None:
        """``datastatesctl prune --keep-last 1`` of ``run`` killed -9 partway through deleting a tag, then
        finished by a second prune or a daemon restart (drawn); every tag it was deleting must then be gone
        whole or still committed whole, never a folder left half-deleted."""
        self.trainer.call(op="drain", timeout=30)
        tags = committed_tags(str(run), own_folder=True)
        doomed = tags[1:]
        if not doomed:
            return
        for tag in set(TAGS) - {tags[0].tag}:  # with keep_last's deletions before it, only the newest may stay
            pruned[tag] = self.step
        for tag in doomed:
            filler = Path(tag.folder) / "extra"
            filler.mkdir(exist_ok=True)
            for i in range(PRUNE_FILLER):
                (filler / f"{i}").touch()
        watched = Path(doomed[0].folder)
        total = sum(1 for _ in watched.rglob("*"))
        kill_at = rng.uniform(0.0, 0.95) * total
        proc = subprocess.Popen([DATASTATESCTL, "prune", str(run), "--keep-last", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            try:
                left = sum(1 for _ in watched.rglob("*"))
            except OSError:  # the folder went while counting
                left = 0
            if left <= kill_at:
                proc.kill()
                break
        proc.wait(60)
        if rng.random() < 0.5:
            sh(DATASTATESCTL, "prune", run, "--keep-last", "1")
        else:
            self.daemon.stop()
            self._restart_daemon()
            self._settle(restarted=True)
        for tag in doomed:
            if not Path(tag.folder).exists():
                continue
            if read_marker(tag.marker_path) is None:
                raise Violation(f"a killed prune left tag {tag.tag} half-deleted at {tag.folder} "
                                f"({sum(1 for _ in Path(tag.folder).rglob('*'))} entries, no whole marker) "
                                f"after a second prune or daemon start")
            shutil.rmtree(Path(tag.folder) / "extra")  # a tag that stands again: re-saves of it may swap its folder

    def _check_restore(self, run: Path) -> None:
        """I6: a restore of the newest tag through the daemon (from its replica, or storage) gives the step the
        committed files hold: a replica of an older save of the tag never answers for the newer one."""
        newest = datastates.latest(run)
        if newest is None:
            return
        markers = [(m, path) for path in marker_paths(str(run), 1)
                   if (m := CommitMarker.read(path)) is not None and m.tag == newest]
        marker, path = max(markers, key=lambda mp: mp[0].newness)  # readers take a tag's newest marker
        if Path(path).parent.name != newest or METADATA in {f.path for f in marker.files}:  # restore reads a tag
            return  # from its own folder only; a DCP checkpoint's whole load is check()'s
        client = Client(self.daemon.endpoint, timeout=30)
        try:
            for f in marker.files:
                restored = client.restore(run, f.path, tag=newest)
                got = restored.state["step"] if restored is not None else None
                want = step_of(Path(path).parent / f.path)
                if got != want:
                    raise Violation(f"I6: restore of {newest}/{f.path} from {restored and restored.source} "
                                    f"gave step {got}, but the committed file holds step {want}")
        finally:
            client.close(timeout=5)

    def _check_leftovers(self, run: Path) -> None:
        """I5: nothing is left once the next daemon has started. What the live daemon still holds (a temporary
        file it could not remove from a read-only folder, the staging folder of a re-save whose commit failed) is
        counted, then the daemon is restarted and must remove it."""
        left = leftovers(run)
        if not left:
            return
        self.tally.held += len(left)
        self.daemon.stop()
        self._restart_daemon()
        self._settle(restarted=True)
        if leftovers(run):
            raise Violation(f"I5: the next daemon did not remove {[str(p) for p in leftovers(run)]}")

    @contextlib.contextmanager
    def _fault(self, save: Save, run: Path) -> Iterator[None]:
        """Inject ``save.fault`` around the trainer's save (timed faults on a thread, ``delay`` s in)."""
        if save.fault == "disk_full":
            with self._full():
                yield
                self.trainer.call(op="drain", timeout=30)  # the commit meets the full disk too
            return
        if save.fault == "read_only":
            with self._read_only(run):
                yield
                self.trainer.call(op="drain", timeout=30)
            return
        if save.fault == "clock_step":  # a marker as written by another clock: not one a commit in flight rewrites
            self.trainer.call(op="drain", timeout=30)
            shift_a_marker(run, random.Random(save.delay))
        timed = {"stall": self._stall, "kill_daemon": self._kill_daemon, "kill_trainer": self.trainer.kill}.get(save.fault)
        if timed is None:
            yield
            return
        hit = threading.Timer(save.delay, timed)
        hit.start()
        try:
            yield
        finally:
            hit.join()

    def _stall(self) -> None:
        self.daemon.proc.send_signal(signal.SIGSTOP)
        time.sleep(LIVENESS + 0.4)
        self.daemon.proc.send_signal(signal.SIGCONT)

    def _kill_daemon(self) -> None:
        self.daemon.proc.kill()
        self.daemon.proc.wait(30)
        self._restart_daemon()

    @contextlib.contextmanager
    def _full(self) -> Iterator[None]:
        filler = self.root.parent / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(20):  # the daemon may be flushing meanwhile: take what is free, again, until it holds
                st = os.statvfs(self.root)
                want = st.f_bavail * st.f_frsize - (256 << 10)
                if want <= 0:
                    break
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, want)
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
            yield
        finally:
            os.close(fd)
            filler.unlink()

    @contextlib.contextmanager
    def _read_only(self, run: Path) -> Iterator[None]:
        bound = sh("mount", "--bind", run, run)
        assert bound.returncode == 0, f"mount --bind {run}: {bound.stderr}"
        try:
            for _ in range(100):  # busy while a file is open for writing there (the previous save's flush)
                ro = sh("mount", "-o", "remount,bind,ro", run)
                if ro.returncode == 0 or "busy" not in ro.stderr:
                    break
                time.sleep(0.05)
            assert ro.returncode == 0, f"remount,bind,ro {run}: {ro.stderr}"
            yield
        finally:
            for _ in range(100):  # busy while the daemon has a file open there
                if sh("umount", run).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                sh("umount", "-l", run)

    def _settle(self, restarted: bool) -> None:
        """Wait until the daemon has nothing pending, has let every trainer go (the schedule's clients closed
        or were killed) and, after a restart, has finished its recovery."""
        status: dict[str, Any] = {}
        for _ in range(1200):
            status = daemon_status(self.daemon.endpoint, timeout=30)
            if (not status["pending"] and not status["commits_pending"] and not status["clients"]
                    and (not restarted or status["daemon"]["leftovers_removed"] is not None)):
                return
            time.sleep(0.05)
        unsettled = {k: status.get(k) for k in ("pending", "commits_pending", "clients")}
        raise Violation(f"the daemon never settled: {unsettled}; snapshots {status.get('snapshots')}")


def shift_a_marker(run: Path, rng: random.Random) -> None:
    """Rewrite one committed marker of ``run`` as a node whose clock was an hour ahead or behind would have."""
    paths = marker_paths(str(run), 1)
    if not paths:
        return
    path = Path(rng.choice(paths))
    marker = json.loads(path.read_text())
    shift = rng.choice((-1, 1)) * CLOCK_STEP_NS
    marker["requested_ns"] += shift
    marker["committed_ns"] += shift
    temp = path.with_name(path.name + ".clock")
    temp.write_text(json.dumps(marker))
    temp.rename(path)  # whole, as the daemon writes markers


def check(run: Path, saved: dict[int, Save], events: list[dict[str, Any]], twins: list[tuple[int, int]] = (),
          pruned: dict[str, int] | None = None) -> None:
    """I1-I5 on ``run`` once the daemon has settled, against what the trainer was told.

    Every element of a save holds its step; the trainer writes ``-step`` right after ``wait()``.
    - I1: every file a marker lists verifies and holds one step, the same in every file of
      the tag, a step saved under that tag with exactly those files.
    - I3: that step's ``wait()`` did not raise (unavailable or refused): a snapshot the
      trainer gave up on, or that was refused, never appears.
    - I2: a tag whose ``commit()`` resolved holds that step or a later one of its own, unless
      ``keep_last`` newer tags stand or a prune deleted it after that step (``pruned``: tag -> the
      step at its prune); every marker that is there is readable and its files whole. Of twin saves
      (``twins``: two trainers saving the same files of one tag at once) both told committed, the tag
      holds the one whose commit was answered last, or a later step: never the other. Of twin saves one told
      committed and the other told its daemon was lost (the outcome unknown), or one saved in its own process
      (``fallback="local"``) and one through the daemon, the tag may hold either. Of DCP twin saves (``dcp_twin``,
      one client) never both are told committed; a DCP checkpoint's step is the one it loads as, whole.
    - I4: ``latest()`` names the tag the trainer committed last of those there (by the order of
      its commits, never a clock) and holds a step at least the newest confirmed one; the
      ``latest`` tracker names a committed tag.
    I5 is ``Node._check_leftovers``'s.
    """
    told = {(e["step"], e["event"]): e.get("outcome") for e in events}
    answered = {e["step"]: e["t"] for e in events if e["event"] == "commit"}
    pruned = pruned or {}
    committed: dict[str, int] = {}
    newness: dict[str, tuple[int, int, int]] = {}
    for path in marker_paths(str(run), 1):
        marker = CommitMarker.read(path)
        if marker is None or read_marker(path) is None:
            raise Violation(f"{path}: a marker that is torn or whose files changed size after commit")
        steps = marker_steps(Path(path).parent, marker)
        if len(steps) != 1:
            raise Violation(f"I1: tag {marker.tag} mixes steps {sorted(steps)} across its files")
        step = steps.pop()
        save = saved.get(step)
        if save is None or save.tag != marker.tag or sorted(f.path for f in marker.files) != sorted(save.names):
            raise Violation(f"I1: tag {marker.tag} holds step {step} ({[f.path for f in marker.files]}), "
                            f"which was saved as {save}")
        wait = told.get((step, "wait"))
        if wait is not None and wait not in ("ok", "local"):
            raise Violation(f"I3: tag {marker.tag} holds step {step}, whose wait() told the trainer {wait!r}")
        if marker.tag not in newness or marker.newness > newness[marker.tag]:  # a tag committed in two folders:
            committed[marker.tag], newness[marker.tag] = step, marker.newness  # readers take its newest marker
    confirmed = {s: saved[s].tag for s in saved if told.get((s, "commit")) == "ok"}
    unknown: dict[str, set[int]] = collections.defaultdict(set)
    """Per tag, the twin saves whose commit outcome the trainer could not know (the daemon was lost before it
    answered: "it may have died ... check datastates.latest"): admitted after its partner's commit, such a save is
    that tag's next version, and may have been switched in before the daemon died (seed 210293)."""
    for pair in twins:
        if saved[pair[0]].fault == "dcp_twin" and all(told.get((s, "commit")) == "ok" for s in pair):
            raise Violation(f"I2: two DCP saves of checkpoint {saved[pair[0]].tag} at once, steps {pair}, were both "
                            "told committed: one of them is lost, or the checkpoint mixes them")
        for s in pair:
            if (told.get((s, "commit")) or "").startswith("error: DaemonUnavailable"):
                unknown[saved[s].tag].add(s)
    for pair in twins:
        if all(s in confirmed for s in pair):
            first, last = sorted(pair, key=answered.__getitem__)
            del confirmed[first]  # superseded by the commit answered after it
            if any(told.get((s, "wait")) == "local" for s in pair):
                # one twin committed in its own process, the other through the daemon: each switched its version in
                # whole, and the daemon's answer reaches its trainer only after its switch, so which was answered
                # last does not say which switched last (seed 240019); either one, whole, is the tag's
                unknown[saved[last].tag].update(pair)
                continue
            if committed.get(saved[last].tag) == first:
                raise Violation(f"I2: twin saves {pair} of tag {saved[last].tag} were both told committed, the "
                                f"commit of step {last} last, but the tag holds step {first}: step {last} is lost")
    for tag in sorted(set(confirmed.values())):
        step = max(s for s, t in confirmed.items() if t == tag)  # its last commit() that resolved
        mine = committed.get(tag)
        if mine is not None and (mine >= step or mine in unknown[tag]):
            continue
        newer = [t for t, s in committed.items() if s > step]
        if mine is None and (len(newer) >= KEEP_LAST or pruned.get(tag, -1) >= step):
            continue
        raise Violation(f"I2: commit() of tag {tag} at step {step} resolved (its last that did), but the tag now "
                        f"holds {'nothing' if mine is None else f'step {mine}'} (tags there: {committed})")
    latest = datastates.latest(run)
    if committed:
        expected = max(committed, key=committed.__getitem__)
        if latest != expected:
            raise Violation(f"I4: latest() names {latest}, but the last commit there is {expected} ({committed})")
        if confirmed and committed[latest] < max(confirmed):
            raise Violation(f"I4: latest() holds step {committed[latest]}, older than confirmed step {max(confirmed)}")
    elif latest is not None:
        raise Violation(f"I4: latest() names {latest}, which has no marker")
    tracker = run / TRACKER
    if tracker.exists() and tracker.read_text() not in committed:
        raise Violation(f"I4: the tracker names {tracker.read_text()!r}, not a committed tag ({committed})")


def leftovers(run: Path) -> list[Path]:
    """Temporary files and staging folders under ``run``: what no reader trusts, and I5 says must go."""
    return [p for p in run.rglob("*") if p.name.endswith(TEMP_SUFFIX) or p.name.startswith(".")]


def marker_steps(folder: Path, marker: CommitMarker) -> set[int]:
    """The steps the files ``marker`` lists hold: of a DCP checkpoint (its metadata listed), the one step it loads
    as, whole, through DCP, every file verified first."""
    if METADATA not in {f.path for f in marker.files}:
        return {step_of(folder / f.path) for f in marker.files}
    state = dcp_state(0)
    try:
        for f in marker.files:
            verify(folder / f.path)
        dcp.load(state, checkpoint_id=str(folder), storage_reader=DatastatesStorageReader(), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - any failure to load a committed checkpoint is the finding
        raise Violation(f"I1: committed DCP checkpoint {folder} does not load: {str(exc)[:400]}") from exc
    return set(state["w"].unique().tolist()) | set(state["i"].unique().tolist()) | {state["step"]}


def step_of(path: Path) -> int:
    """The one step ``path`` holds in every element, after a full verify; a Violation if it holds more."""
    try:
        verify(path)
        state = datastates.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read a committed file is the finding
        raise Violation(f"I1: committed file {path} does not load: {exc}") from exc
    values = set(state["w"].unique().tolist()) | set(state["i"].unique().tolist()) | {state["step"]}
    if len(values) != 1:
        raise Violation(f"I1: {path} mixes values {sorted(values)}: a snapshot torn by the trainer's next step")
    return int(values.pop())


def shortest(node: Node, schedule: Schedule, attempts: int = 12) -> Schedule:
    """The smallest schedule of the same seed found to still fail, removing one save at a time."""
    best = schedule
    for _ in range(attempts):
        for i in range(len(best.saves)):
            smaller = best.without(i)
            if not smaller.saves:
                continue
            try:
                node.run(smaller)
            except Violation:
                best = smaller
                break
        else:
            return best
    return best

