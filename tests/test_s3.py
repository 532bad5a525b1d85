"""The S3 tier: a tag committed on the fast tier is uploaded to an object store, committed there by its marker last.

Real processes only: a real S3 server (moto_server, its own process), real daemons, real files.
Faults the server cannot make (503s, slow answers, a server that dies mid-upload) come from a
threaded HTTP proxy in front of it (tests/s3server.py) that forwards the signed requests as they came.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import boto3
import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.storage.s3 import address as s3_address
from datastates.protocol.errors import CorruptCheckpointError, StorageError
from datastates.protocol.format import marker_name

from conftest import DAEMON_LOCKS, DaemonProc, assert_state_equal, rank_client, refused_run, run_datastatesd_many, save
from s3server import HOLD_MAX_S, FaultProxy, Moto, Rule, any_request, upload_part
from test_tiers import settle, tier_states

REGION = "us-east-1"
SECRET = "testing-secret"
CLOUD = "cloud"


def state(step: int, numel: int = 1 << 16) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(numel), "h": torch.randn(8, 8).to(torch.bfloat16), "step": step, "note": f"step {step}"}


def tiers(tmp: Path, url: str, keep_last: int | None = None, fast: str = "fast") -> dict[str, Any]:
    cloud: dict[str, Any] = {"name": CLOUD, "path": url}
    if keep_last:
        cloud["keep_last"] = keep_last
    return {"storage": {"tiers": [{"name": "fast", "path": str(tmp / fast)}, cloud]}, "memory_restore": "none"}


def use_endpoint(monkeypatch: pytest.MonkeyPatch, url: str, key: str = "testing", secret: str = SECRET) -> None:
    """Point boto3's chain (this process's and the daemons it starts next) at ``url``."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    s3_address.client.cache_clear()


def s3_client(url: str, key: str = "testing", secret: str = SECRET) -> Any:
    return boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=key, aws_secret_access_key=secret)


def keys(s3: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def uploads(s3: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def transfer(status: dict[str, Any], tag: str) -> dict[str, Any]:
    """The S3 tier's row of ``tag`` in the daemon's status."""
    rows = [e for e in status["tier_transfers"]["tags"] if e["tag"] == tag]
    assert rows, f"{tag} is not in status: {status['tier_transfers']}"
    return next(t for t in rows[-1]["tiers"] if t["tier"] == CLOUD)


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 60) -> Any:
    """A hang guard, not a timed assertion: ``cond()`` once it is true."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.05)
    return got


_buckets = iter(range(1, 1 << 30))


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    server = Moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.kill()


@pytest.fixture
def bucket(moto: Moto) -> str:
    """A fresh bucket of the module's S3 server."""
    name = f"ckpt-{next(_buckets)}"
    s3_client(moto.url).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module's S3 server, straight: this process and its daemons reach it through the environment."""
    use_endpoint(monkeypatch, moto.url)
    return s3_client(moto.url)


@pytest.fixture
def proxy(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of the module's S3 server, which this process and its daemons reach through it."""
    p = FaultProxy(moto.port)
    use_endpoint(monkeypatch, p.url)
    yield p
    p.release()
    p.down()


# -- a tag reaches the S3 tier ------------------------------------------------------------------------------------------


def test_a_committed_tag_reaches_s3_whole_and_keep_last_prunes_the_older(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url, keep_last=2))
    status = daemon_status(d.endpoint)
    assert status["tier_transfers"]["problems"] == {}, status["tier_transfers"]
    fast = tmp_path / "fast" / "run"
    big = 5 << 20  # 20 MiB: two parts
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            save(c, state(step, big), fast / f"step{step}" / "rank0.pt")
            status = settle(d)  # one at a time: none superseded
    for step in (1, 2, 3):
        assert tier_states(status, f"step{step}")["fast"] == "committed"
    assert tier_states(status, "step1")[CLOUD] == "pruned"
    for step in (2, 3):
        assert tier_states(status, f"step{step}")[CLOUD] == "committed"
    held = keys(s3, bucket, "jobs/run/")
    assert not [k for k in held if k.startswith("jobs/run/step1/")], sorted(held)  # marker and objects gone
    for step in (2, 3):
        tag = f"step{step}"
        assert f"jobs/run/{tag}/{marker_name(tag)}" in held
        raw = s3.get_object(Bucket=bucket, Key=f"jobs/run/{tag}/rank0.pt")["Body"].read()
        local = (fast / tag / "rank0.pt").read_bytes()
        assert len(raw) == len(local) and raw == local, f"{tag}: the object differs from the fast tier's file"
        assert_state_equal(state(step, big), datastates.load(f"{url}/run/{tag}/rank0.pt"))
    assert datastates.latest(f"{url}/run") == "step3"
    assert s3.get_object(Bucket=bucket, Key="jobs/run/latest")["Body"].read().decode().strip() == "step3"
    assert uploads(s3, bucket) == [] and not [k for k in keys(s3, bucket) if ".datastates-probe-" in k]
    listed = d.ctl("ls", f"{url}/run")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert sorted(r[0] for r in rows if r[1] == "committed" and r[5] == CLOUD) == ["step2", "step3"], listed.stdout
    dry = d.ctl("prune", f"{url}/run", "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and f"would delete {url}/run/step2" in dry.stdout, (dry.stdout, dry.stderr)
    assert f"jobs/run/step2/{marker_name('step2')}" in keys(s3, bucket, "jobs/run/")
    pruned = d.ctl("prune", f"{url}/run", "--keep-last", "1")
    assert pruned.returncode == 0 and f"deleted {url}/run/step2" in pruned.stdout, (pruned.stdout, pruned.stderr)
    assert not [k for k in keys(s3, bucket, "jobs/run/") if k.startswith("jobs/run/step2/")]
    assert datastates.latest(f"{url}/run") == "step3"


def test_keep_last_on_the_bucket_never_deletes_another_tags_marker_with_a_folder(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    """A "best" tag saved into step1's folder (as Lightning does) is committed there on the bucket too: pruning step1
    must keep that folder, as a folder tier's prune does, or the committed "best" would go with it."""
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url, keep_last=1))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
        settle(d)
        save(c, state(7), fast / "step1" / "best.pt", tag="best")
        settle(d)
        save(c, state(2), fast / "step2" / "rank0.pt")
        status = settle(d)
    assert tier_states(status, "step2")[CLOUD] == "committed", status["tier_transfers"]["tags"]
    held = keys(s3, bucket, "jobs/run/step1/")
    assert {f"jobs/run/step1/{n}" for n in ("rank0.pt", "best.pt", marker_name("step1"), marker_name("best"))} \
        <= set(held), sorted(held)
    assert_state_equal(state(7), datastates.load(f"{url}/run/step1/best.pt"))
    pruned = d.ctl("prune", f"{url}/run", "--keep-last", "1")
    assert pruned.returncode == 0 and "0 tag(s) pruned" in pruned.stdout, (pruned.stdout, pruned.stderr)
    assert set(keys(s3, bucket, "jobs/run/step1/")) == set(held)


def test_restore_falls_back_to_s3_when_no_faster_tier_holds_the_tag(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fast = tmp_path / "fast" / "run"
    saved = state(1, 3 << 20)
    with Client(d.endpoint, timeout=60) as c:
        save(c, saved, fast / "step1" / "rank0.pt")
        assert tier_states(settle(d), "step1") == {"fast": "committed", CLOUD: "committed"}
        for p in (fast / "step1").iterdir():  # the node lost its local disk
            p.unlink()
        (fast / "step1").rmdir()
        for root in (fast, f"{url}/run"):
            into = state(99, 3 << 20)
            got = c.restore(root, "rank0.pt", into=into)
            assert (got.tag, got.tier) == ("step1", CLOUD), (root, got.tag, got.tier)
            assert_state_equal(saved, into)
    into = state(98, 3 << 20)
    datastates.load(f"{url}/run/step1/rank0.pt", into=into)
    assert_state_equal(saved, into)


@pytest.mark.heavy
def test_a_restore_goes_on_from_the_fast_tier_while_the_bucket_hangs_and_refuses_to_guess_with_nothing_else(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """A server that never answers the marker reads but keeps their connections busy (so no read timeout fires) holds
    them as long as it likes: a restore that found a tag on the fast tier goes on without the bucket after
    OBJECT_WAIT_S, answered or not, and its process exits at once after it, not once the reads it left waiting end.
    One that found nothing there must not take "no checkpoint" from a bucket it cannot read, which would start the
    training afresh: it raises, naming it."""
    from datastates.protocol.format import MARKER_PREFIX

    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fast = tmp_path / "fast" / "run"
    saved = state(1, 1 << 16)
    with Client(d.endpoint, timeout=120) as c:
        save(c, saved, fast / "step1" / "rank0.pt")
        settle(d)
    def marker_get(m: str, p: str, q: str) -> bool:
        return m == "GET" and f"/{MARKER_PREFIX}" in p

    answered = proxy.count(marker_get)
    held = proxy.add(Rule(marker_get, hold=True, busy=True))  # listings answer, marker reads hang
    trainer = subprocess.run(  # a trainer's process, which restores and ends
        [sys.executable, "-c", "import sys\nfrom datastates.client import Client\n"
         "with Client(sys.argv[1], timeout=120) as c:\n    got = c.restore(sys.argv[2], 'rank0.pt')\n"
         "print(got.tag, got.tier)\n", d.endpoint, str(fast)],
        capture_output=True, text=True, timeout=HOLD_MAX_S + 60)
    assert trainer.returncode == 0 and trainer.stdout.split() == ["step1", "fast"], \
        (trainer.stdout, trainer.stderr[-2000:])
    assert held.seen >= 1 and proxy.count(marker_get) == answered, \
        "the bucket answered a marker read before the restoring process had ended"
    proxy.clear()
    with Client(d.endpoint, timeout=120) as c:
        shutil.rmtree(fast)  # a new node: nothing on its disk
        proxy.add(Rule(lambda m, p, q: m == "GET", fail=-1, status=403))
        with pytest.raises(StorageError) as err:
            c.restore(fast, "rank0.pt")
        assert f"{url}/run" in str(err.value) and "no other tier" in str(err.value), str(err.value)
        proxy.clear()
        got = c.restore(fast, "rank0.pt")
        assert (got.tag, got.tier) == ("step1", CLOUD)
        assert_state_equal(saved, got.state)


def test_a_load_from_the_bucket_downloads_each_byte_about_once(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """Egress is billed by the byte and every request costs a round trip: a whole load of an object makes one GET per
    64 MiB piece of its data (the first also reads its head, one beside it its tail), no HEAD, and reads no byte
    twice, fresh or in place."""
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    saved = state(1, 20 << 20)  # 80 MiB of tensors: two pieces
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=120) as c:
        save(c, saved, fast / "step1" / "rank0.pt")
    assert tier_states(settle(d), "step1") == {"fast": "committed", CLOUD: "committed"}
    size = (fast / "step1" / "rank0.pt").stat().st_size
    path = f"/{bucket}/jobs/run/step1/rank0.pt"
    for into in (None, state(2, 20 << 20)):
        before = len(proxy.answered(path))
        got = datastates.load(f"{url}/run/step1/rank0.pt", into=into)
        assert_state_equal(saved, got if into is None else into)
        made = proxy.answered(path)[before:]
        assert [m for m, _ in made] == ["GET"] * len(made) and len(made) <= 2 + 2, made  # 2 pieces, head, tail
        sent = sum(n for _, n in made)
        assert size <= sent <= size + (2 << 20), f"{sent} bytes sent for an object of {size}"


@pytest.mark.heavy
def test_latest_on_a_bucket_of_many_tags_reads_their_markers_at_once_and_names_the_newest(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """Without ``keep_last`` a run's prefix keeps a marker per save, and ``latest()`` must read each (an object's
    time is no tag's newness): one round trip after another made it a minute for a thousand saves to a far region.
    The marker GETs are held at the proxy: more than one must be in flight at once, and the answer stays the newest."""
    from concurrent.futures import ThreadPoolExecutor

    from datastates.protocol.format import MARKER_PREFIX

    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    count = 20
    with Client(d.endpoint, timeout=60) as c:
        for step in range(count):
            save(c, state(step, 1 << 10), tmp_path / "fast" / "run" / f"step{step}" / "rank0.pt")
            settle(d)
    held = proxy.add(Rule(lambda m, p, q: m == "GET" and f"/{MARKER_PREFIX}" in p, hold=True))
    with ThreadPoolExecutor(1) as pool:
        newest = pool.submit(datastates.latest, f"{url}/run")
        try:
            wait_for("8 markers read at once", lambda: held.seen >= 8)
        finally:
            held.release()
        assert newest.result(timeout=60) == f"step{count - 1}"
    assert held.seen == count


def test_a_corrupted_object_is_refused_and_a_tag_without_marker_is_ignored(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2):
            save(c, state(step), fast / f"step{step}" / "rank0.pt")
    status = settle(d)
    assert tier_states(status, "step2") == {"fast": "committed", CLOUD: "committed"}, status["tier_transfers"]["tags"]
    # a later tag's objects, all there, but never its marker: not committed, so never the newest
    for k in keys(s3, bucket, "jobs/run/step2/"):
        if not k.endswith(marker_name("step2")):
            s3.copy_object(Bucket=bucket, Key=k.replace("/step2/", "/step3/"), CopySource={"Bucket": bucket, "Key": k})
    assert keys(s3, bucket, "jobs/run/step3/")
    assert datastates.latest(f"{url}/run") == "step2"
    with Client(d.endpoint, timeout=60) as c:
        got = c.restore(f"{url}/run", "rank0.pt")
        assert got.tag == "step2"
        assert_state_equal(state(2), got.state)
    # a byte flipped in an object, at the same size
    key = "jobs/run/step1/rank0.pt"
    raw = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[len(raw) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        datastates.load(f"{url}/run/step1/rank0.pt")
    bad = d.ctl("verify", f"{url}/run/step1")  # a tag's folder on the bucket: every object its marker lists
    assert bad.returncode == 1 and f"CORRUPT  {url}/run/step1/rank0.pt" in bad.stdout, (bad.stdout, bad.stderr)
    good = d.ctl("verify", "step2", "--root", f"{url}/run")  # a tag by name
    assert good.returncode == 0 and f"ok       {url}/run/step2/rank0.pt" in good.stdout, (good.stdout, good.stderr)
    for args in ([f"{url}/run/step3"], ["step9", "--root", f"{url}/run"]):  # objects without a marker; no tag at all
        refused = d.ctl("verify", *args)
        assert refused.returncode == 2 and "no commit marker" in refused.stderr, (args, refused)
    # an object a marker lists, deleted: that tag is no longer committed, and the one before is the newest
    s3.delete_object(Bucket=bucket, Key="jobs/run/step2/rank0.pt")
    assert datastates.latest(f"{url}/run") == "step1"


def listing(method: str, path: str, query: str) -> bool:
    return method == "GET" and "list-type=2" in query


def test_an_object_another_writer_replaced_before_the_marker_fails_the_commit(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    s3 = s3_client(proxy.url)
    mine, theirs = state(1), state(201)
    settle(d)  # its start-up look for transfers left undone is over: the next listing is the commit's
    held = proxy.add(Rule(listing, hold=True))  # the commit's check, once every part is up
    with Client(d.endpoint, timeout=60) as c:
        save(c, mine, tmp_path / "fast" / "run" / "step1" / "rank0.pt")
    wait_for("the commit's listing", lambda: held.seen)
    with Client(d.endpoint, timeout=60) as c:
        save(c, theirs, tmp_path / "fast" / "other" / "step1" / "rank0.pt")
    key = "jobs/run/step1/rank0.pt"  # the same key, the same size, another writer's bytes
    body = (tmp_path / "fast" / "other" / "step1" / "rank0.pt").read_bytes()
    assert len(body) == s3.head_object(Bucket=bucket, Key=key)["ContentLength"], "the test needs equal sizes"
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    proxy.clear()
    proxy.release()
    status = settle(d)
    row = next(t for e in status["tier_transfers"]["tags"] for t in e["tiers"] if t["folder"] == f"{url}/run/step1")
    assert row["state"] == "failed" and "another writer replaced it" in row["error"], row
    assert marker_name("step1") not in " ".join(keys(s3, bucket, "jobs/run/"))
    assert datastates.latest(f"{url}/run") is None


def test_a_tag_saved_again_is_uncommitted_on_the_bucket_until_its_new_version_is_whole(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fast = tmp_path / "fast" / "run"
    old, new = state(1), state(101)

    def save_both(st: dict[str, Any]) -> None:
        """Both files, then one commit: one version of the tag (a commit per file would make two, the second without
        the first's file, as on the fast tier)."""
        for r in range(2):
            c.snapshot(st, fast / "step1" / f"rank{r}.pt", tag="step1")
        c.wait()
        c.commit("step1").result(timeout=120)

    with Client(d.endpoint, timeout=60) as c:
        save_both(old)
        assert tier_states(settle(d), "step1") == {"fast": "committed", CLOUD: "committed"}
        held = proxy.add(Rule(upload_part, hold=True))
        save_both(new)
        wait_for("the new version's upload", lambda: held.seen)
        assert datastates.latest(f"{url}/run") is None  # never the old marker over a half-replaced tag
        proxy.release()
        assert tier_states(settle(d), "step1") == {"fast": "committed", CLOUD: "committed"}
    assert datastates.latest(f"{url}/run") == "step1"
    for r in range(2):
        assert_state_equal(new, datastates.load(f"{url}/run/step1/rank{r}.pt"))


def test_a_tag_saved_again_without_one_of_its_files_leaves_no_old_object_on_the_bucket(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    """The new version of a tag replaces the old one whole, on the bucket as on the fast tier: an object only the old
    version had is not left there to be read by its address with the old step's bytes."""
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        for r in range(2):
            c.snapshot(state(1), fast / "step1" / f"rank{r}.pt", tag="step1")
        c.wait()
        c.commit("step1").result(timeout=120)
        assert tier_states(settle(d), "step1") == {"fast": "committed", CLOUD: "committed"}
        save(c, state(2), fast / "step1" / "rank1.pt", tag="step1")  # the tag again, rank 1's file only
        status = settle(d)
    assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "committed"}
    assert not (fast / "step1" / "rank0.pt").exists()  # the fast tier's new version: rank 1's file only
    assert set(keys(s3, bucket, "jobs/run/step1/")) == {"jobs/run/step1/rank1.pt",
                                                         f"jobs/run/step1/{marker_name('step1')}"}
    with pytest.raises(FileNotFoundError):
        datastates.load(f"{url}/run/step1/rank0.pt")
    assert_state_equal(state(2), datastates.load(f"{url}/run/step1/rank1.pt"))


def only_first(match: Callable[[str, str, str], bool]) -> Callable[[str, str, str], bool]:
    """A rule's match that takes the first request ``match`` takes, and no later one."""
    taken: list[bool] = []

    def first(method: str, path: str, query: str) -> bool:
        if taken or not match(method, path, query):
            return False
        taken.append(True)
        return True
    return first


def marker_get(key: str) -> Callable[[str, str, str], bool]:
    """The GETs of the marker object of ``key`` (bucket/prefix/run/tag): a transfer's first request, ``begin``'s."""
    return lambda m, p, q: m == "GET" and p.endswith(f"{key}/{marker_name(key.rsplit('/', 1)[1])}")


def test_a_tag_saved_again_while_its_last_version_uploads_commits_each_version_whole_on_the_bucket(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """A rolling tag saved again on the fast tier (a new version switched in) while the last version's transfer is
    under way: the transfer carries the version it began with, whose files it opened before the switch, so the
    bucket's marker of that version lists objects of that version, never the next one's (CorruptCheckpointError)."""
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    settle(d)
    last = tmp_path / "fast" / "run" / "last" / "rank0.pt"
    first = proxy.add(Rule(only_first(marker_get(f"{bucket}/jobs/run/last")), hold=True))  # v1's transfer has begun
    then = proxy.add(Rule(only_first(marker_get(f"{bucket}/jobs/run/last")), hold=True))  # v2's transfer begins
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), last, tag="last")
        wait_for("the first version's transfer", lambda: first.seen)
        save(c, state(2), last, tag="last")  # switched in on the fast tier, the same size
        first.release()
        wait_for("the second version's transfer", lambda: then.seen)
        assert datastates.latest(f"{url}/run") == "last"
        assert_state_equal(state(1), datastates.load(f"{url}/run/last/rank0.pt"))  # the first version, whole
        then.release()
        status = settle(d)
    assert [t["state"] for e in status["tier_transfers"]["tags"] if e["tag"] == "last"
            for t in e["tiers"] if t["tier"] == CLOUD] == ["committed", "committed"], status["tier_transfers"]
    assert datastates.latest(f"{url}/run") == "last"
    assert_state_equal(state(2), datastates.load(f"{url}/run/last/rank0.pt"))


def test_a_fast_tier_file_replaced_before_its_transfer_is_never_committed_on_the_bucket(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """A committed file replaced on the fast tier by another snapshot's file of the same size (a stray copy) while
    its tag waits for its transfer: the transfer reads the snapshot identity of the file it opened, and fails the
    tag there instead of committing another snapshot's bytes under its marker."""
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    settle(d)
    fast = tmp_path / "fast"
    ahead = proxy.add(Rule(marker_get(f"{bucket}/jobs/other/step1"), hold=True))  # another run's transfer, ahead
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(7), fast / "other" / "step1" / "rank0.pt")
        wait_for("the other run's transfer", lambda: ahead.seen)
        save(c, state(1), fast / "run" / "step1" / "rank0.pt")
        save(c, state(2), fast / "stray" / "step1" / "rank0.pt")
    stray = fast / "run" / "step1" / "rank0.pt.stray"
    shutil.copyfile(fast / "stray" / "step1" / "rank0.pt", stray)
    assert stray.stat().st_size == (fast / "run" / "step1" / "rank0.pt").stat().st_size, "the test needs equal sizes"
    os.replace(stray, fast / "run" / "step1" / "rank0.pt")
    ahead.release()
    status = settle(d)
    row = next(t for e in status["tier_transfers"]["tags"] for t in e["tiers"] if t["folder"] == f"{url}/run/step1")
    assert row["state"] == "failed" and "holds snapshot" in row["error"], row
    assert datastates.latest(f"{url}/run") is None


# -- faults of the server -----------------------------------------------------------------------------------------------


def test_the_first_503s_are_retried_and_the_tag_commits(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    fail = proxy.add(Rule(upload_part, fail=3))
    slow = proxy.add(Rule(any_request, delay=0.1))  # every other request answered late, well within the read timeout
    saved = state(1, 6 << 20)  # 24 MiB: two parts
    with Client(d.endpoint, timeout=60) as c:
        save(c, saved, tmp_path / "fast" / "run" / "step1" / "rank0.pt")
    status = settle(d)
    assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "committed"}, transfer(status, "step1")
    assert fail.failed == 3 and proxy.count(upload_part, 503) == 3 and proxy.count(upload_part, 200) >= 2
    assert slow.seen > 0
    proxy.clear()
    assert datastates.latest(f"{url}/run") == "step1"
    assert_state_equal(saved, datastates.load(f"{url}/run/step1/rank0.pt"))


@pytest.mark.heavy
def test_a_server_that_answers_only_503_fails_the_transfer_and_the_fast_tier_stands(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    proxy.add(Rule(any_request, fail=-1))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
        status = settle(d)
        row = transfer(status, "step1")
        assert row["state"] == "failed", row
        assert url in row["error"] and "503" in row["error"] and "unavailable" in row["error"], row["error"]
        assert tier_states(status, "step1")["fast"] == "committed"
        got = c.restore(fast, "rank0.pt")
        assert (got.tag, got.tier) == ("step1", "fast")
        assert_state_equal(state(1), got.state)
    assert proxy.count(any_request, 503) > 1  # retried before giving up
    proxy.clear()
    assert datastates.latest(f"{url}/run") is None
    s3 = s3_client(proxy.url)
    assert keys(s3, bucket, "jobs/run/") == {} and uploads(s3, bucket) == []


def test_a_part_refused_after_every_retry_names_its_cause(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    proxy.add(Rule(upload_part, fail=-1))
    src = tmp_path / "fast" / "run" / "step1" / "rank0.pt"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), src)
    status = settle(d)
    assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "failed"}
    held_open = [fd for fd in os.listdir(f"/proc/{d.proc.pid}/fd")
                 if os.path.realpath(f"/proc/{d.proc.pid}/fd/{fd}") == os.path.realpath(src)]
    row = transfer(status, "step1")
    assert url in row["error"] and "503" in row["error"] and not held_open, (row["error"], held_open)


def test_a_refusal_with_a_huge_message_fails_its_transfer_in_a_few_words_and_the_uploads_go_on(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    huge = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code><Message>'
            + b"no " * 100_000 + b"</Message><RequestId>fault</RequestId></Error>")  # 300 KB: more than any socket buffer
    proxy.add(Rule(upload_part, fail=1, status=400, body=huge))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
        status = settle(d)
        assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "failed"}
        error = transfer(status, "step1")["error"]
        assert url in error and "InvalidArgument" in error and len(error) < 5000, error[:300]
        save(c, state(2), fast / "step2" / "rank0.pt")
    status = settle(d)
    assert tier_states(status, "step2") == {"fast": "committed", CLOUD: "committed"}, transfer(status, "step2")
    assert status["tier_transfers"]["uploader"]["started"] == 1  # the same upload process answered both
    assert_state_equal(state(2), datastates.load(f"{url}/run/step2/rank0.pt"))


@pytest.mark.heavy
def test_a_server_that_stops_mid_upload_fails_the_transfer_and_the_daemon_keeps_serving(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket: str) -> None:
    own = Moto(tmp_path / "moto.log")  # this test kills it
    p = FaultProxy(own.port)
    try:
        use_endpoint(monkeypatch, p.url)
        s3_client(own.url).create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/jobs"
        d = start_daemon(**tiers(tmp_path, url))
        held = p.add(Rule(upload_part, hold=True))
        fast = tmp_path / "fast" / "run"
        with Client(d.endpoint, timeout=60) as c:
            save(c, state(1, 5 << 20), fast / "step1" / "rank0.pt")
            wait_for("uploading a part", lambda: held.seen)
            own.kill()  # the server dies with parts in flight
            p.down()
            p.release()
            status = settle(d)
            assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "failed"}
            assert url in transfer(status, "step1")["error"], transfer(status, "step1")
            save(c, state(2), fast / "step2" / "rank0.pt")  # the daemon still serves: the next tag commits on the fast tier
            status = settle(d)
            assert tier_states(status, "step2") == {"fast": "committed", CLOUD: "failed"}
            row = transfer(status, "step2")
            assert url in row["error"] and "connect" in row["error"].lower(), row
            for step, saved in ((1, state(1, 5 << 20)), (2, state(2))):
                got = c.restore(fast, "rank0.pt", tag=f"step{step}")
                assert (got.tag, got.tier) == (f"step{step}", "fast")
                assert_state_equal(saved, got.state)
        assert d.proc.poll() is None
    finally:
        p.release()
        own.kill()


STOP_GUARD_S = 90.0
"""How long the hung-bucket tests wait for what must end well within it (a hang guard, not a timing)."""


@pytest.mark.heavy
@pytest.mark.parametrize("busy", [False, True], ids=["silent", "busy"])
def test_sigterm_ends_the_daemon_while_the_bucket_hangs_and_the_next_daemon_finishes_the_transfer(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str, busy: bool) -> None:
    """A hung server (connections accepted, never answered: silent, so each request fails its tries; or keeping them
    busy, so none ever does): the drain leaves a tier transfer that has not moved for TRANSFER_STALL_S, the daemon
    exits, and the next daemon of the node resumes the transfer and commits the tag on the bucket."""
    from datastates.daemon.tiers import TRANSFER_STALL_S

    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    settle(d)
    hung = proxy.add(Rule(any_request, hang=True, busy=busy))
    saved = state(1)
    with Client(d.endpoint, timeout=60) as c:
        save(c, saved, tmp_path / "fast" / "run" / "step1" / "rank0.pt")
    wait_for("a request to the hung server", lambda: hung.seen)
    began = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        d.proc.wait(STOP_GUARD_S)
    took = time.monotonic() - began
    assert d.proc.poll() == 0, f"the daemon still drains {took:.0f} s after SIGTERM, the bucket hung ({d.proc.poll()})"
    assert took < TRANSFER_STALL_S + 20, f"{took:.0f} s"  # the drain's bound on a stalled transfer, and the exit
    assert "tier transfer(s) for the next daemon" in d.log_text(), d.log_text()[-3000:]
    proxy.clear()
    nxt = start_daemon(**tiers(tmp_path, url))
    assert tier_states(settle(nxt), "step1")[CLOUD] == "committed"
    assert datastates.latest(f"{url}/run") == "step1"
    assert_state_equal(saved, datastates.load(f"{url}/run/step1/rank0.pt"))


@pytest.mark.heavy
def test_a_read_of_a_hung_bucket_gives_up_with_an_error_naming_it(proxy: FaultProxy, bucket: str) -> None:
    """``latest`` and ``load`` of a bucket whose server never answers raise StorageError naming the bucket and how
    long it was waited for (each request: TIMEOUT_TRIES tries of READ_TIMEOUT_S), never wait on."""
    from concurrent.futures import ThreadPoolExecutor

    hung = proxy.add(Rule(any_request, hang=True))
    url = f"s3://{bucket}/jobs/run"
    pool = ThreadPoolExecutor(2)
    try:
        reads = [pool.submit(datastates.latest, url), pool.submit(datastates.load, f"{url}/step1/rank0.pt")]
        errors = [r.exception(timeout=STOP_GUARD_S) for r in reads]
    finally:
        proxy.clear()  # before the pool's end, which waits for its reads
        pool.shutdown()
    for exc in errors:
        assert isinstance(exc, StorageError), repr(exc)
        assert f"s3://{bucket}/" in exc.message and f"{s3_address.READ_TIMEOUT_S:.0f} s" in exc.message, exc.message
    assert hung.seen >= 2 * s3_address.TIMEOUT_TRIES


# -- a daemon killed mid-upload -----------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_a_killed_daemons_uploads_are_aborted_by_the_next_and_no_other_daemons(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc], tmp_path: Path,
        proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    s3 = s3_client(proxy.url)
    cfg_a, cfg_b = tiers(tmp_path, url, fast="fast-a"), tiers(tmp_path, url, fast="fast-b")
    live, doomed = start_daemons(cfg_a, cfg_b)
    hold_a = proxy.add(Rule(lambda m, p, q: upload_part(m, p, q) and "/runa/" in p, hold=True))
    hold_b = proxy.add(Rule(lambda m, p, q: upload_part(m, p, q) and "/runb/" in p, hold=True))
    big = 10 << 20  # 40 MiB: three parts
    with Client(live.endpoint, timeout=60) as a, Client(doomed.endpoint, timeout=60) as b:
        save(a, state(1, big), tmp_path / "fast-a" / "runa" / "step1" / "rank0.pt")
        save(b, state(2, big), tmp_path / "fast-b" / "runb" / "step1" / "rank0.pt")
        wait_for("uploading both tags", lambda: hold_a.seen and hold_b.seen)
        uploader = daemon_status(doomed.endpoint)["tier_transfers"]["uploader"]["pid"]
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
    wait_for("the killed daemon's upload process to end with it", lambda: not alive(uploader), timeout=10)
    hold_b.release()  # the killed daemon's parts reach the server, its upload stays open
    open_uploads = uploads(s3, bucket)
    assert "jobs/runb/step1/rank0.pt" in open_uploads and "jobs/runa/step1/rank0.pt" in open_uploads, open_uploads
    assert f"jobs/runb/step1/{marker_name('step1')}" not in keys(s3, bucket)
    assert datastates.latest(f"{url}/runb") is None
    again = start_daemon(**cfg_b)  # the same node config as the killed one
    settle(again)
    left = uploads(s3, bucket)
    assert "jobs/runb/step1/rank0.pt" not in left, left  # the killed daemon's upload: aborted
    assert "jobs/runa/step1/rank0.pt" in left, left  # the live one's: still open, still its own
    marker = f"jobs/runb/step1/{marker_name('step1')}"
    if marker in keys(s3, bucket):  # the next daemon finished the transfer
        assert datastates.latest(f"{url}/runb") == "step1"
        assert_state_equal(state(2, big), datastates.load(f"{url}/runb/step1/rank0.pt"))
    else:
        assert datastates.latest(f"{url}/runb") is None
    hold_a.release()
    status = settle(live)
    assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "committed"}, transfer(status, "step1")
    assert_state_equal(state(1, big), datastates.load(f"{url}/runa/step1/rank0.pt"))
    assert uploads(s3, bucket) == []


def list_uploads(method: str, path: str, query: str) -> bool:
    return method == "GET" and "uploads" in query.split("&")


def journals_naming(upload_id: str) -> list[str]:
    """The files of this user's daemons folder that name ``upload_id``: the journals that hold it."""
    found = []
    for p in DAEMON_LOCKS.iterdir():
        with contextlib.suppress(FileNotFoundError):  # a lock or journal another daemon's recovery removed meanwhile
            if p.is_file() and upload_id in p.read_text(errors="replace"):
                found.append(p.name)
    return sorted(found)


@pytest.mark.heavy
def test_a_killed_daemons_uploads_stay_journaled_once_until_a_daemon_that_can_list_them_aborts_them(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc], tmp_path: Path,
        proxy: FaultProxy, moto: Moto, bucket: str) -> None:
    """Neither another job's daemon nor the killed daemon's own next one, both unable to list uploads, takes, copies or
    forgets its journal: the daemon after them aborts the upload, and no journal multiplies on the way (a copy per
    daemon that could not list once filled /dev/shm with copies of copies)."""
    url = f"s3://{bucket}/jobs"
    s3 = s3_client(proxy.url)
    cfg_a = tiers(tmp_path, url, fast="fast-a")
    (doomed,) = start_daemons(cfg_a)
    held = proxy.add(Rule(upload_part, hold=True))
    with Client(doomed.endpoint, timeout=60) as a:
        save(a, state(1, 5 << 20), tmp_path / "fast-a" / "runa" / "step1" / "rank0.pt")
        wait_for("uploading a part", lambda: held.seen)
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
    held.release()
    proxy.clear()
    (killed,) = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert killed["Key"] == "jobs/runa/step1/rank0.pt"
    journal = journals_naming(killed["UploadId"])
    assert len(journal) == 1, journal
    refusing = FaultProxy(moto.port)  # an endpoint that refuses to list uploads
    try:
        refusing.add(Rule(list_uploads, fail=-1, status=403))
        other = tiers(tmp_path, f"s3://{bucket}/otherjob", fast="fast-b")
        other["storage"]["tiers"][1]["endpoint"] = refusing.url
        b = start_daemon(**other)  # another job's daemon, which runs on
        settle(b)
        next_a = tiers(tmp_path, url, fast="fast-a")  # the killed daemon's next one, the same roots
        next_a["storage"]["tiers"][1]["endpoint"] = refusing.url
        for _ in range(2):
            again = start_daemon(**next_a)
            settle(again)
            assert again.stop() == 0
        assert refusing.count(list_uploads, 403) >= 3  # each tried, and was refused
        assert killed["UploadId"] in [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        assert journals_naming(killed["UploadId"]) == journal  # kept where it was, once
        last = start_daemon(**cfg_a)  # one that can list, while the other job's daemon still runs
        settle(last)
        assert uploads(s3, bucket) == []  # the killed upload aborted (the next ones' own, completed)
        assert journals_naming(killed["UploadId"]) == []  # and its journal forgotten with it
        assert datastates.latest(f"{url}/runa") == "step1"
        assert_state_equal(state(1, 5 << 20), datastates.load(f"{url}/runa/step1/rank0.pt"))
        assert b.proc.poll() is None
    finally:
        refusing.down()


@pytest.mark.heavy
def test_a_long_lived_daemons_journal_stays_short_and_still_names_its_open_upload_for_the_next_daemon(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """Each upload a daemon starts is journaled until it completes or is aborted; a journal past TRIM_LINES is written
    again with the open uploads alone, so weeks of saves keep it a few KiB in /dev/shm. An upload the server would not
    let it abort stays in it through every trim, for the next daemon to abort."""
    from datastates.protocol.storage.s3.writes import TRIM_LINES

    url = f"s3://{bucket}/jobs"
    s3 = s3_client(proxy.url)
    cfg = tiers(tmp_path, url, keep_last=1)
    d = start_daemon(**cfg)
    fast = tmp_path / "fast" / "run"
    proxy.add(Rule(lambda m, p, q: upload_part(m, p, q) and "/first/" in p, fail=-1, status=403))
    proxy.add(Rule(lambda m, p, q: m == "DELETE" and "uploadId=" in q and "/first/" in p, fail=-1, status=403))
    files = 16
    tags = 2 * TRIM_LINES // files + 1  # uploads enough to pass the threshold twice
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(0, 1 << 10), fast / "first" / "rank0.pt")
        assert transfer(settle(d), "first")["state"] == "failed"
        (left,) = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]  # its abort refused: open on the server
        proxy.clear()
        for step in range(tags):
            for f in range(files):
                c.snapshot(state(step, 1 << 10), fast / f"step{step}" / f"rank{f}.pt", tag=f"step{step}")
            c.wait()
            c.commit(f"step{step}").result(timeout=120)
            settle(d)
    assert [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [left["UploadId"]]
    (name,) = journals_naming(left["UploadId"])  # through every trim
    journal = DAEMON_LOCKS / name
    lines = journal.read_text().splitlines()
    assert len(lines) <= TRIM_LINES < tags * files, f"{len(lines)} lines after {tags * files} uploads"
    assert f"{bucket} {left['UploadId']}" in lines
    assert d.stop() == 0
    settle(start_daemon(**cfg))  # the next daemon of the same roots
    assert uploads(s3, bucket) == []  # the upload left open, aborted
    assert not journal.exists()  # and the stopped daemon's journal forgotten
    assert datastates.latest(f"{url}/run") == f"step{tags - 1}"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_with_upload_priority_idle_the_upload_process_takes_only_idle_cpu_and_the_tag_commits(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    cfg = tiers(tmp_path, url)
    cfg["storage"]["upload_priority"] = "idle"
    d = start_daemon(**cfg)
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), tmp_path / "fast" / "run" / "step1" / "rank0.pt")
    status = settle(d)
    assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "committed"}, transfer(status, "step1")
    pid = status["tier_transfers"]["uploader"]["pid"]
    policies = {t: os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    assert set(policies.values()) == {os.SCHED_IDLE}, policies  # its upload threads too, started after the policy
    assert len(policies) > 1, policies
    assert_state_equal(state(1), datastates.load(f"{url}/run/step1/rank0.pt"))


def test_the_upload_process_killed_mid_upload_fails_that_transfer_alone_and_the_next_tag_reaches_the_bucket(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    held = proxy.add(Rule(upload_part, hold=True))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1, 5 << 20), fast / "step1" / "rank0.pt")  # 20 MiB: two parts
        wait_for("uploading a part", lambda: held.seen)
        uploader = daemon_status(d.endpoint)["tier_transfers"]["uploader"]
        pid = uploader["pid"]
        assert pid and pid != d.proc.pid and uploader["started"] == 1, uploader
        niceness = {t: (os.getpriority(os.PRIO_PROCESS, int(t)), os.sched_getscheduler(int(t)))
                    for t in os.listdir(f"/proc/{pid}/task")}
        assert set(niceness.values()) == {(19, os.SCHED_OTHER)}, niceness  # by default: a small share of a busy core
        os.kill(pid, signal.SIGKILL)
        held.release()
        status = settle(d)
        assert tier_states(status, "step1") == {"fast": "committed", CLOUD: "failed"}
        error = transfer(status, "step1")["error"]
        assert url in error and "upload process" in error and "signal 9" in error, error
        assert uploads(s3_client(proxy.url), bucket) == []  # its multipart upload aborted by the daemon
        # the daemon serves on, and uploads the next tag: a small one, as a nice 19 upload process gets a small share
        # of a busy machine
        save(c, state(2), fast / "step2" / "rank0.pt")
        status = settle(d)
        assert tier_states(status, "step2") == {"fast": "committed", CLOUD: "committed"}, transfer(status, "step2")
        assert status["tier_transfers"]["uploader"]["started"] == 2, status["tier_transfers"]["uploader"]
        got = c.restore(fast, "rank0.pt", tag="step1")  # the tag it failed to upload stands on the fast tier
        assert (got.tag, got.tier) == ("step1", "fast")
        assert_state_equal(state(1, 5 << 20), got.state)
    shown = d.ctl("status").stdout
    assert "upload process ended and was started again (2 in all)" in shown, shown
    assert datastates.latest(f"{url}/run") == "step2"
    assert_state_equal(state(2), datastates.load(f"{url}/run/step2/rank0.pt"))
    assert d.proc.poll() is None


# -- jobs of several nodes ----------------------------------------------------------------------------------------------


def node_tiers(tmp: Path, url: str, node: int, **extra: Any) -> dict[str, Any]:
    """Node ``node``'s config: a fast tier of its own (node-local), the bucket shared."""
    cfg = tiers(tmp, url, fast=f"node{node}-fast")
    cfg["storage"]["tiers"][0]["shared"] = False
    cfg["storage"]["tiers"][1].update(extra)
    return cfg


def save_on_nodes(nodes: list[DaemonProc], tmp: Path, tag: str, states: list[dict[str, Any]]) -> None:
    """Four ranks, two a node, each saving its own file of ``tag`` on its node's fast tier, then all committing."""
    clients = [rank_client(nodes[r // 2], r, 4, 2, 2, job="s3") for r in range(4)]
    try:
        for r, c in enumerate(clients):
            c.snapshot(states[r], tmp / f"node{r // 2}-fast" / "run" / tag / f"rank{r}.pt")
            c.wait()
        for fut in [c.commit(tag) for c in clients]:
            fut.result(timeout=120)
    finally:
        for c in clients:
            c.close()


def test_two_nodes_commit_together_on_the_bucket_and_restore_from_it(
        start_daemons: Callable[..., list[DaemonProc]], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    nodes = start_daemons(*(node_tiers(tmp_path, url, n) for n in range(2)))
    states = [state(20 + r) for r in range(4)]
    save_on_nodes(nodes, tmp_path, "global_step5", states)
    for d in nodes:
        assert tier_states(settle(d), "global_step5") == {"fast": "committed", CLOUD: "committed"}
    folder = "jobs/run/global_step5/"
    marker = json.loads(s3.get_object(Bucket=bucket, Key=folder + marker_name("global_step5"))["Body"].read())
    assert sorted(f["path"] for f in marker["files"]) == [f"rank{r}.pt" for r in range(4)] and marker["node"] == -1
    assert not [k for k in keys(s3, bucket, folder) if "datastates-done." in k]  # node 0 took the done markers away
    assert datastates.latest(f"{url}/run") == "global_step5"
    for r in range(4):  # a new node finds nothing on its disk: every rank's file comes from the bucket, whole
        got = datastates.load(f"{url}/run/global_step5/rank{r}.pt")
        assert_state_equal(states[r], got)


@pytest.mark.heavy
def test_a_node_that_cannot_read_the_bucket_refuses_to_pick_the_step_on_its_own_in_a_job_of_several_nodes(
        start_daemons: Callable[..., list[DaemonProc]], tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    """In a job of several nodes only the shared tiers decide the step every rank restores. A node that cannot read the
    bucket, or only the newest tag's marker there (the others' newness then tells nothing), must say so, not pick from
    what it can read (its own disk may hold a step the others lack, or none, and then start afresh beside ranks that
    restored): one node alone still falls back to its own tiers."""
    url = f"s3://{bucket}/jobs"
    configs = [node_tiers(tmp_path, url, n) for n in range(2)]
    for cfg in configs:  # a shared file system between the node's disk and the bucket, which decides too
        cfg["storage"]["tiers"].insert(1, {"name": "lustre", "path": str(tmp_path / "lustre")})
    nodes = start_daemons(*configs)
    states = {tag: [state(step * 10 + r) for r in range(4)] for step, tag in ((7, "global_step7"), (8, "global_step8"))}
    for tag, saved in states.items():
        save_on_nodes(nodes, tmp_path, tag, saved)
        for d in nodes:
            assert tier_states(settle(d), tag) == {"fast": "committed", "lustre": "committed", CLOUD: "committed"}
    root = tmp_path / "node0-fast" / "run"
    newest_marker = marker_name("global_step8")
    for refusing in (lambda m, p, q: m == "GET" and p.endswith(f"/{newest_marker}"), lambda m, p, q: m == "GET"):
        refused = proxy.add(Rule(refusing, fail=-1, status=403))
        with rank_client(nodes[0], 0, 4, 2, 2, job="s3") as c:
            with pytest.raises(StorageError) as err:
                c.restore(root, "rank0.pt")
            assert f"s3://{bucket}/jobs/run" in str(err.value) and "every node" in str(err.value), str(err.value)
        assert refused.failed > 0
        with Client(nodes[0].endpoint, timeout=60) as alone:  # a job of one node: its own tiers decide
            got = alone.restore(root, "rank0.pt")
            assert (got.tag, got.tier) == ("global_step8", "fast")
        proxy.clear()
    with rank_client(nodes[0], 0, 4, 2, 2, job="s3") as c:
        got = c.restore(root, "rank0.pt")
        assert (got.tag, got.tier) == ("global_step8", "fast")  # the step the shared tiers decide, read from the disk
        assert_state_equal(states["global_step8"][0], got.state)


@pytest.mark.heavy
def test_a_node_whose_upload_fails_leaves_the_tag_uncommitted_on_the_bucket(
        start_daemons: Callable[..., list[DaemonProc]], tmp_path: Path, s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/jobs"
    nodes = start_daemons(dict(node_tiers(tmp_path, url, 0), commit_timeout=3),
                          node_tiers(tmp_path, url, 1, endpoint="http://127.0.0.1:9"))  # node 1 reaches no server
    save_on_nodes(nodes, tmp_path, "global_step6", [state(30 + r) for r in range(4)])
    rows = [transfer(settle(d), "global_step6") for d in nodes]
    assert [r["state"] for r in rows] == ["failed", "failed"], rows
    assert "did not upload" in rows[0]["error"] and "[1]" in rows[0]["error"], rows[0]
    assert marker_name("global_step6") not in " ".join(keys(s3, bucket))  # nothing of the tag is committed there


# -- refusals: credentials, policies, buckets, addresses ----------------------------------------------------------------


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Moto, dict[str, str]]]:
    """An S3 server that checks signatures and policies: a user allowed s3:*, a bucket `open-bucket`, and a bucket
    `deny-bucket` whose policy denies every PutObject."""
    server = Moto(tmp_path_factory.mktemp("moto-iam") / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        iam = boto3.client("iam", endpoint_url=server.url, region_name=REGION, aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="trainer")  # the three unauthenticated actions
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        s3 = s3_client(server.url, key["AccessKeyId"], key["SecretAccessKey"])
        s3.create_bucket(Bucket="open-bucket")
        s3.create_bucket(Bucket="deny-bucket")
        s3.put_bucket_policy(Bucket="deny-bucket", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::deny-bucket/*"}]}))
        yield server, {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        server.kill()


def test_wrong_credentials_are_named_at_start_and_the_fast_tier_keeps_the_tag(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        iam_moto: tuple[Moto, dict[str, str]]) -> None:
    server, user = iam_moto
    wrong = "WRONGsecretKEY-4f1c9b2e77d0"
    use_endpoint(monkeypatch, server.url, user["key"], wrong)
    url = "s3://open-bucket/jobs"
    d = start_daemon(**tiers(tmp_path, url))
    problems = wait_for("the start-up check done", lambda: daemon_status(d.endpoint)["tier_transfers"]["problems"])
    assert list(problems) == [CLOUD] and "credentials were refused" in problems[CLOUD], problems
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
        status = settle(d)
        row = transfer(status, "step1")
        assert row["state"] == "failed" and "credentials were refused" in row["error"] and url in row["error"], row
        got = c.restore(fast, "rank0.pt")
        assert (got.tag, got.tier) == ("step1", "fast")
        assert_state_equal(state(1), got.state)
    shown = d.ctl("status")
    assert f"tier {CLOUD} cannot be written" in shown.stdout and "credentials were refused" in shown.stdout, shown.stdout
    for where, text in (("status", json.dumps(status)), ("ctl status", shown.stdout + shown.stderr),
                        ("daemon log", d.log_text())):
        assert wrong not in text, f"the secret key is in the {where}"
    assert keys(s3_client(server.url, user["key"], user["secret"]), "open-bucket", "jobs/") == {}


def test_a_policy_refusal_and_a_missing_bucket_are_named(
        start_daemons: Callable[..., list[DaemonProc]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        iam_moto: tuple[Moto, dict[str, str]]) -> None:
    server, user = iam_moto
    use_endpoint(monkeypatch, server.url, user["key"], user["secret"])
    denied, missing = start_daemons(tiers(tmp_path, "s3://deny-bucket/jobs", fast="fast-a"),
                                    tiers(tmp_path, "s3://no-such-bucket/jobs", fast="fast-b"))
    problems = wait_for("the start-up check done", lambda: daemon_status(denied.endpoint)["tier_transfers"]["problems"])
    assert "access denied" in problems.get(CLOUD, ""), problems
    problems = wait_for("the start-up check done", lambda: daemon_status(missing.endpoint)["tier_transfers"]["problems"])
    assert "the bucket does not exist" in problems.get(CLOUD, ""), problems
    for d, fast, url in ((denied, "fast-a", "s3://deny-bucket/jobs"), (missing, "fast-b", "s3://no-such-bucket/jobs")):
        with Client(d.endpoint, timeout=60) as c:
            save(c, state(1), tmp_path / fast / "run" / "step1" / "rank0.pt")
            status = settle(d)
            row = transfer(status, "step1")
            assert row["state"] == "failed", row
            cause = "the bucket does not exist" if d is missing else "access denied"
            assert cause in row["error"] and url in row["error"], row
            got = c.restore(tmp_path / fast / "run", "rank0.pt")
            assert (got.tag, got.tier) == ("step1", "fast")
    s3 = s3_client(server.url, user["key"], user["secret"])
    assert f"jobs/run/step1/{marker_name('step1')}" not in keys(s3, "deny-bucket")
    assert datastates.latest("s3://deny-bucket/jobs/run") is None


def test_bad_object_store_tiers_stop_the_daemon_with_a_clear_error(tmp_path: Path) -> None:
    fast = {"name": "fast", "path": str(tmp_path / "fast")}
    cases = {
        "upper": ([fast, {"name": CLOUD, "path": "s3://UPPER/x"}], "storage.tiers[1].path", "not a bucket name"),
        "empty": ([fast, {"name": CLOUD, "path": "s3://"}], "storage.tiers[1].path", "not a bucket name"),
        "scheme": ([fast, {"name": CLOUD, "path": "gs://b/p"}], "storage.tiers[1].path", "unknown scheme 'gs'"),
        "first": ([{"name": CLOUD, "path": "s3://okay-bucket/x"}, fast], "storage.tiers[0].path", "the first tier"),
        "alone": ([{"name": CLOUD, "path": "s3://okay-bucket/x"}], "storage.tiers[0].path", "the first tier"),
        "endpoint": ([fast, {"name": CLOUD, "path": "s3://okay-bucket/x", "endpoint": "localhost:9000"}],
                     "storage.tiers[1].endpoint", "is not http://HOST[:PORT]"),
        "region": ([fast, {"name": CLOUD, "path": "s3://okay-bucket/x", "region": "us east 1"}],
                   "storage.tiers[1].region", "is not a region name"),
        "local": ([fast, {"name": CLOUD, "path": "s3://okay-bucket/x", "shared": False}],
                  "storage.tiers[1].shared", "seen by every node"),
        "priority": ({"tiers": [fast, {"name": CLOUD, "path": "s3://okay-bucket/x"}], "upload_priority": "high"},
                     "storage.upload_priority", "must be one of low, idle"),
    }
    argvs = {}
    for case, (storage, _, _) in cases.items():
        config = tmp_path / f"{case}.yaml"
        storage = storage if isinstance(storage, dict) else {"tiers": storage}
        config.write_text(json.dumps({"endpoint": f"ipc://{tmp_path}/{case}.sock", "storage": storage}))
        argvs[case] = ["--node-config", str(config)]
    runs = run_datastatesd_many(argvs)
    for case, (_, key, message) in cases.items():
        out = refused_run(runs[case])
        assert out.returncode == 2 and key in out.stderr and message in out.stderr, (case, out.returncode, out.stderr)
