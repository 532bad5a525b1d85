"""Mutation check: the suite must be able to fail, so each deliberate bug must fail a test named for it.

Not part of the pytest run (its name does not match ``test_*.py``); run it on demand::

    .venv/bin/python tests/mutations.py                       # every mutation, then the table
    .venv/bin/python tests/mutations.py wait-at-admission     # one mutation (or several) by name
    .venv/bin/python tests/mutations.py --list                # the names and what each breaks
    .venv/bin/python tests/mutations.py --no-baseline ...     # skip the unmutated run of the tests first

For each mutation it copies the working tree (tracked files and untracked ones git does
not ignore) into a temporary folder, applies one small textual bug there (each
replacement must match exactly once, so the script breaks loudly when the code moves),
and runs the tests that must catch it against that copy. The copy is what gets imported,
by pytest and by every ``datastatesd`` and trainer the tests spawn: ``PYTHONPATH`` points
at the copy, whose ``datastates/`` folder links the installed layout (``protocol/``,
``client/``, ``daemon/``), so the path finder resolves every ``datastates.*`` module there
before the editable install's finder is asked. A mutation is caught when its tests fail
(pytest exit status 1); the table lists each one, and the exit status is 1 if any survives.

First, unless ``--no-baseline``, the same tests run on an unmutated copy: they must pass
there, or a failure under a mutation would prove nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)
RUN_TIMEOUT_S = 1800
"""A mutation whose tests hang past this is reported as such (pytest-timeout normally fails them first)."""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``path`` (relative to the repository); ``old`` must occur exactly once."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    """pytest node ids, relative to the repository, that must fail under this mutation."""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "wait-at-admission",
        "WAIT is answered at admission, before any byte is copied",
        (Edit("daemon/server.py",
              "        results = await asyncio.gather(*(j.copied for j in jobs), return_exceptions=True)\n",
              "        results = [None for _ in jobs]  # MUTATION: answered before the copy\n"),),
        ("tests/test_pipeline.py::test_wait_returns_only_once_the_daemon_holds_its_own_copy",),
    ),
    Mutation(
        "no-fsync",
        "no fsync of data files or folders",
        (Edit("protocol/fileio.py",
              "    fd = open_folder(path, trusted=trusted)\n    try:\n        os.fsync(fd)\n",
              "    return  # MUTATION: no folder fsync\n    fd = open_folder(path, trusted=trusted)\n"
              "    try:\n        os.fsync(fd)\n"),
         Edit("protocol/fileio.py",
              "                    os.mkdir(part, mode, dir_fd=fd)\n                    os.fsync(fd)\n",
              "                    os.mkdir(part, mode, dir_fd=fd)  # MUTATION: no fsync of a new folder's parent\n"),
         Edit("protocol/storage/posix.py",
              "            os.fsync(handle.fd)\n",
              "            pass  # MUTATION: no file fsync\n"),
         Edit("protocol/storage/posix.py",
              "            os.fsync(handle.folder)\n",
              "            pass  # MUTATION: no folder fsync after the rename\n")),
        ("tests/faults/test_power_loss.py",),
    ),
    Mutation(
        "write-in-place",
        "data written in place under its final name (no temporary name, no rename)",
        (Edit("protocol/storage/posix.py",
              "        temp = temp_path(path, f\"{self.owner}-{token}\")\n"
              "        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW\n",
              "        temp = path  # MUTATION: written under the final name\n"
              "        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW\n"),),
        ("tests/faults/test_kill_daemon.py::test_kill9_while_a_file_is_half_written_leaves_nothing_partial_under_its_final_name",
         "tests/faults/test_kill_daemon.py::test_kill9_mid_flush_leaves_no_partial_file_under_a_final_name"),
    ),
    Mutation(
        "tracker-before-marker",
        "the `latest` trackers written before the commit marker",
        (Edit("daemon/commit.py",
              "        if staging is None:\n"
              "            await self._write(path, marker.encode(), tag, check=functools.partial(check_listed, folder, marker, wanted))\n",
              "        if staging is None:\n"
              "            if os.path.basename(folder) == tag and any(within(os.path.dirname(folder), r) for r in self._roots):\n"
              "                for tracker, data in trackers(tag, folder).items():  # MUTATION: trackers first\n"
              "                    await self._write(tracker, data, tag)\n"
              "            await self._write(path, marker.encode(), tag, check=functools.partial(check_listed, folder, marker, wanted))\n"),),
        ("tests/test_commit.py::test_the_trackers_never_name_a_tag_whose_marker_failed",
         "tests/faults/test_kill_daemon.py::test_kill9_mid_flush_leaves_no_partial_file_under_a_final_name"),
    ),
    Mutation(
        "no-storage-index-bound",
        "a tensor entry's storage index checked only against 0, not against the number of sources",
        (Edit("protocol/tensormeta.py",
              "    if not isinstance(storage, int) or isinstance(storage, bool) or not 0 <= storage < len(storage_sizes):\n",
              "    if not isinstance(storage, int) or isinstance(storage, bool) or storage < 0:  # MUTATION: no upper bound\n"),),
        ("tests/faults/test_fuzz_protocol.py::test_valid_looking_snapshots_over_real_memory",),
    ),
    Mutation(
        "commit-before-durable",
        "COMMIT writes the marker without waiting for the files to be durable",
        (Edit("daemon/commit.py",
              "        results = await asyncio.gather(*(s.durable for s in admitted), return_exceptions=True)\n",
              "        results = [None for _ in admitted]  # MUTATION: no wait for durable files\n"),),
        ("tests/test_commit.py::test_commit_fails_when_a_file_cannot_become_durable_though_its_marker_could",),
    ),
    Mutation(
        "restore-by-path",
        "restore looks a replica up by path, ignoring the tag and the committed state",
        (Edit("daemon/replica/table.py",
              "        match = [r for r in found if r.tag == tag and r.snapshot == snapshot and r.committed and r.size == size\n",
              "        match = [r for r in found[::-1] if r.size == size  # MUTATION: by path, the newest first\n"),
         Edit("daemon/replica/table.py",
              "        if not snapshot or not match:\n",
              "        if not match:  # MUTATION: by path\n"),),
        ("tests/test_restore.py::test_restore_by_tag_returns_its_committed_version_never_a_newer_uncommitted_one",),
    ),
    Mutation(
        "node-commits-without-node0",
        "a node other than node 0 answers COMMIT without waiting for node 0's marker",
        (Edit("daemon/commit.py",
              "            marker = await self._nodes.await_marker(tag, folder, mine, commit.present)\n",
              "            marker = mine  # MUTATION: never waits for node 0's\n"),),
        ("tests/test_multirank.py::test_a_node_other_than_0_confirms_a_commit_only_once_node_0s_marker_exists",),
    ),
    Mutation(
        "gather-takes-a-failed-attempts-part",
        "node 0 commits a tag with any done marker of its tag, one a failed attempt of the job left included",
        (Edit("daemon/gather.py", "                why = attempt.refuses(marker, tag)\n",
              "                why = ''  # MUTATION: any attempt's\n"),),
        ("tests/faults/test_restarted_job.py::test_a_restarted_job_never_commits_a_tag_with_a_failed_attempts_part[its node is replaced]",
         "tests/faults/test_restarted_job.py::test_a_dead_attempts_rank_is_never_told_committed_by_a_live_daemon"),
    ),
    Mutation(
        "gather-takes-a-later-attempts-part",
        "node 0's round of a dead attempt, still waiting, takes a done marker whose ranks started after it was asked for",
        (Edit("daemon/gather.py", "        if done.began_ns and done.began_ns > self.requested_ns + skew:\n",
              "        if False:  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_a_round_of_a_dead_attempt_still_waiting_never_commits_with_a_later_attempts_part",),
    ),
    Mutation(
        "node-confirms-another-attempts-marker",
        "a node other than 0 confirms any newer marker of its tag, one listing another attempt's files included",
        (Edit("daemon/gather.py", "    if any(listed.get(f.path) != f.snapshot for f in mine.files):\n",
              "    if False:  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_a_waiting_round_of_a_dead_attempt_neither_confirms_nor_withdraws_a_later_attempts_commit",),
    ),
    Mutation(
        "node-withdraws-a-later-attempts-done-marker",
        "a node that gives up removes the done marker of its name whoever wrote it",
        (Edit("daemon/gather.py",
              "    if there is not None and (there.committed_ns, there.owner) == (mine.committed_ns, mine.owner):\n",
              "    if True:  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_a_waiting_round_of_a_dead_attempt_neither_confirms_nor_withdraws_a_later_attempts_commit[after it gave up]",),
    ),
    Mutation(
        "resumed-transfer-loses-its-job",
        "a restarted daemon resumes a multi-node tier transfer as a job of no name",
        (Edit("daemon/tiers.py", "node_rank=max(0, marker.node),\n                job=marker.job)",
              "node_rank=max(0, marker.node))  # MUTATION"),),
        ("tests/faults/test_restarted_job.py::test_a_transfer_resumed_by_a_restarted_daemon_commits_the_tag_on_the_shared_tier",),
    ),
    Mutation(
        "ranks-seal-the-new-version-one-by-one",
        "a multi-rank round's new version is sealed at its first rank's commit (a later rank's file starts another)",
        (Edit("daemon/commit.py", "        if ranks.world_size == 1:  # before any await: a snapshot admitted next gets its own version\n",
              "        if True:  # MUTATION\n"),),
        ("tests/faults/test_resave.py::test_ranks_saving_a_committed_tag_again_make_one_new_version_whoever_commits_first",),
    ),
    Mutation(
        "node-keeps-its-part-when-its-ranks-die",
        "a node other than 0 keeps its done marker in place after every rank that asked for the tag died",
        (Edit("daemon/gather.py", "            if time.monotonic() > deadline or not present():\n",
              "            if time.monotonic() > deadline:  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_a_restarted_job_never_commits_a_tag_with_a_failed_attempts_part[its daemon lives on]",),
    ),
    Mutation(
        "node0-gathers-for-dead-ranks",
        "node 0 goes on gathering a tag after every rank of it that asked for the tag died (its restart is refused)",
        (Edit("daemon/gather.py", "            if not present():\n                raise CommitError(",
              "            if False:  # MUTATION\n                raise CommitError("),),
        ("tests/faults/test_restarted_job.py::test_random_restarts_commit_each_tag_whole_from_one_attempt",),
    ),
    Mutation(
        "start-leaves-a-dead-daemons-done-marker",
        "a daemon's start leaves the done markers a killed daemon of its node wrote",
        (Edit("protocol/storage/posix.py", "    if name.startswith(DONE_PREFIX):\n", "    if False:  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_a_restarted_job_never_commits_a_tag_with_a_failed_attempts_part[its daemon is killed and restarted]",),
    ),
    Mutation(
        "attempt-ignores-restart-count",
        "the job read from Slurm's variables leaves out the restart count",
        (Edit("client/ranks.py", '    return f"{job}#{restarts}" if restarts not in ("", "0") else job\n',
              "    return job  # MUTATION\n"),),
        ("tests/faults/test_restarted_job.py::test_each_attempt_of_a_slurm_job_is_a_job_of_its_own",),
    ),
    Mutation(
        "gather-opens-every-missing-marker",
        "node 0 opens each missing node's done marker at every look instead of listing the folder once",
        (Edit("daemon/gather.py",
              "            if len(missing) > FEW_MISSING:  # one listing rather than an open each\n",
              "            if False:  # MUTATION: an open per missing node\n"),),
        ("tests/test_many_nodes.py::test_a_late_node_costs_node_0_a_listing_a_look_not_an_open_per_missing_node",),
    ),
    Mutation(
        "node0-commits-after-a-node-gave-up",
        "node 0 publishes from the done markers it read, without checking they are all still there",
        (Edit("daemon/commit.py",
              "                                        wanted=functools.partial(still_reported, tag, folder, nodes))\n",
              "                                        )  # MUTATION: no check\n"),),
        ("tests/test_many_nodes.py::test_a_node_that_gave_up_waiting_is_never_committed_by_node_0_afterwards",),
    ),
    Mutation(
        "gather-looks-never-grow-apart",
        "node 0 looks for the done markers every 50 ms for as long as a node is late",
        (Edit("daemon/gather.py", "LOOK_GROWTH = 1.5\n", "LOOK_GROWTH = 1.0  # MUTATION\n"),),
        ("tests/test_many_nodes.py::test_a_late_node_costs_node_0_a_listing_a_look_not_an_open_per_missing_node",),
    ),
    Mutation(
        "staging-not-sealed",
        "a save admitted while a re-save's commit is in flight joins the staging folder being switched in",
        (Edit("daemon/resave.py",
              "                if any(within(p, staging.staging) for p in paths):\n"
              "                    self._sealed.append(self._open.pop(key))\n",
              "                if False:  # MUTATION: never sealed\n"
              "                    self._sealed.append(self._open.pop(key))\n"),),
        ("tests/faults/test_resave.py::test_a_save_while_a_new_version_is_being_committed_starts_a_version_of_its_own",),
    ),
    Mutation(
        "resumed-daemon-ignores-local",
        "a resumed daemon renames and commits for a client that went local",
        (Edit("protocol/outcome.py",
              "        return os.readlink(os.path.join(folder, LEFT)) == LOCAL\n",
              "        return False  # MUTATION: never seen\n"),),
        ("tests/faults/test_stall.py::test_a_daemon_stalled_before_its_rename_never_writes_over_a_trainer_that_went_local",),
    ),
    Mutation(
        "sequence-read-once",
        "a run's commit sequence is read from disk once and counted on from there",
        (Edit("daemon/run_order.py",
              "            on_disk = await self._engine.flush(next_sequence, run)\n"
              "            self._sequences[run] = max(self._sequences.get(run, 0) + 1, on_disk)\n",
              "            if run not in self._sequences:  # MUTATION: read once\n"
              "                self._sequences[run] = await self._engine.flush(next_sequence, run) - 1\n"
              "            self._sequences[run] += 1\n"),),
        ("tests/test_commit.py::test_a_commit_after_a_trainers_local_commits_in_the_same_run_is_the_latest",),
    ),
    Mutation(
        "chunk-released-in-flight",
        "a piece that fails halfway returns while device copies it queued can still land in its chunk",
        (Edit("daemon/copier.py",
              "    finally:\n        _wait_all(pending)\n",
              "    except BaseException:  # MUTATION: no wait on failure\n        raise\n"
              "    _wait_all(pending)\n"),),
        ("tests/faults/test_copier.py::test_copies_queued_before_a_failing_segment_have_landed_when_the_piece_fails",),
    ),
    Mutation(
        "unopened-slot-kept",
        "a GPU snapshot refused before its blocks were opened leaves their reference-counter slots at 1",
        (Edit("daemon/server.py",
              "                client.release_unopened(body.sources)\n                raise\n",
              "                raise  # MUTATION: slots kept\n"),),
        ("tests/test_cuda_handles.py::test_a_gpu_snapshot_the_daemon_never_opens_releases_each_slot_exactly_once",),
    ),
    Mutation(
        "served-replica-reused",
        "a replica handed to a restore is written over by a later one while the trainer maps it",
        (Edit("daemon/replica/table.py",
              "        match[0].served = True\n",
              "        match[0].served = False  # MUTATION: never marked\n"),),
        ("tests/test_restore.py::test_a_restored_tensor_never_changes_when_later_replicas_reuse_pages",),
    ),
    Mutation(
        "removed-replica-kept-mapped",
        "the writer keeps its mapping of a replica file after the file is removed, so its pages are never freed",
        (Edit("daemon/replica/backend.py",
              "            for key in [k for k, m in self._kept.items() if m.removed()]:\n",
              "            for key in []:  # MUTATION: never swept\n"),),
        ("tests/test_restore.py::test_a_restored_tensor_never_changes_when_later_replicas_reuse_pages",),
    ),
    Mutation(
        "failed-copy-frames-kept",
        "a failed snapshot's tracebacks keep views of its replica's pages, which stay mapped after the file is removed",
        (Edit("daemon/engine.py",
              "            traceback.clear_frames(exc.__traceback__)\n",
              "            pass  # MUTATION: frames kept\n"),),
        ("tests/faults/test_storage_faults.py::test_disk_full_fails_the_tag_and_keeps_the_last_one",),
    ),
    Mutation(
        "zip-headers-not-filled",
        "the copy threads leave the gaps before storages zeroed: torch.load finds no local header where the central directory points",
        (Edit("daemon/copier.py",
              "        for at, data in piece.fills:\n            chunk.view[at:at + len(data)] = data\n",
              "        pass  # MUTATION: no fills\n"),),
        ("tests/test_roundtrip.py::test_trainer_state_roundtrips_bitwise",),
    ),
    Mutation(
        "llm-step-unfenced",
        "DeepSpeed's datastates_ckpt path: the optimizer step neither waits for the daemon's copy nor commits",
        (Edit("integrations/datastates_llm.py",
              "            lambda _opt, _args, _kwargs: _fence(ref))",
              "            lambda _opt, _args, _kwargs: None)  # MUTATION: no fence, no commit at the step"),),
        ("tests/integrations/test_datastates_llm.py::test_the_optimizer_step_fences_and_commits",
         "tests/integrations/test_deepspeed.py::test_the_config_entry_alone_switches_a_job[1]"),
    ),
    Mutation(
        "lightning-fence-skipped",
        "Lightning: the closure-wrapping fence returns before waiting for the daemon's copy",
        (Edit("integrations/lightning.py",
              "            result = closure()\n            self.wait()\n",
              "            result = closure()  # MUTATION: no wait before the update\n"),),
        ("tests/integrations/test_lightning.py::test_the_fence_keeps_each_checkpoint_at_its_step",),
    ),
    Mutation(
        "data-pkl-trusted",
        "verify and datastates.load trust data.pkl's checksum in the index: no rebuild from the skeleton to compare",
        (Edit("client/reader/checks.py",
              "    if len(expected) != header.torch_pkl:\n",
              "    if False:  # MUTATION: data.pkl's size not compared\n"),
         Edit("client/reader/checks.py",
              "        if rec.name == PICKLE_RECORD and body != expected:\n",
              "        if False:  # MUTATION: data.pkl not compared\n"),),
        ("tests/faults/test_crafted_files.py::test_a_data_pkl_that_disagrees_with_the_index_is_refused[another offset]",),
    ),
    Mutation(
        "skeleton-protocol-unchecked",
        "the daemon admits a skeleton of pickle protocol 4 or 5, whose data.pkl torch.load cannot read",
        (Edit("protocol/torchzip.py",
              "            if pos == 0 and (op.name != \"PROTO\" or arg != PICKLE_PROTOCOL):\n",
              "            if False:  # MUTATION: any protocol\n"),
         Edit("protocol/torchzip.py",
              "            if op.name in _UNSPLICEABLE:\n",
              "            if False:  # MUTATION: frames and implicit memo slots spliced\n"),),
        ("tests/test_refusals.py::test_a_skeleton_of_pickle_protocol_4_or_5_is_refused_at_admission[4]",),
    ),
    Mutation(
        "view-elements-unbounded",
        "a tensor view of any element count is admitted and loaded (a stride-0 shape of 2^62 elements)",
        (Edit("protocol/tensormeta.py",
              "    if numel * itemsize > MAX_VIEW_BYTES:\n",
              "    if False:  # MUTATION: no bound on the element count\n"),),
        ("tests/test_refusals.py::test_a_view_of_more_elements_than_any_tensor_is_refused_at_admission",
         "tests/faults/test_crafted_files.py::test_a_crafted_tensor_entry_is_refused_naming_the_key_and_the_fault"
         "[2^62 elements, stride 0]"),
    ),
    Mutation(
        "watch-interval-unchecked",
        "datastatesctl status --watch takes any float for --interval: -1 or nan reach time.sleep as a traceback",
        (Edit("client/ctl/__init__.py",
              "    p_status.add_argument(\"--interval\", type=_interval,",
              "    p_status.add_argument(\"--interval\", type=float,  # MUTATION: unchecked\n"),),
        ("tests/test_cli.py::test_status_watch_refuses_bad_arguments_without_a_traceback[--interval -1]",),
    ),
    Mutation(
        "one-writer-check-apart-from-registration",
        "the one-writer-per-file check runs only on the admission thread, apart from the snapshot's registration: "
        "two clients saving one file at once both pass it",
        (Edit("daemon/server.py",
              "        self.ledger.check_owner(plan.path, client.id, body.tag,\n"
              "                                lambda other: self.clients.alive(other, self.cfg.client_timeout))\n",
              "        pass  # MUTATION: no check beside the registration\n"),),
        ("tests/faults/test_resave.py::"
         "test_two_clients_that_snapshot_one_file_at_the_same_instant_are_never_both_told_it_committed",),
    ),
    Mutation(
        "two-clients-save-one-tag-at-once",
        "a client's snapshot of a tag another client is saving in the same folder is admitted when it is a file of "
        "its own: two DCP saves of one checkpoint_id each refuse a file of the other's, and neither commits",
        (Edit("daemon/commit.py", "held != tag or not any(s.folder == folder for s in admitted):",
              "held != tag or True:  # MUTATION"),),
        ("tests/faults/test_dcp_resave.py::test_two_clients_saving_one_checkpoint_at_once_commit_one_of_them_whole",),
    ),
    Mutation(
        "derived-names-past-path-max",
        "a path whose tag marker, staging copy or temporary names pass PATH_MAX is admitted: its tag commits unseen",
        (Edit("protocol/paths.py",
              "    if longest >= PATH_MAX:\n",
              "    if False:  # MUTATION: never refused\n"),),
        ("tests/faults/test_limits.py::"
         "test_a_path_whose_marker_would_pass_path_max_is_refused_at_snapshot_and_the_longest_one_commits",),
    ),
    Mutation(
        "tier-copies-unchecked",
        "a path is checked against PATH_MAX only where it lands, not where its copy goes on a slower tier",
        (Edit("protocol/paths.py",
              "[(t.place(path, tiers[home]), f\" on tier {t.name!r}\") for t in tiers[home + 1:]])",
              "[])  # MUTATION: no tier's copy checked"),),
        ("tests/faults/test_limits.py::test_a_path_whose_copy_on_a_slower_tier_would_pass_path_max_is_refused_at_snapshot",),
    ),
    Mutation(
        "spoken-connection-kept",
        "a connection that sent any message is kept for good, HELLO or not: one-byte messages pile up until EMFILE",
        (Edit("daemon/connections.py",
              "        if introduced:\n            self._introduced[inode] = fd\n",
              "        if True:  # MUTATION: spoke, so kept\n            self._introduced[inode] = fd\n"),),
        ("tests/faults/test_connections.py::"
         "test_connections_that_send_one_byte_and_never_say_hello_are_shed_under_a_hard_limit_of_256",),
    ),
    Mutation(
        "answered-connection-not-spared",
        "a connection not introduced is shed, the oldest, as soon as its request is answered, before ZeroMQ has "
        "written the reply: amid a flood a status tool waits for an answer that never comes",
        (Edit("daemon/connections.py",
              "if now - self._pending[fd].replied < REPLY_GRACE_S),",
              "if False),"),),
        ("tests/faults/test_connections.py::test_two_thousand_silent_connections_cost_bounded_descriptors",),
    ),
    Mutation(
        "every-answered-connection-shed-last",
        "every connection answered in the last 2 s is shed after the others: connections that keep asking without "
        "HELLO rank a new trainer first, and it is shut before its HELLO",
        (Edit("daemon/connections.py", "                              self.max_replying))",
              "                              len(idle)))"),),
        ("tests/faults/test_connections.py::"
         "test_connections_that_keep_asking_without_hello_do_not_push_a_new_trainer_out",),
    ),
    Mutation(
        "unintroduced-bound-ignores-limit",
        "the daemon keeps 256 unintroduced connections whatever its open-files limit: under 256 ZeroMQ meets it",
        (Edit("daemon/connections.py",
              "    return min(MAX_UNINTRODUCED, limit // 4), limit - max(64, limit // 4)\n",
              "    return MAX_UNINTRODUCED, limit  # MUTATION: fixed bound, no shedding near the limit\n"),),
        ("tests/faults/test_connections.py::"
         "test_connections_that_send_one_byte_and_never_say_hello_are_shed_under_a_hard_limit_of_256",),
    ),
    Mutation(
        "replica-identity-unchecked",
        "a restore from memory takes any committed replica of the tag and file, not the snapshot its marker lists",
        (Edit("daemon/replica/table.py",
              "r.tag == tag and r.snapshot == snapshot and r.committed",
              "r.tag == tag and r.committed  # MUTATION: identity unchecked"),
         Edit("daemon/replica/table.py", "        if not snapshot or not match:\n", "        if not match:\n")),
        ("tests/test_restore.py::test_a_tag_saved_again_without_the_daemon_never_restores_the_daemons_older_replica",),
    ),
    Mutation(
        "replica-own-tag-kept",
        "a commit retires the replicas of other tags only: a re-saved tag's old versions pile up in the budget",
        (Edit("daemon/replica/table.py",
              "            for old in [r for r in self._held.values() if r.rank_file == rank_file(path)\n",
              "            for old in [r for r in self._held.values() if r.rank_file == rank_file(path) and r.tag != commit.tag  # MUTATION\n"),),
        ("tests/test_restore.py::test_a_re_saved_tag_restores_its_committed_version_and_keeps_no_older_replica[8MiB]",),
    ),
    Mutation(
        "replica-budget-never-freed",
        "a new file's replica finds no room while finished runs' replicas and spares fill the budget",
        (Edit("daemon/replica/table.py", "        self._release_stale(size)\n", "        pass  # MUTATION: nothing released\n"),),
        ("tests/test_replica_budget.py::test_a_finished_runs_replicas_make_room_for_the_next_runs_files",),
    ),
    Mutation(
        "replica-budget-replicas-before-spares",
        "room is made from a gone job's replicas before its spares, so its restart reads storage",
        (Edit("daemon/replica/table.py",
              "        for key in sorted((k for k in self._spares if self._stale(k)), key=self._last_use):\n",
              "        for key in []:  # MUTATION: spares kept\n"),),
        ("tests/test_replica_budget.py::test_a_restarted_job_finds_its_newest_replicas_after_another_run_took_room",),
    ),
    Mutation(
        "replica-budget-most-recent-first",
        "room is made from the most recently saved rank files first: a just-ended job's newest replicas go",
        (Edit("daemon/replica/table.py",
              "key=lambda r: self._last_use(r.rank_file)):\n",
              "key=lambda r: -self._last_use(r.rank_file)):  # MUTATION: newest first\n"),),
        ("tests/test_replica_budget.py::test_a_restarted_job_finds_its_newest_replicas_after_another_run_took_room",),
    ),
    Mutation(
        "replica-budget-reader-ignored",
        "a replica a connected client's restore is reading is released for another file's room",
        (Edit("daemon/replica/table.py",
              "                               and not any(self._alive(c) for c in r.readers)\n",
              "                               # MUTATION: readers ignored\n"),),
        ("tests/test_replica_budget.py::test_a_replica_being_read_by_a_restore_is_never_released",),
    ),
    Mutation(
        "replica-budget-live-job-released",
        "a live job's newest replicas are released for another rank's file as soon as it saves",
        (Edit("daemon/replica/table.py",
              "        return self._rounds.get(use.saver, (\"\", 0))[1] >= use.round + use.every + 1\n",
              "        return True  # MUTATION: saved or not\n"),),
        ("tests/test_restore.py::test_ranks_agree_on_the_tag_when_only_one_fits_in_memory",),
    ),
    Mutation(
        "replica-budget-every-tag-expected",
        "a rank file its live client saves once every few tags (run folders saved in turn, a tag each) counts as no "
        "longer saved two tags after its save: its spare and replica are released for another file, every round",
        (Edit("daemon/replica/table.py",
              "            every = before.every if now == before.round else now - before.round\n",
              "            every = 1  # MUTATION\n"),),
        ("tests/test_replica_budget.py::test_a_client_saving_run_folders_in_turn_keeps_their_replicas",),
    ),
    Mutation(
        "refused-rank-waits",
        "a rank's refused snapshot fails its own commit only: the other ranks wait for it until commit_timeout",
        (Edit("daemon/commit.py",
              "        _remember(self._refused, (client_id, tag), reason)\n        self._rounds.fail(ranks, tag, reason)\n",
              "        _remember(self._refused, (client_id, tag), reason)  # MUTATION: the round waits\n"),),
        ("tests/test_multirank.py::test_a_refused_rank_fails_every_ranks_commit_at_once[True]",),
    ),
    Mutation(
        "llm-load-reads-staged-early",
        "DataStates-LLM load: a new version still in its tag's staging folder, written but not committed, is not "
        "waited for, so the old version is read",
        (Edit("integrations/datastates_llm.py",
              'snapshot["state"] == "durable" and (',
              'False and (  # MUTATION: a durable staged version is not waited for\n        '),),
        ("tests/integrations/test_datastates_llm.py::test_load_waits_for_a_file_another_rank_is_still_writing[True]",),
    ),
    Mutation(
        "client-stays-lost",
        "after a daemon was lost (stalled past liveness), the client never connects again: every later call fails",
        (Edit("client/client.py",
              "            if self.fallback is None and (self._inflight.left or self._conn.lost):\n                self._reconnect()\n",
              "            pass  # MUTATION: no reconnect\n"),),
        ("tests/faults/test_stall.py::test_after_a_stall_the_client_connects_again_as_a_new_client",
         "tests/integrations/test_deepspeed.py::test_a_job_goes_on_checkpointing_after_its_daemon_stalled_past_liveness"),
    ),
    Mutation(
        "llm-step-raises-lost",
        "DeepSpeed's datastates_ckpt path: a daemon lost at the optimizer step's fence is raised out of the step",
        (Edit("integrations/datastates_llm.py",
              "        except DaemonUnavailable as exc:\n            self._lose(opened, exc)\n",
              "        except DaemonUnavailable:\n            raise  # MUTATION: the step fails\n"),),
        ("tests/integrations/test_deepspeed.py::test_a_job_goes_on_checkpointing_after_its_daemon_stalled_past_liveness",),
    ),
    Mutation(
        "restore-races-prune",
        "a restore whose tag another job's prune deleted between its choice and its read is not retried: a raw "
        "FileNotFoundError",
        (Edit("client/locate.py",
              "        except FileNotFoundError as exc:\n",
              "        except NotADirectoryError as exc:  # MUTATION: a deleted tag is not looked for again\n"),),
        ("tests/integrations/test_manager.py::test_restore_racing_another_jobs_prune_restores_the_newest_committed_tag",
         "tests/test_restore.py::test_a_restore_racing_another_jobs_prune_reads_the_newest_committed_tag"),
    ),
    Mutation(
        "served-poller-shut-for-age",
        "a connection that polls STATUS without HELLO is shut for its age between two polls: a request on its way is lost",
        (Edit("daemon/connections.py",
              " and not e.busy and not e.served]:\n",
              " and not e.busy]:  # MUTATION: served or not\n"),),
        ("tests/faults/test_connections.py::test_a_tool_that_polls_status_without_hello_is_never_shut_for_its_age",),
    ),
    Mutation(
        "markers-above-the-root-trusted",
        "file_commits() climbs past folders others may write and reads every marker there, /tmp above /tmp/ckpt included",
        (Edit("protocol/storage/posix.py", "if roots is not None else untrusted_folder(folder)",
              "if roots is not None else \"\"  # MUTATION: no trust check of the folders climbed"),
         Edit("protocol/storage/posix.py",
              "marker = trusted_marker(marker_path, whole=False) if roots is None else CommitMarker.read(marker_path)",
              "marker = CommitMarker.read(marker_path)  # MUTATION: any marker")),
        ("tests/faults/test_hostile_user.py::test_a_marker_planted_above_the_root_changes_nothing[marker]",),
    ),
    Mutation(
        "tag-deleted-in-place",
        "retention deletes a tag's folder where it is, without renaming it to its deleting name first",
        (Edit("protocol/retention.py",
              "            os.rename(tag.tag, os.path.basename(doomed), src_dir_fd=parent, dst_dir_fd=parent)\n",
              "            doomed = tag.folder  # MUTATION: deleted in place\n"),),
        ("tests/faults/test_kill_prune.py::test_a_killed_prune_leaves_nothing_half_deleted[prune]",),
    ),
    Mutation(
        "killed-delete-never-finished",
        "neither prune nor the daemon start finishes what a killed delete left",
        (Edit("protocol/retention.py", "    if not DELETING_RE.fullmatch(os.path.basename(folder)):\n",
              "    if True:  # MUTATION: nothing is finished\n"),),
        ("tests/faults/test_kill_prune.py::test_a_killed_prune_leaves_nothing_half_deleted[prune]",
         "tests/faults/test_kill_prune.py::test_a_killed_prune_leaves_nothing_half_deleted[daemon start]"),
    ),
    Mutation(
        "anyones-deleting-folder-finished",
        "prune deletes any folder named like a killed delete's leftover, another user's too",
        (Edit("protocol/retention.py",
              "    why = untrusted_folder(folder) or untrusted_folder(os.path.dirname(folder))\n",
              "    why = \"\"  # MUTATION: no ownership check\n"),),
        ("tests/faults/test_hostile_user.py::test_prune_leaves_another_users_folder_named_as_being_deleted",),
    ),
    Mutation(
        "lost-tag-untold",
        "a client that connects again says nothing of a tag it saved (copied, so nothing was abandoned) and never "
        "committed: the trainer goes on as if it were safe",
        (Edit("client/inflight.py",
              "            if abandoned or untold:",
              "            if abandoned:  # MUTATION: a copied, uncommitted tag is lost silently\n               "),),
        ("tests/faults/test_kill_daemon.py::test_a_tag_part_of_which_went_with_a_restarted_daemon_is_never_committed_with_the_rest_alone[part-saved-again]",),
    ),
    Mutation(
        "lost-part-committed",
        "after a reconnect, a commit of a tag part of which went with the lost daemon commits the files saved since "
        "alone: its marker lists some of its files",
        (Edit("client/inflight.py",
              "save it again whole\") if missing else \"\"",
              "save it again whole\") if False else \"\"  # MUTATION"),),
        ("tests/faults/test_kill_daemon.py::test_a_tag_part_of_which_went_with_a_restarted_daemon_is_never_committed_with_the_rest_alone[part-saved-again]",),
    ),
    Mutation(
        "lost-tag-never-whole",
        "a tag part of which was lost stays lost even once every file of it is saved again: its commit fails",
        (Edit("client/inflight.py",
              "                self.lost[tag].discard(path)\n",
              "                pass  # MUTATION: a save again never makes it whole\n"),),
        ("tests/faults/test_kill_daemon.py::test_a_tag_part_of_which_went_with_a_restarted_daemon_is_never_committed_with_the_rest_alone[all-saved-again]",),
    ),
    Mutation(
        "llm-saves-rest-of-lost-checkpoint",
        "DataStates-LLM engine: after a loss met at a save, the rest of that checkpoint is still saved and committed",
        (Edit("integrations/datastates_llm.py",
              "        if lost is not None and path not in lost:  #",
              "        if False:  # MUTATION #"),),
        ("tests/faults/test_kill_daemon.py::test_the_datastates_llm_engine_never_commits_a_checkpoint_part_of_which_went_with_a_restarted_daemon",),
    ),
    Mutation(
        "llm-load-waits-failed-commit",
        "DataStates-LLM load: a new version whose commit failed (kept for a retry) is waited for like one whose "
        "commit is under way: load never returns",
        (Edit("integrations/datastates_llm.py",
              'snapshot["commit"] == "committing" or',
              'snapshot["commit"] in ("committing", "failed") or  # MUTATION\n       '),),
        ("tests/integrations/test_datastates_llm.py::test_load_returns_the_committed_version_while_a_resave_whose_commit_failed_waits_for_a_retry",),
    ),
    Mutation(
        "llm-load-unbounded",
        "DataStates-LLM load waits for ever for a new version whose commit never comes",
        (Edit("integrations/datastates_llm.py",
              "            if time.monotonic() > deadline:\n",
              "            if False:  # MUTATION: no bound\n"),),
        ("tests/integrations/test_datastates_llm.py::test_load_gives_up_on_a_new_version_whose_commit_never_comes_naming_it",),
    ),
    Mutation(
        "llm-lost-tag-skipped-for-good",
        "DataStates-LLM engine: a tag lost with the daemon is skipped until another tag is saved, so a fixed folder "
        "(the same tag every checkpoint) is never saved again",
        (Edit("integrations/datastates_llm.py",
              "        if lost is not None and path not in lost:",
              "        if lost is not None:  # MUTATION: skipped until another tag"),),
        ("tests/faults/test_kill_daemon.py::"
         "test_a_fixed_folder_saved_again_after_its_checkpoint_went_with_a_restarted_daemon_commits_again",),
    ),
    Mutation(
        "replica-retires-its-sibling",
        "a commit retires the replica of another file it lists that shares its rank file (step/model/rank0.pt, "
        "step/optim/rank0.pt): that file restores from storage",
        (Edit("daemon/replica/table.py",
              "                        and commit.snapshots.get(r.path) != r.snapshot and r.job_id < newest\n",
              "                        and r.job_id < newest  # MUTATION: a file of this same commit retires too\n"),),
        ("tests/test_restore.py::test_files_of_one_tag_in_sibling_folders_with_one_name_all_restore_from_memory",),
    ),
    Mutation(
        "round-outlives-its-timeout",
        "a multi-rank round that timed out stays open: a later round's commit joins it, and its marker lists two steps",
        (Edit("daemon/rounds.py",
              "                group.fail(exc)  # the round ends here: a later commit never joins it\n",
              "                raise exc from None  # MUTATION: the timed-out round stays open\n"),),
        ("tests/test_multirank.py::test_a_round_that_timed_out_is_never_joined_by_a_later_commit",),
    ),
    Mutation(
        "refused-commit-spares-the-round",
        "a rank's commit that fails on its refused snapshot leaves the round another rank waits in open, until "
        "commit_timeout",
        (Edit("daemon/rounds.py",
              "        if group is not None and ranks.rank not in group.committed:\n            group.fail(CommitError(",
              "        if group is not None and group.failed and ranks.rank not in group.committed:  # MUTATION\n"
              "            group.fail(CommitError("),),
        ("tests/test_multirank.py::test_a_refused_ranks_later_commit_fails_the_round_another_rank_waits_in",),
    ),
    Mutation(
        "round-joined-across-a-failure",
        "a rank with snapshots, not yet told of the node's failed round, starts a round of its own instead of being "
        "handed that failure: another rank's next step joins it, and both are told committed for a marker of two steps",
        (Edit("daemon/rounds.py",
              "if group is not None and group.failed and ranks.rank in group.committed:",
              "if group is not None and group.failed and (ranks.rank in group.committed or admitted):  # MUTATION"),),
        ("tests/test_multirank.py::test_a_rank_whose_snapshot_came_after_its_rounds_failure_is_handed_it",),
    ),
    Mutation(
        "failed-round-keeps-its-version",
        "a rank told its round failed keeps its snapshots' staged new version: it leaks",
        (Edit("daemon/rounds.py",
              "        await self._drop(admitted, set())  # the round failed before its commit",
              "        pass  # MUTATION: await self._drop(admitted, set())  # the round failed before its commit"),),
        ("tests/test_multirank.py::test_a_rank_told_its_round_failed_leaves_no_new_version_behind",),
    ),
    Mutation(
        "llm-fence-loss-forgets-paths",
        "DataStates-LLM engine: a loss met at the fence records the lost checkpoint without its paths, so the next "
        "checkpoint of a fixed folder is skipped whole, silently",
        (Edit("integrations/datastates_llm.py",
              "            self._lose(opened, exc)\n",
              "            self._lose({tag: set() for tag in opened}, exc)  # MUTATION: the paths forgotten\n"),),
        ("tests/faults/test_kill_daemon.py::"
         "test_a_fixed_folder_saved_again_after_its_checkpoint_went_with_a_restarted_daemon_commits_again[fence]",),
    ),
    Mutation(
        "guards-trust-filtered",
        "the daemon's guards (a save over a committed file, keeping a file a marker lists) skip the markers of "
        "folders a reader may not trust: a group-writable run folder's committed file is saved over",
        (Edit("daemon/resave.py", "file_commits(path, roots=roots)", "file_commits(path, roots=None)"),),
        ("tests/faults/test_shared_run_folder.py::test_a_group_writable_run_folder_keeps_the_save_guard",),
    ),
    Mutation(
        "strangers-folder-pruned",
        "retention deletes a tag folder whole though it holds another (newer) tag's marker, which goes with it",
        (Edit("protocol/retention.py", "        if others:\n", "        if False:  # MUTATION: other markers ignored\n"),),
        ("tests/faults/test_shared_run_folder.py::test_keep_last_never_deletes_a_folder_holding_a_newer_tags_marker",
         "tests/faults/test_shared_run_folder.py::test_prune_never_deletes_a_folder_holding_a_newer_tags_marker"),
    ),
    Mutation(
        "recommitted-tag-pruned",
        "retention deletes a tag from a stale listing though a new version of it was committed since",
        (Edit("protocol/retention.py", "    if now != tag.marker:\n", "    if now is None:  # MUTATION: any marker will do\n"),),
        ("tests/faults/test_shared_run_folder.py::test_a_tag_committed_again_after_the_listing_is_not_deleted",),
    ),
    Mutation(
        "deleting-folders-parent-trusted",
        "prune finishes a folder named as being deleted in a folder others may write, where one renamed this "
        "user's committed tag so",
        (Edit("protocol/retention.py",
              "    why = untrusted_folder(folder) or untrusted_folder(os.path.dirname(folder))\n",
              "    why = untrusted_folder(folder)  # MUTATION: its parent unchecked\n"),),
        ("tests/faults/test_hostile_user.py::"
         "test_prune_leaves_this_users_folder_another_user_renamed_as_being_deleted",),
    ),
    Mutation(
        "tag-prefix-matched",
        "a tag is checked for a valid prefix only: \"step1\\n\" names a marker file with a newline in it",
        (Edit("protocol/format.py", "_TAG_RE.fullmatch(tag)", "_TAG_RE.match(tag)"),),
        ("tests/test_refusals.py::test_a_tag_ending_in_a_newline_is_refused",),
    ),
    Mutation(
        "drop-under-a-file-crashes",
        "a snapshot that failed because its folder is a file crashes the drop of its files (an internal error) "
        "instead of finding none there",
        (Edit("daemon/commit.py", "    except (FileNotFoundError, NotADirectoryError):",
              "    except FileNotFoundError:  # MUTATION"),),
        ("tests/test_multirank.py::test_a_rank_whose_snapshot_came_after_its_rounds_failure_is_handed_it",),
    ),
    Mutation(
        "older-marker-of-pruned-tag-left",
        "a prune deletes a tag's folder but leaves its older marker in another tag's folder: the tag stands again "
        "with an older step",
        (Edit("protocol/retention.py", "        for older in older_versions(tag):",
              "        for older in older_versions(tag)[:0]:  # MUTATION"),),
        ("tests/test_retention.py::test_prune_of_a_tag_withdraws_its_older_marker_in_another_tags_folder",),
    ),
    Mutation(
        "tracker-named-tag-pruned",
        "a prune deletes the tag the latest tracker names, leaving the tracker naming nothing",
        (Edit("protocol/retention.py", "    if tag.own_folder and tracker_names(tag.run, tag.tag):",
              "    if False:  # MUTATION"),),
        ("tests/test_retention.py::test_prune_keeps_the_tag_the_tracker_names",),
    ),
    Mutation(
        "local-commit-leaves-tracker",
        "a trainer's local commit (fallback='local') leaves the tracker naming an older tag",
        (Edit("client/local_save.py", "        self._track(tag, folder if staging is None else staging.folder)\n", ""),),
        ("tests/test_retention.py::test_a_local_commit_moves_the_tracker_on",),
    ),
    Mutation(
        "commit-checks-size-only",
        "a commit checks its files' sizes only: a same-size file another writer put there is committed",
        (Edit("daemon/commit.py", "    why = unlisted(folder, marker, folder_fd, identity=True)\n",
              "    why = unlisted(folder, marker, folder_fd)  # MUTATION\n"),),
        ("tests/faults/test_identity.py::test_a_file_replaced_by_another_writer_before_the_marker_fails_the_commit",),
    ),
    Mutation(
        "writer-renames-over-committed",
        "a finished file is renamed over whatever is at its path, a committed file too",
        (Edit("protocol/storage/posix.py", "    return any(entry.holds(held, size) for",
              "    return False and any(entry.holds(held, size) for"),),
        ("tests/faults/test_identity.py::test_a_writer_never_renames_its_file_over_a_committed_one",),
    ),
    Mutation(
        "deleting-folder-renamed-back",
        "a prune renames a tag's folder back from its deleting name though another prune deleted its marker "
        "meanwhile: an uncommitted folder no prune deletes is left (or the rename fails and the prune stops)",
        (Edit("protocol/retention.py",
              "                if CommitMarker.read(os.path.join(doomed, marker_name(tag.tag))) is not None:\n",
              "                if True:  # MUTATION: renamed back whatever it holds\n"),),
        ("tests/faults/test_shared_run_folder.py::"
         "test_a_prune_never_renames_back_a_folder_another_prune_is_deleting[mid-delete]",
         "tests/faults/test_shared_run_folder.py::"
         "test_a_prune_never_renames_back_a_folder_another_prune_is_deleting[done]"),
    ),
    Mutation(
        "buffered-descriptor-leaked",
        "the daemon never closes a file's second descriptor, opened for its unaligned writes: one more per save",
        (Edit("protocol/storage/posix.py",
              "        for fd in (self.fd, self.buffered_fd):\n",
              "        for fd in (self.fd,):  # MUTATION: the buffered descriptor stays open\n"),),
        ("tests/test_soak.py::test_soak_leaves_counts_flat_and_memory_bounded",),
    ),
    Mutation(
        "integration-restore-fresh",
        "the integrations' loads ignore the model they were given: every file is read fresh and the framework's "
        "load_state_dict copies it in, silently",
        (Edit("integrations/loading.py", "    if model is not None:\n", "    if False:  # MUTATION: model ignored\n"),),
        ("tests/integrations/test_deepspeed.py::test_deepspeed_save_and_load_checkpoint[in-place]",
         "tests/integrations/test_lightning.py::test_resume_from_last_is_bitwise",
         "tests/integrations/test_transformers.py::test_resume_takes_the_newest_committed_checkpoint_bitwise"),
    ),
    Mutation(
        "deepspeed-engine-not-unwrapped",
        "DatastatesCheckpointEngine(model=engine) reads into the DeepSpeed engine's state dict, whose keys "
        "('module.0.weight') never fit the file's module: every resume falls back to a fresh load",
        (Edit("integrations/deepspeed.py", "self.module = model.module if isinstance(model, DeepSpeedEngine) else model",
              "self.module = model  # MUTATION: the engine not unwrapped"),),
        ("tests/integrations/test_deepspeed.py::test_deepspeed_save_and_load_checkpoint[in-place]",),
    ),
    Mutation(
        "hf-weights-left-to-trainer",
        "DatastatesTrainer leaves the weights of a resume to Trainer's torch.load and load_state_dict copy",
        (Edit("integrations/transformers.py",
              "        if not self._load_weights(resume_from_checkpoint, self.model if model is None else model):\n",
              "        if True:  # MUTATION: Trainer's own load\n"),),
        ("tests/integrations/test_transformers.py::test_resume_takes_the_newest_committed_checkpoint_bitwise",),
    ),
    Mutation(
        "misfit-raises",
        "a file without the model's key, or whose model part does not fit the module, raises StateMismatchError "
        "instead of loading fresh as before (DeepSpeed's optimizer files, Lightning's strict_loading=False)",
        (Edit("integrations/loading.py", "            log.warning(\"%s: read fresh, not into the model's own tensors: %s\", path, exc.message)\n"
              "        return None\n",
              "            log.warning(\"%s: read fresh, not into the model's own tensors: %s\", path, exc.message)\n"
              "        raise  # MUTATION\n"),),
        ("tests/integrations/test_deepspeed.py::test_with_the_model_its_module_is_read_into_the_modules_own_tensors",
         "tests/integrations/test_lightning.py::test_with_a_module_only_a_state_dict_that_fits_it_is_read_into_it"),
    ),
    Mutation(
        "misfit-unsaid",
        "a model part that does not fit the module is read fresh without a word: a resume slower than it should be, "
        "with no sign why",
        (Edit("integrations/loading.py", "            log.warning(", "            log.debug(  # MUTATION\n"),),
        ("tests/integrations/test_deepspeed.py::test_with_the_model_its_module_is_read_into_the_modules_own_tensors",
         "tests/integrations/test_lightning.py::test_with_a_module_only_a_state_dict_that_fits_it_is_read_into_it"),
    ),
    Mutation(
        "hf-verify-skips-foreign-weights",
        "resume skips verifying the weights DatastatesTrainer reads itself even when they no longer look like a "
        "datastates file, which Trainer then reads with torch.load, unchecked",
        (Edit("integrations/transformers.py", "if rec.path not in READ_HERE or not is_datastates_file(path):",
              "if rec.path not in READ_HERE:  # MUTATION"),),
        ("tests/integrations/test_transformers.py::test_resume_refuses_a_committed_checkpoint_whose_bytes_changed[index]",),
    ),
    Mutation(
        "into-shape-unchecked",
        "load(into=) plans with dtypes only: a tensor of another shape is found after the stream wrote into, as a "
        "RuntimeError",
        (Edit("client/reader/restore.py", "            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:\n",
              "            if theirs.dtype != ours.dtype:  # MUTATION: shape unchecked\n"),),
        ("tests/test_load_into.py::test_a_misfit_raises_naming_the_key_and_writes_nothing[shape]",),
    ),
    Mutation(
        "into-tensor-over-a-value",
        "load(into=) takes a tensor of into where the checkpoint holds a plain value: into keeps its tensor, silently",
        (Edit("client/reader/restore.py", "        if isinstance(theirs, torch.Tensor):\n            raise self.misfit(",
              "        if False:  # MUTATION\n            raise self.misfit("),),
        ("tests/test_load_into.py::test_a_misfit_raises_naming_the_key_and_writes_nothing[tensor-in-into-not-in-file]",),
    ),
    Mutation(
        "into-lacking-key-unchecked",
        "load(into=) does not check for keys into has and the checkpoint lacks (a KeyError, after nothing useful)",
        (Edit("client/reader/restore.py", "            if lacking:\n", "            if False:  # MUTATION\n"),),
        ("tests/test_load_into.py::test_a_misfit_raises_naming_the_key_and_writes_nothing[into-has-a-key-the-file-lacks]",
         "tests/test_load_into.py::test_strict_false_still_refuses_a_key_the_file_lacks"),
    ),
    Mutation(
        "into-extra-key-added-when-strict",
        "load(into=, strict=True) adds the checkpoint's keys into lacks instead of refusing them",
        (Edit("client/reader/restore.py", "            extra = [k for k in ours if k not in theirs and not self.new_key(path + (k,))]\n",
              "            extra = []  # MUTATION\n"),),
        ("tests/test_load_into.py::test_a_misfit_raises_naming_the_key_and_writes_nothing[file-has-a-key-into-lacks]",),
    ),
    Mutation(
        "into-expanded-accepted",
        "load(into=) plans an expanded tensor of into as fitting: the rebuild fails after the stream wrote into, and "
        "calls the sound file corrupt",
        (Edit("client/reader/restore.py", "    if any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride())):\n",
              "    if False:  # MUTATION\n"),),
        ("tests/test_load_into.py::test_an_into_tensor_that_overlaps_itself_is_a_misfit_not_a_corrupt_file",),
    ),
    Mutation(
        "into-checksums-unchecked",
        "a load hashes each piece but never compares the hash with the file's checksum: corrupt bytes load",
        (Edit("client/reader/stream.py", "            if h.digest() != want:", "            if False:  # MUTATION"),),
        ("tests/test_load_into.py::test_a_flipped_byte_in_a_tensor_raises",),
    ),
    Mutation(
        "into-zip-headers-unchecked",
        "load(into=) does not check the zip local headers inside the data region (torch.load would misread the file)",
        (Edit("client/reader/stream.py", "            check_local_headers(self.path, piece.headers, data, at)\n", ""),),
        ("tests/test_load_into.py::test_a_damaged_zip_local_header_in_the_data_region_raises",),
    ),
    Mutation(
        "into-strides-ignored",
        "load(into=) copies a storage's bytes straight into a non-contiguous tensor of into, in memory order",
        (Edit("client/reader/restore.py", "    return target if target.is_contiguous() else None\n", "    return target  # MUTATION\n"),),
        ("tests/test_load_into.py::test_strided_tensors_in_the_file_and_in_into",),
    ),
    Mutation(
        "into-second-tensor-of-an-entry-unfilled",
        "load(into=): one tensor of the file under two keys of into fills only the first of into's tensors",
        (Edit("client/reader/restore.py", "            if target.direct and not _same_memory(t, first):\n",
              "            if False:  # MUTATION\n"),),
        ("tests/test_load_into.py::test_one_tensor_under_two_keys_into_two_tensors",),
    ),
    Mutation(
        "into-straddling-storage-first-piece-only",
        "load(into=) copies a storage that straddles read pieces from its first piece only",
        (Edit("client/reader/stream.py",
              "            for piece in self.pieces[first // size:(last - 1) // size + 1] if target and last > first else ():\n",
              "            for piece in self.pieces[first // size:first // size + 1] if target and last > first else ():  # MUTATION\n"),),
        ("tests/test_load_into.py::test_a_state_over_many_read_pieces[memory]", "tests/test_load_into.py::test_a_state_over_many_read_pieces[storage]",
         "tests/test_load_into.py::test_a_state_over_the_default_read_piece"),
    ),
    Mutation(
        "into-with-autograd",
        "load(into=) fills into's tensors with autograd on: a parameter that requires grad cannot be written in place",
        (Edit("client/reader/restore.py", "    with torch.no_grad():\n        for storage, entries in users.items():\n",
              "    with contextlib.nullcontext():  # MUTATION\n        for storage, entries in users.items():\n"),),
        ("tests/test_load_into.py::test_parameters_that_require_grad_are_filled[memory]",),
    ),
    Mutation(
        "into-shared-memory-unchecked",
        "load(into=) lets two tensors of into share memory the file's tensors keep apart (a tied model, an untied file)",
        (Edit("client/reader/restore.py", "    match.check_shared()\n", ""),),
        ("tests/test_load_into.py::test_into_tensors_sharing_memory_the_file_keeps_apart_are_a_misfit[tied]",
         "tests/test_load_into.py::test_into_tensors_sharing_memory_the_file_keeps_apart_are_a_misfit[overlapping]"),
    ),
    Mutation(
        "into-shared-memory-strides-of-the-file",
        "load(into=)'s check of shared memory wants into's strides to be the file's, refusing a sound tie",
        (Edit("client/reader/restore.py", "        return True\n    return a.stride() == b.stride()", "        return True\n    return False and a.stride() == b.stride()"),),
        ("tests/test_load_into.py::test_into_tied_as_the_file_is_but_with_other_strides",),
    ),
    Mutation(
        "place-exchanges-before-looking",
        "a writer's rename exchanges whatever is at its path (a directory included) and only then looks at it, as it "
        "did: a failed look's abort leaves the exchanged folder under the temporary name",
        (Edit("protocol/storage/posix.py", "    if not stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):\n",
              "    if False:  # MUTATION\n"),
         Edit("protocol/storage/posix.py", "    if _committed(folder, name, path):\n        raise refused\n", ""),
         Edit("protocol/storage/posix.py", "    except BaseException:  # not a file it can read (a directory made there meanwhile): put back where it was\n        rename_within(folder, temp, name, RENAME_EXCHANGE)\n        raise\n",
              "    except BaseException:  # MUTATION\n        raise\n")),
        ("tests/faults/test_identity.py::test_a_writer_never_moves_a_committed_tag_folder_made_at_its_path_meanwhile",),
    ),
    Mutation(
        "into-overlapping-rows-unchecked",
        "load(into=) takes a tensor of into whose rows overlap (as_strided, no stride of 0)",
        (Edit("client/reader/restore.py", "    if _overlaps_itself(t):\n", "    if False:  # MUTATION\n"),),
        ("tests/test_load_into.py::test_an_into_tensor_whose_rows_overlap_is_a_misfit",),
    ),
    Mutation(
        "commit-identity-skips-non-checkpoints",
        "a commit takes a listed file that holds no snapshot (not a checkpoint) of the listed size as the one committed",
        (Edit("protocol/tags.py", "        if held is not None and not rec.holds(held):\n", "        if held and not rec.holds(held):  # MUTATION\n"),),
        ("tests/faults/test_identity.py::test_a_file_replaced_by_same_size_bytes_that_are_no_checkpoint_fails_the_commit",),
    ),
    Mutation(
        "client-folder-gone-not-left",
        "a client whose decision folder is gone (its HELLO failed after the daemon welcomed it) is not taken as left: "
        "the daemon holds it while its pid lives",
        (Edit("protocol/outcome.py", " or not os.path.lexists(folder)\n", "  # MUTATION\n"),),
        ("tests/faults/test_stall.py::test_a_client_welcomed_after_it_stopped_waiting_is_let_go",),
    ),
    Mutation(
        "replica-not-locked",
        "a committed replica's pages are not locked: a global drop of caches leaves its restores one fault per page",
        (Edit("daemon/replica/table.py", "                self._locks.pin(current.job_id, current.file, current.size)\n",
              "                pass  # MUTATION\n"),),
        ("tests/test_restore.py::test_committed_replicas_stay_locked_so_a_global_drop_of_caches_leaves_restores_mapping_16_pages_a_fault",),
    ),
    Mutation(
        "superseded-replica-stays-locked",
        "a superseded replica a trainer was served stays locked: locked memory grows with every restored rank file",
        (Edit("daemon/replica/table.py", "            self._locks.unpin(job_id)\n", "            pass  # MUTATION\n"),),
        ("tests/test_restore.py::test_a_served_replica_once_superseded_is_unlocked_not_kept_as_a_spare",),
    ),
    Mutation(
        "removed-replica-stays-locked",
        "a replica whose file was removed under the daemon (RemoveIPC) stays locked and mapped until the daemon exits",
        (Edit("daemon/replica/table.py", "        self._locks.release_removed()  # replicas removed under the daemon: their locked pages go\n",
              "        pass  # MUTATION\n"),),
        ("tests/test_restore.py::test_a_replica_removed_under_the_daemon_is_unlocked_and_unmapped_by_the_next_snapshot",),
    ),
    Mutation(
        "in-place-load-keeps-page-cache",
        "an in-place load from disk leaves the whole file in the page cache: a second copy of the checkpoint in memory",
        (Edit("protocol/storage/posix.py", "            forget_cached(self.fd)\n", "            os.close(self.fd)  # MUTATION\n"),),
        ("tests/test_load_into.py::test_an_in_place_load_from_disk_leaves_the_file_out_of_the_page_cache"
         "[not aligned as the file]",),
    ),
    Mutation(
        "lost-rank-spares-unstarted-rounds",
        "a rank gone (BYE or killed) with a tag snapshotted and not committed fails only rounds already under way: "
        "the other ranks that ask to commit that tag afterwards wait out commit_timeout",
        (Edit("daemon/rounds.py", "        for tag in owed:\n", "        for tag in ():\n"),),
        ("tests/test_multirank.py::test_a_rank_that_says_bye_without_committing_fails_the_tag_at_once"
         "[before any rank asked to commit]",
         "tests/test_multirank.py::test_a_rank_killed_before_committing_fails_the_tag_at_once"
         "[after its snapshot, before any commit]"),
    ),
    Mutation(
        "slice-reads-every-piece",
        "a resharded or partial load reads every piece of each file it needs a slice of, not only those holding it",
        (Edit("client/reader/stream.py", "        self.partial = parts is not None\n", "        self.partial = False\n"),),
        ("tests/test_slices.py::test_a_slice_reads_only_the_pieces_that_hold_it",),
    ),
    Mutation(
        "partial-load-reads-between-scalars",
        "a partial load reads each piece from its first needed byte to its last, not only the blocks around them",
        (Edit("client/reader/stream.py", "            if spans and lo <= spans[-1][1] + PARTIAL_GAP:\n",
              "            if spans:\n"),),
        ("tests/test_slices.py::test_scalars_scattered_through_a_file_read_only_the_blocks_around_them",),
    ),
    Mutation(
        "slice-hash-skips-bytes-beside-it",
        "a slice read straight into its tensor hashes only its own bytes, not the rest of the pieces around it: "
        "every checksum fails",
        (Edit("client/reader/stream.py", "                h.update(data[lo - at:mid_lo - at])\n", ""),),
        ("tests/test_slices.py::test_a_slice_equals_the_stored_tensor_narrowed",),
    ),
    Mutation(
        "in-place-direct-drops-ends",
        "an in-place O_DIRECT load reads each aligned tensor's whole blocks straight into it but never copies its "
        "first and last bytes out of the bounce buffer",
        (Edit("client/reader/stream.py", "((lo, hi),) if done is None else ((lo, done.lo), (done.hi, hi))",
              "((lo, hi),) if done is None else ()"),),
        ("tests/test_load_into.py::test_a_state_over_many_read_pieces[storage]",),
    ),
    Mutation(
        "dcp-async-save-unfenced",
        "DCP's async_save stages references without making the fence wait for the snapshot its save thread sends: "
        "the optimizer step right after it changes shards before the daemon copies them",
        (Edit("integrations/dcp.py", "        self._staged, self._coming = staged, self.client.expect()\n",
              "        self._staged, self._coming = staged, None  # MUTATION\n"),),
        ("tests/integrations/test_dcp.py::test_a_load_into_any_number_of_ranks_equals_dcps_own_round_trip",),
    ),
    Mutation(
        "dcp-metadata-names-any-torch-attribute",
        "the DCP reader takes any attribute of torch a checkpoint's metadata names for a dtype: DCP's planner then "
        "calls what a crafted file chose",
        (Edit("integrations/dcp_meta.py", "    if not isinstance(value, kind):\n", "    if value is None:  # MUTATION\n"),),
        ("tests/integrations/test_dcp.py::test_a_crafted_metadata_file_is_refused_and_runs_nothing"
         "[a torch function for a dtype]",),
    ),
    Mutation(
        "dcp-metadata-list-gaps-unbounded",
        "the DCP reader takes any list index in planner_data: DCP's converter fills the list up to it and flattens "
        "each element again (an index of 2^20, 320 bytes of JSON, cost 10 s and 830 MiB)",
        (Edit("integrations/dcp_meta.py", "    if gaps > MAX_GAPS:\n", "    if False:  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[a list index of 2^24 - 1]",
         "tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[an index per nested list]"),
    ),
    Mutation(
        "dcp-metadata-path-depth-unbounded",
        "the DCP reader takes a planner_data path of any length: DCP rebuilds and walks the state recursively",
        (Edit("integrations/dcp_meta.py", "        if not 0 < len(path) <= MAX_DEPTH:\n",
              "        if not path:  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[a path of 5000 keys]",),
    ),
    Mutation(
        "dcp-metadata-paths-unjoined",
        "the DCP reader takes a planner_data path that is not its item's name: DCP's converter rebuilds a state "
        "whose names its own metadata lacks",
        (Edit("integrations/dcp_meta.py", '                and ".".join(map(str, path)) == fqn):\n',
              "                ):  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[a path that is not its item's name]",),
    ),
    Mutation(
        "dcp-metadata-paths-overlap",
        "the DCP reader takes planner_data paths that end at or inside another item's, or put names and indexes into "
        "one list: DCP's converter overwrites an item or fails with a TypeError",
        (Edit("integrations/dcp_meta.py", "        if not isinstance(node, dict) or path[-1] in node:\n",
              "        if False:  # MUTATION\n"),
         Edit("integrations/dcp_meta.py", "        if indexes and len(indexes) != len(node):\n",
              "        if False:  # MUTATION\n")),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[a path inside another]", "tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[names and indexes in one list]"),
    ),
    Mutation(
        "dcp-metadata-size-uncovered",
        "the DCP reader takes an item whose size its chunks do not cover: DCP's converter allocates and writes the "
        "whole size (2^30 elements of 3 stored: 4 GiB written)",
        (Edit("integrations/dcp_meta.py", "        if math.prod(size) > sum(", "        if False and math.prod(size) > sum("),),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[a size of 2^30 stored in 3 elements]",),
    ),
    Mutation(
        "dcp-metadata-dims-unbounded",
        "the DCP reader takes a size of any number of dimensions",
        (Edit("integrations/dcp_meta.py", "    if len(value) > MAX_DIMS:\n", "    if False:  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_each_crafted_field_that_drives_work_is_refused_naming_it[65 dimensions]",),
    ),
    Mutation(
        "dcp-object-unchecked",
        "a DCP load takes whatever a file holds where its metadata names an object: a tensor there is a TypeError, "
        "nothing there a KeyError",
        (Edit("integrations/dcp.py", "    if not isinstance(value, bytes):\n", "    if False:  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_a_resharded_load_of_an_object_the_file_does_not_hold_names_it[a tensor]",),
    ),
    Mutation(
        "dcp-checkpoint-id-unchecked",
        "a DCP save or load given checkpoint_id=None goes on with no folder: the daemon answers `invalid tag ''`",
        (Edit("integrations/dcp.py", "    if not folder:\n", "    if False:  # MUTATION\n"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_a_checkpoint_id_of_none_is_refused_saying_so[save]",
         "tests/faults/test_crafted_dcp_meta.py::test_a_checkpoint_id_of_none_is_refused_saying_so[load]"),
    ),
    Mutation(
        "convert-dcp-traceback",
        "`datastatesctl convert --to dcp` lets DCP read the metadata and raise its CheckpointException: a folder "
        "that is no committed checkpoint prints a traceback",
        (Edit("integrations/dcp.py", "    reader.read_metadata()  # its error", "    # MUTATION reader.read_metadata()"),
         Edit("integrations/dcp.py", "        raise next(iter(exc.failures.values()))[0] from None\n",
              "        raise\n")),
        ("tests/faults/test_crafted_dcp_meta.py::test_convert_to_dcp_of_no_checkpoint_says_so_in_one_line_and_to_filesystem_raises_the_error_itself",),
    ),
    Mutation(
        "missing-marker-warned",
        "a restore warns of every tier that holds no marker for the tag: each restore on a new node logs 'skipping "
        "the commit marker ...: No such file or directory'",
        (Edit("protocol/storage/posix.py", "        if not os.path.lexists(path):  # no tag committed here",
              "        if False:  # MUTATION"),),
        ("tests/faults/test_crafted_dcp_meta.py::test_a_restore_from_the_next_tier_on_a_node_whose_fast_tier_holds_nothing_warns_of_nothing",),
    ),
    Mutation(
        "dcp-late-snapshot-taken",
        "a snapshot the fence gave up waiting for is still taken when its save thread sends it: tensors the trainer "
        "was let go to change are checkpointed",
        (Edit("client/inflight.py", "            if self._given_up:\n", "            if False:  # MUTATION\n"),),
        ("tests/integrations/test_dcp.py::test_a_snapshot_expected_but_never_sent_fails_the_fence_once_instead_of_hanging",),
    ),
    Mutation(
        "dcp-second-save-of-a-tag-through-one-client",
        "a DCP save of a checkpoint_id while the same client's save of it is under way is not refused: the daemon "
        "commits the two saves' files as one, and both succeed",
        (Edit("integrations/dcp.py", "            if other is not None and not other.over():\n",
              "            if False:  # MUTATION\n"),),
        ("tests/faults/test_dcp_resave.py::"
         "test_a_save_of_a_checkpoint_the_clients_async_save_is_still_writing_is_refused[async_save]",
         "tests/faults/test_dcp_resave.py::test_back_to_back_saves_of_one_checkpoint_never_both_commit"),
    ),
    Mutation(
        "dcp-failed-save-holds-its-tag",
        "a DCP save whose writer DCP stops calling (its coordinator's finish never comes) holds its tag for as long "
        "as its thread lives: the next save of that checkpoint_id on the same thread is refused",
        (Edit("integrations/dcp.py", "        return not self.thread.is_alive() or self.thread is threading.current_thread()\n",
              "        return not self.thread.is_alive()  # MUTATION\n"),),
        ("tests/faults/test_dcp_resave.py::"
         "test_a_save_of_a_checkpoint_the_clients_async_save_is_still_writing_is_refused[async_save]",),
    ),
    Mutation(
        "dcp-failed-save-holds-its-tag-from-async-save",
        "a DCP save whose finish never came (another rank's write failed) holds its tag against an async_save begun "
        "on the thread that ran it, whose write runs on DCP's thread: the retry is refused as still under way",
        (Edit("integrations/dcp.py", "        _UNDER_WAY.begin(self.client)\n", "        pass  # MUTATION\n"),),
        ("tests/faults/test_dcp_resave.py::test_an_async_save_after_a_save_that_never_finished_commits",),
    ),
    Mutation(
        "dcp-rank-commit-unanswered-not-held",
        "a rank's save whose commit the daemon has not answered (the coordinator never committed: another rank's "
        "write failed) stops holding its tag once its thread saves again: the save again commits the failed save's "
        "file beside the new metadata",
        (Edit("integrations/dcp.py", "                self._save.commit = self.client.commit(self.tag)\n"
              "                self._save.commit.add_done_callback(",
              "                self.client.commit(self.tag).add_done_callback(  # MUTATION\n"
              "                    "),),
        ("tests/faults/test_dcp_resave.py::"
         "test_a_save_again_after_the_coordinators_write_failed_never_commits_the_failed_saves_file",),
    ),
    Mutation(
        "replica-no-spare-ahead",
        "a rank file's first replica gets no spare allocated ahead: its second replica's fresh pages are allocated "
        "while its copies run, as the first's were",
        (Edit("daemon/replica/table.py", "                self.prepare(current)\n", "                pass  # MUTATION\n"),),
        ("tests/test_restore.py::test_a_first_replica_gets_a_spare_ahead_so_the_second_fills_existing_pages",),
    ),
    Mutation(
        "replica-spare-ahead-takes-the-next-replicas-room",
        "a spare is allocated ahead where the budget has room for it but not also for the next replica, which is "
        "then not kept",
        (Edit("daemon/replica/table.py", "        if self.used + 2 * replica.size > self.budget:",
              "        if self.used + replica.size > self.budget:  # MUTATION"),),
        ("tests/test_restore.py::test_a_first_replica_gets_a_spare_ahead_so_the_second_fills_existing_pages",),
    ),
    Mutation(
        "schema-fast-checker-takes-bool-for-int",
        "the checker made per class takes true or false where a field wants an integer (a size, an offset, a count), "
        "which the generic walk refuses",
        (Edit("protocol/schema.py", "        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _misfit()\n",
              "        return lambda v: v if isinstance(v, int) else _misfit()  # MUTATION\n"),),
        ("tests/test_schema.py",),
    ),
    Mutation(
        "orphan-snapshot-keeps-cuda-slots",
        "a snapshot from a client already taken as gone is refused before its CUDA handles are released: each new "
        "handle's slot stays at 1, and the trainer parks that block for its lifetime",
        (Edit("daemon/server.py", "            self.clients.release_orphaned(identity, body.sources)\n",
              "            pass  # MUTATION\n"),),
        ("tests/test_cuda_handles.py::test_a_snapshot_from_a_client_taken_as_gone_gives_back_its_new_handles_slots",),
    ),
    Mutation(
        "cuda-slot-released-below-zero",
        "a release of a slot already at zero takes it to -1, which torch reads unsigned: the block parks for good",
        (Edit("daemon/sources/cuda.py", "max(value + delta, 0) if delta < 0 else value + delta", "value + delta"),),
        ("tests/test_cuda_handles.py::test_a_snapshot_from_a_client_taken_as_gone_gives_back_its_new_handles_slots",),
    ),
    Mutation(
        "vm-batch-short-read-ignored",
        "a batched read of small tensors that stops short (an unmapped one among them) counts as done: the rest of "
        "the batch is saved as zeros, and the snapshot succeeds",
        (Edit("daemon/sources/vm.py", "            if n == sum(length for _, _, length in batch):\n                continue\n",
              "            continue  # MUTATION\n"),),
        ("tests/faults/test_in_place.py::test_an_unmapped_tensor_among_thousands_of_small_ones_fails_that_snapshot_and_names_it",),
    ),
    Mutation(
        "prefill-past-the-budget",
        "the background mapping of a fresh daemon's pool does not count the chunks a snapshot mapped itself: the "
        "pool grows past host_memory",
        (Edit("daemon/memory.py", "            if not self._room():\n                return\n",
              "            if len(self._all) >= self.capacity + 64:  # MUTATION\n                return\n"),),
        ("tests/test_memory.py::test_a_snapshot_taken_while_a_fresh_daemon_maps_its_pool_is_whole_and_the_pool_stays_in_budget",),
    ),
    Mutation(
        "deferred-first-replica-never-written",
        "a rank file's first replica, written once its snapshot is copied, is never written: it restores zeros",
        (Edit("daemon/engine.py", "                await engine.write(self.sink.write_replicas, at, dst.view[: piece.length])\n",
              "                pass  # MUTATION\n"),),
        ("tests/test_restore.py::test_ranks_agree_on_the_tag_when_only_one_fits_in_memory",),
    ),
    Mutation(
        "superseded-replica-unlocked",
        "a superseded replica kept as a spare is unlocked (and its pages locked again when the next replica is "
        "written over them): every checkpoint walks every page twice",
        (Edit("daemon/replica/table.py",
              "        self._locks.move(replica.job_id, key)  # its pages stay locked for the next replica written over them\n",
              "        self._locks.unpin(replica.job_id)  # MUTATION\n"),),
        ("tests/test_restore.py::test_committed_replicas_stay_locked_so_a_global_drop_of_caches_leaves_restores_mapping_16_pages_a_fault",),
    ),
    Mutation(
        "structure-kept-whatever-the-sizes",
        "a state sent again with the same entries but a storage of another size reuses the kept plan: the file's "
        "storages are laid out for the old sizes",
        (Edit("protocol/layout.py", " and s.sizes == sizes:", ":  # MUTATION"),),
        ("tests/test_roundtrip.py::test_a_state_sent_again_is_written_whole_and_a_changed_one_as_it_now_is",),
    ),
    Mutation(
        "layout-kept-whatever-the-index-length",
        "the kept file layout is reused when the tag's length changes the index's: the data region is where the "
        "last file's was",
        (Edit("protocol/layout.py", "        layout = self.layouts.get(index_len)\n",
              "        layout = next(iter(self.layouts.values()), None)  # MUTATION\n"),),
        ("tests/test_roundtrip.py::test_a_state_sent_again_is_written_whole_and_a_changed_one_as_it_now_is",),
    ),
    Mutation(
        "kept-field-matched-by-length",
        "a long field is taken as the one decoded lately when only its length matches: a changed state is written "
        "as the one before",
        (Edit("protocol/messages.py", "                value = _kept.get((cls, key, raw), _kept)\n",
              "                value = next((v for (c, k, b), v in _kept.items() if c is cls and k == key and len(b) == len(raw)), _kept)  # MUTATION\n"),
         Edit("protocol/messages.py", "                    _kept.move_to_end((cls, key, raw))\n", "")),
        ("tests/test_roundtrip.py::test_a_state_sent_again_is_written_whole_and_a_changed_one_as_it_now_is",),
    ),
    Mutation(
        "kept-field-under-a-duplicate-key",
        "a body with a duplicate key has the second value kept under the first one's bytes: a peer makes the daemon "
        "decode another client's entries as its own",
        (Edit("protocol/messages.py", "            if key in data or key not in names:\n",
              "            if key not in names:  # MUTATION\n"),),
        ("tests/faults/test_fuzz_protocol.py::test_a_peer_cannot_make_the_daemon_decode_another_clients_state_as_its_own",),
    ),
    Mutation(
        "s3-marker-ignores-missing-objects",
        "a marker object counts as committed whatever its objects: a tag with an object gone is restored",
        (Edit("protocol/storage/s3/markers.py", "        return not any(sizes.get(f\"{folder}/{f.path}\") != f.size for f in marker.files)",
              "        return True  # MUTATION"),),
        ("tests/test_s3.py::test_a_corrupted_object_is_refused_and_a_tag_without_marker_is_ignored",),
    ),
    Mutation(
        "s3-old-marker-kept-while-a-tag-is-uploaded-again",
        "a tag saved again keeps its old marker on the bucket while its objects are replaced one by one",
        (Edit("daemon/objecttiers.py", "        self.writer.delete(own_marker)", "        pass  # MUTATION"),),
        ("tests/test_s3.py::test_a_tag_saved_again_is_uncommitted_on_the_bucket_until_its_new_version_is_whole",),
    ),
    Mutation(
        "s3-aborts-every-journaled-upload",
        "the next daemon aborts the uploads every daemon of the node journaled, a live one's too",
        (Edit("protocol/storage/s3/writes.py", " or owner == self.owner or not gone(owner, None):",
              " or owner == self.owner:  # MUTATION"),),
        ("tests/test_s3.py::test_a_killed_daemons_uploads_are_aborted_by_the_next_and_no_other_daemons",),
    ),
    Mutation(
        "s3-prune-deletes-another-tags-marker",
        "keep_last on the bucket deletes a tag's folder whole, though another committed tag's marker is in it",
        (Edit("protocol/storage/s3/markers.py", "        if strangers:\n", "        if False:  # MUTATION\n"),),
        ("tests/test_s3.py::test_keep_last_on_the_bucket_never_deletes_another_tags_marker_with_a_folder",),
    ),
    Mutation(
        "s3-old-version-objects-left",
        "a tag saved again without one of its files leaves that file's old object on the bucket, readable by its address",
        (Edit("daemon/objecttiers.py", "        if earlier is None:\n            return\n", "        if True:  # MUTATION\n            return\n"),),
        ("tests/test_s3.py::test_a_tag_saved_again_without_one_of_its_files_leaves_no_old_object_on_the_bucket",),
    ),
    Mutation(
        "tier-transfer-opens-by-path",
        "a tier transfer reads each file by its path when it reaches it, not through the descriptor it opened before "
        "any byte moved: a version switched in meanwhile is uploaded under the earlier version's marker",
        (Edit("daemon/tiers.py", "await self._upload_file(sources[src], src,",
              "await self._upload_file(os.open(src, os.O_RDONLY), src,  # MUTATION\n                                         "),),
        ("tests/test_s3.py::test_a_tag_saved_again_while_its_last_version_uploads_commits_each_version_whole_on_the_bucket",),
    ),
    Mutation(
        "tier-transfer-trusts-the-file",
        "a tier transfer takes the fast tier's file as the commit's without reading its snapshot identity",
        (Edit("daemon/tiers.py", "            if want and (got := _snapshot_of(fd, src)) != want:",
              "            if False and (got := _snapshot_of(fd, src)) != want:  # MUTATION"),),
        ("tests/test_s3.py::test_a_fast_tier_file_replaced_before_its_transfer_is_never_committed_on_the_bucket",),
    ),
    Mutation(
        "drain-waits-on-a-hung-tier",
        "the drain waits for every tier transfer however long it has not moved: SIGTERM does not stop the daemon while "
        "the bucket hangs",
        (Edit("daemon/tiers.py", "        if not self.pending() or stalled < TRANSFER_STALL_S:",
              "        if True:  # MUTATION"),),
        ("tests/test_s3.py::test_sigterm_ends_the_daemon_while_the_bucket_hangs_and_the_next_daemon_finishes_the_transfer"
         "[busy]",),
    ),
    Mutation(
        "hung-server-tried-six-times",
        "a request the server leaves unanswered is tried botocore's six times: a read of a hung bucket waits minutes",
        (Edit("protocol/storage/s3/address.py", "    return False if _unanswered(caught_exception) and attempts >= TIMEOUT_TRIES else None",
              "    return None  # MUTATION"),),
        ("tests/test_s3.py::test_a_read_of_a_hung_bucket_gives_up_with_an_error_naming_it",),
    ),
    Mutation(
        "s3-journal-taken-away",
        "a daemon that cannot list uploads removes the dead daemons' journals it read, another job's daemon's too",
        (Edit("protocol/storage/s3/writes.py", "            self.kept |= set(owners.values())\n",
              "            for owner in set(owners.values()):  # MUTATION\n                os.unlink(journal_path(folder, owner))\n"),),
        ("tests/test_s3.py::test_a_killed_daemons_uploads_stay_journaled_once_until_a_daemon_that_can_list_them_aborts_"
         "them",),
    ),
    Mutation(
        "s3-journal-forgotten-unaborted",
        "a daemon that cannot list its dead predecessor's uploads forgets that daemon's journal all the same",
        (Edit("protocol/storage/s3/writes.py", "            self.kept |= set(owners.values())\n", "            pass  # MUTATION\n"),),
        ("tests/test_s3.py::test_a_killed_daemons_uploads_stay_journaled_once_until_a_daemon_that_can_list_them_aborts_"
         "them",),
    ),
    Mutation(
        "connections-dup-leaked",
        "a stale accept event for a number a folder took leaks a duplicate of the folder's descriptor, and its flock",
        (Edit("daemon/connections.py", "    os.close(dup)\n    return None\n", "    return None  # MUTATION\n"),),
        ("tests/faults/test_connections.py::test_a_stale_accept_event_for_a_number_a_folder_took_keeps_no_descriptor_"
         "and_no_lock_of_it",),
    ),
    Mutation(
        "recovery-forgets-who-died-during-it",
        "a recovery forgets a writer that died while it ran, whose leftovers it never looked for",
        (Edit("daemon/instances.py", " or owner not in dead or not self.gone(owner):", " or not self.gone(owner):  # MUTATION"),),
        ("tests/faults/test_recovery_owners.py::test_a_writer_killed_during_a_recovery_is_left_to_the_next_recovery",),
    ),
    Mutation(
        "recovery-forgets-kept-owners",
        "a recovery forgets a dead writer whose uploads it could not list",
        (Edit("daemon/instances.py", "(owner not in kept and roots and", "(roots and  # MUTATION\n                       "),),
        ("tests/faults/test_recovery_owners.py::test_a_writer_whose_leftovers_could_not_all_be_removed_stays_until_forget_after",),
    ),
    Mutation(
        "lock-never-touched",
        "a daemon never renews its lock file's time, so one that ran a week is forgotten the moment it dies",
        (Edit("daemon/instances.py", "        os.utime(self._fd)\n", "        pass  # MUTATION\n"),),
        ("tests/faults/test_recovery_owners.py::test_forget_after_counts_from_a_writers_last_sign_of_life_not_its_start",),
    ),
    Mutation(
        "folder-lock-closed-not-unlocked",
        "a folder's flock is only closed, not unlocked: a child sharing the folder's descriptor keeps it",
        (Edit("protocol/storage/posix.py", "            fcntl.flock(held, fcntl.LOCK_UN)\n", "            pass  # MUTATION\n"),),
        ("tests/faults/test_identity.py::test_a_folder_lock_is_free_once_its_commit_is_done_though_a_child_shares_the_"
         "folders_descriptor",),
    ),
    Mutation(
        "s3-journal-never-trimmed",
        "a daemon's upload journal keeps a line for every upload it ever made",
        (Edit("protocol/storage/s3/writes.py", "        self._journal.ended(handle.upload_id)\n        size =", "        pass  # MUTATION\n        size ="),),
        ("tests/test_s3.py::test_a_long_lived_daemons_journal_stays_short_and_still_names_its_open_upload_for_the_next_daemon",),
    ),
    Mutation(
        "s3-journal-trimmed-of-open-uploads",
        "a trimmed journal keeps no upload, the open ones neither",
        (Edit("protocol/storage/s3/writes.py", "for upload_id, bucket in self.open.items()))", "for upload_id, bucket in {}.items()))  # MUTATION"),),
        ("tests/test_s3.py::test_a_long_lived_daemons_journal_stays_short_and_still_names_its_open_upload_for_the_next_daemon",),
    ),
    Mutation(
        "markers-read-one-by-one",
        "latest() on a bucket reads its marker objects one after another",
        (Edit("protocol/storage/s3/markers.py", "MARKER_READS = 16\n", "MARKER_READS = 1  # MUTATION\n"),),
        ("tests/test_s3.py::test_latest_on_a_bucket_of_many_tags_reads_their_markers_at_once_and_names_the_newest",),
    ),
    Mutation(
        "multi-node-restore-picks-alone",
        "a node of a multi-node job that cannot read the bucket picks the step from its own disk",
        (Edit("client/locate.py", "        if strict or not found:\n", "        if not found:  # MUTATION\n"),),
        ("tests/test_s3.py::test_a_node_that_cannot_read_the_bucket_refuses_to_pick_the_step_on_its_own_in_a_job_of_several_nodes",),
    ),
    Mutation(
        "newest-skips-an-unreadable-marker",
        "latest() and a restore's choice skip a marker object they cannot read, the newest one perhaps",
        (Edit("protocol/storage/s3/markers.py", "                if strict:\n                    raise\n", "                if False:  # MUTATION\n                    raise\n"),),
        ("tests/test_s3.py::test_a_node_that_cannot_read_the_bucket_refuses_to_pick_the_step_on_its_own_in_a_job_of_several_nodes",),
    ),
    Mutation(
        "marker-reads-hold-the-exit",
        "the marker reads a restore left waiting on a hung server hold its process at exit",
        (Edit("protocol/fanout.py", 'threading.Thread(target=work, name=f"{name}-{i}", daemon=True)',
              'threading.Thread(target=work, name=f"{name}-{i}", daemon=False)  # MUTATION'),),
        ("tests/test_s3.py::test_a_restore_goes_on_from_the_fast_tier_while_the_bucket_hangs_and_refuses_to_guess_with_nothing_else",),
    ),
    Mutation(
        "restore-waits-for-a-hung-bucket",
        "a restore that found a tag on the fast tier waits for a hung bucket's every try",
        (Edit("client/locate.py", "    until = time.monotonic() + OBJECT_WAIT_S if found and not strict else None\n",
              "    until = None  # MUTATION\n"),),
        ("tests/test_s3.py::test_a_restore_goes_on_from_the_fast_tier_while_the_bucket_hangs_and_refuses_to_guess_with_nothing_else",),
    ),
    Mutation(
        "restore-takes-an-unreadable-bucket-as-empty",
        "a restore that found nothing on the disk and cannot read the bucket says there is nothing to restore",
        (Edit("client/locate.py", "        if strict or not found:\n", "        if strict:  # MUTATION\n"),),
        ("tests/test_s3.py::test_a_restore_goes_on_from_the_fast_tier_while_the_bucket_hangs_and_refuses_to_guess_with_nothing_else",),
    ),
)
def working_tree_files() -> list[str]:
    """The repository's files as the working tree has them: tracked, and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode()
    return sorted(p for p in set(out.split("\0")) if p and (REPO / p).is_file())


def copy_tree(dest: Path) -> None:
    """The working tree copied to ``dest``, with ``dest/datastates`` linking the installed package layout."""
    for rel in working_tree_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
        where = dest.joinpath(*package.split("."))
        if where.resolve() == (dest / folder).resolve():
            continue  # already there, through its parent's link
        assert not where.exists(), f"{where} exists and is not {folder}: cannot link the package layout"
        where.symlink_to(os.path.relpath(dest / folder, where.parent), target_is_directory=True)


def environment(tree: Path) -> dict[str, str]:
    """The environment of the test run: the copy first on every process's import path, and heavy tests run (a test
    named to catch a mutation must never be skipped as too slow)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["DATASTATES_HEAVY"] = "1"
    return env


def check_imports(tree: Path) -> None:
    """Fail unless the trainer side and ``datastatesd`` both import the copy, from any working folder."""
    env = environment(tree)
    probe = ("import importlib.util as u; print('\\n'.join(u.find_spec(n).origin for n in "
             "('datastates', 'datastates.protocol.fileio', 'datastates.client.client', 'datastates.daemon.commit', "
             "'datastates.protocol.storage.posix')))")
    for cwd in (tree, Path("/")):
        origins = subprocess.run([str(PYTHON), "-c", probe], cwd=cwd, env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
        outside = [o for o in origins if not Path(o).resolve().is_relative_to(tree.resolve())]
        assert not outside, f"imported from outside the copy (cwd {cwd}): {outside}"
    daemon = subprocess.run([str(PYTHON.parent / "datastatesd"), "--help"], cwd="/", capture_output=True, text=True,
                            env={**env, "PYTHONVERBOSE": "1"}, timeout=120)
    loaded = [line for line in daemon.stderr.splitlines() if "main.py" in line and "daemon" in line]
    assert daemon.returncode == 0 and loaded, f"datastatesd --help failed: {daemon.stderr[-2000:]}"
    assert all(str(tree) in line for line in loaded), f"datastatesd imported its main module elsewhere: {loaded}"


def apply(tree: Path, edits: tuple[Edit, ...]) -> None:
    for edit in edits:
        path = tree / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != 1:
            raise SystemExit(f"mutation edit of {edit.path}: the text to replace occurs {found} times, not once; "
                             f"the code moved, update tests/mutations.py:\n{edit.old}")
        text = text.replace(edit.old, edit.new)
        if path.suffix == ".py":  # a mutation caught by a SyntaxError would prove nothing about the tests
            try:
                compile(text, str(path), "exec")
            except SyntaxError as exc:
                raise SystemExit(f"mutation edit of {edit.path} does not compile ({exc}): fix tests/mutations.py")
        path.write_text(text)


@dataclass
class Outcome:
    caught: bool
    verdict: str
    seconds: float
    tail: str = ""


def run_tests(tree: Path, tests: tuple[str, ...], extra: list[str]) -> Outcome:
    """Run ``tests`` in ``tree``; caught means pytest reported failed tests (exit status 1)."""
    present = [t for t in tests if (tree / t.split("::")[0]).is_file()]
    if not present:
        return Outcome(False, "no test: " + ", ".join(t.split("::")[0] for t in tests) + " missing", 0.0)
    start = time.monotonic()
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *extra, *present]
    try:
        run = subprocess.run(cmd, cwd=tree, env=environment(tree), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Outcome(True, f"caught (hung past {RUN_TIMEOUT_S} s)", time.monotonic() - start)
    seconds = time.monotonic() - start
    tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-25:])
    if run.returncode == 0:
        verdict = "SURVIVED" + (f" (only {len(present)} of {len(tests)} tests exist)" if len(present) < len(tests) else "")
        return Outcome(False, verdict, seconds, tail)
    if run.returncode == 1:
        failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED ")]
        return Outcome(True, "caught", seconds, "\n".join(failed) or tail)
    return Outcome(False, f"ERROR (pytest exit {run.returncode})", seconds, tail)


def table(rows: list[tuple[Mutation, Outcome]]) -> str:
    head = ("mutation", "test(s) expected to catch it", "caught?")
    lines = [(m.name, ", ".join(t.split("/")[-1] for t in m.tests), f"{o.verdict} ({o.seconds:.0f} s)")
             for m, o in rows]
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(3)]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    out = [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [fmt.format(*r) for r in lines]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests on an unmutated copy first")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest (repeatable), e.g. --long")
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.what}\n{'':28} caught by: {', '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in args.names] or list(MUTATIONS)

    work = Path(tempfile.mkdtemp(prefix="ds-mutations-"))
    try:
        if not args.no_baseline:
            tree = work / "baseline"
            copy_tree(tree)
            check_imports(tree)
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            print(f"baseline: the tests on an unmutated copy ({tree}) ...", flush=True)
            base = run_tests(tree, tests, args.pytest_arg)
            if base.caught or base.verdict.startswith("ERROR"):
                print(f"baseline FAILED ({base.verdict}): the tests fail without any mutation\n{base.tail}")
                return 2
            print(f"baseline passed ({base.seconds:.0f} s)", flush=True)
        rows = []
        for m in chosen:
            tree = work / m.name
            copy_tree(tree)
            apply(tree, m.edits)
            check_imports(tree)
            print(f"{m.name}: {m.what} ...", flush=True)
            outcome = run_tests(tree, m.tests, args.pytest_arg)
            print(f"  {outcome.verdict} ({outcome.seconds:.0f} s)", flush=True)
            if outcome.tail:
                print("  " + outcome.tail.replace("\n", "\n  "), flush=True)
            rows.append((m, outcome))
        print()
        print(table(rows))
        survived = [m.name for m, o in rows if not o.caught]
        if survived:
            print(f"\n{len(survived)} mutation(s) not caught: {', '.join(survived)}")
        return 1 if survived else 0
    finally:
        if args.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
