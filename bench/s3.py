"""The S3 tier: the daemon's upload and datastates' reads against boto3's best, and what the
background upload costs a training loop. Against a local moto_server, started (and stopped) here.

Why: with ``storage.tiers`` ending in an ``s3://`` tier, a tag committed on the fast tier is
uploaded behind the training (a multipart upload per file, 16 MiB parts, 8 at once, marker
object last). That copy should go as fast as the best an S3 client does with the same bytes,
reads from S3 likewise, and it should not slow the trainer. Per run (contenders interleaved):

1. upload: one tag of ``--files`` files, ``--mib`` MiB in all, committed on the fast tier
   (a folder under /var/tmp); timed from the fast tier's commit to the S3 tier's "committed"
   (daemon_status polled every 20 ms). Against boto3 uploading the same files: ``upload_file``
   with TransferConfig(16 MiB parts, max_concurrency 8 and 16), and create_multipart_upload +
   upload_part of 16 MiB parts on a pool of 8 threads. Ratio: ours / best client, in throughput.
2. download: ``datastates.load(url)`` of each file (fresh buffers) and ``load(url, into=...)``
   (into preallocated tensors), against boto3's ranged downloads: ``download_fileobj`` into a
   BytesIO, and ranged GETs (64 MiB) on 8 threads into a preallocated buffer. Ratio: ours / the
   best of those, in throughput. Shown beside them, not in the ratio: ``get_object`` of the whole
   object, one GET each, read into a preallocated buffer (``Body.readinto``): the fastest on moto
   (see the caveat), not a ranged parallel download. And ``load``, which returns new tensors,
   against the same ranged GETs into buffers allocated for that read (their pages faulted in as
   they fill, as a new tensor's are).
3. our fast-tier commit (snapshot, wait, commit) against ``torch.save`` (fsynced), DCP
   ``save`` (single process, fsynced) and a raw O_DIRECT write of the same bytes on the same disk.
4. training: an MLP with AdamW trained on the CPU for ``--steps`` steps, checkpointed every
   ``--every`` steps (snapshot, then ``wait()`` right before the next optimizer step, then
   commit), against a daemon whose tiers end in the S3 tier and one whose only tier is the
   fast one (otherwise the same config); runs alternate on/off. Ratio: median step time on / off.
   ``--pin`` puts the trainer on CPU 0 and everything else on the others, as a GPU node leaves
   its daemon cores the trainer does not use.

Caveat, moto: the server runs on this machine, in one Python process, so its CPU (parsing
the parts, MD5s, TLS) competes with the trainer, which a remote S3 does not; during the
training runs it is put under SCHED_IDLE (``--moto-training idle``, the default), so it takes
only the CPU the trainer leaves, and the bench prints the CPU seconds moto and the daemon
took. The transfers are measured with moto at the normal policy. And moto answers a ranged
GET by reading the whole object first, so on moto each ranged GET costs as much as a GET of
the whole object: the bench measures that once (one range against the whole) and prints it.
Over HTTPS by default (a self-signed certificate made here, trusted through AWS_CA_BUNDLE),
as S3 is; ``--http`` for plain HTTP, where botocore also signs every part's payload (SHA-256).

Ratios measured in one run are what count: other work on this machine moves absolute figures.
The last line is the figures as JSON.

Example: .venv/bin/python bench/s3.py --mib 256 --runs 1
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, fsync_tree, median, raw_write, state_bytes, wait_pool_mapped  # noqa: E402
from train_overhead import build  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

BUCKET = "ckpt"
PREFIX = "jobs"
PART = 16 << 20
POLL_S = 0.02
MOTO = os.path.join(os.path.dirname(sys.executable), "moto_server")
CLK = os.sysconf("SC_CLK_TCK")


TRAIN_MODES = {"on": "S3 tier on", "off": "S3 tier off", "boto3": "off + boto3 uploads"}

# ---------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(folder: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, written in ``folder``: moto's HTTPS, trusted by AWS_CA_BUNDLE."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    paths = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(paths[0], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths[1], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths


def start_moto(port: int, tls: tuple[str, str] | None) -> subprocess.Popen:
    """moto_server on ``port``, over HTTPS with ``tls`` (certificate, key) where given."""
    proc = subprocess.Popen([MOTO, "-H", "127.0.0.1", "-p", str(port), *(["-s", "-c", tls[0], "-k", tls[1]] if tls else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=tls[0]) if tls else None
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode} (port {port} taken?)")
        try:
            urllib.request.urlopen(f"{'https' if tls else 'http'}://127.0.0.1:{port}/", timeout=1, context=context).read()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("moto_server did not answer in 30 s")


class CountRequests:
    """Counts the S3 requests this process makes (botocore's Endpoint.make_request), by operation; GETs with a Range
    apart."""

    def __enter__(self) -> dict[str, int]:
        from botocore.endpoint import Endpoint

        self.counts: dict[str, int] = {}
        self.orig = orig = Endpoint.make_request
        counts, lock = self.counts, threading.Lock()

        def make_request(endpoint: Any, operation_model: Any, request_dict: dict[str, Any]) -> Any:
            name = operation_model.name
            if name == "GetObject" and "Range" in request_dict.get("headers", {}):
                name = "GetObject ranged"
            with lock:
                counts[name] = counts.get(name, 0) + 1
            return orig(endpoint, operation_model, request_dict)

        Endpoint.make_request = make_request  # type: ignore[method-assign]
        return self.counts

    def __exit__(self, *_: Any) -> None:
        from botocore.endpoint import Endpoint

        Endpoint.make_request = self.orig  # type: ignore[method-assign]


def set_policy(pid: int, policy: int) -> None:
    """Every thread of process ``pid`` (and those it starts later, which inherit it) under CPU policy ``policy``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except ProcessLookupError:
            pass  # a request's thread that just ended


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (and those they start later, which inherit it) on ``cpus`` alone."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a request's thread that just ended


def daemon_cpu_s(endpoint: str) -> float:
    """CPU seconds of the daemon at ``endpoint`` so far, its upload process's included."""
    from datastates.client import daemon_status
    status = daemon_status(endpoint)
    uploader = status["tier_transfers"].get("uploader", {}).get("pid")
    return cpu_s(status["daemon"]["pid"]) + (cpu_s(uploader) if uploader else 0.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


# ---------------------------------------------------------------- daemon side

def tier_entry(endpoint: str, tag: str) -> dict[str, Any] | None:
    from datastates.client import daemon_status

    for entry in daemon_status(endpoint)["tier_transfers"]["tags"]:
        if entry["tag"] == tag:
            return entry
    return None


def wait_cloud(endpoint: str, tag: str, timeout: float = 3600) -> tuple[float, dict[str, Any]]:
    """Poll every POLL_S until ``tag``'s cloud tier is committed; the time it was seen so, and the tier's entry."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        entry = tier_entry(endpoint, tag)
        if entry is not None:
            cloud = next(t for t in entry["tiers"] if t["tier"] == "cloud")
            if cloud["state"] == "committed":
                return time.perf_counter(), cloud
            if cloud["state"] in ("failed", "superseded"):
                raise RuntimeError(f"tag {tag}: the S3 tier's transfer is {cloud['state']}: {cloud.get('error')}")
        time.sleep(POLL_S)
    raise RuntimeError(f"tag {tag}: not committed on the S3 tier after {timeout} s")


def wait_idle(endpoint: str) -> None:
    from datastates.client import daemon_status

    while daemon_status(endpoint)["tier_transfers"]["pending"]:
        time.sleep(POLL_S)


# ---------------------------------------------------------------- boto3 side

def s3_client(pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=pool))


def upload_file(s3: Any, paths: list[str], prefix: str, concurrency: int) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=concurrency)
    for p in paths:
        s3.upload_file(p, BUCKET, f"{prefix}/{os.path.basename(p)}", Config=cfg)


def upload_parts(s3: Any, paths: list[str], prefix: str, threads: int) -> None:
    """create_multipart_upload + upload_part (16 MiB parts read with os.pread) on a pool of ``threads``, per file."""
    with ThreadPoolExecutor(threads) as pool:
        for p in paths:
            key = f"{prefix}/{os.path.basename(p)}"
            size = os.path.getsize(p)
            uid = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
            fd = os.open(p, os.O_RDONLY)
            try:
                def part(i: int) -> dict[str, Any]:
                    data = os.pread(fd, min(PART, size - i * PART), i * PART)
                    r = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=uid, PartNumber=i + 1, Body=data)
                    return {"PartNumber": i + 1, "ETag": r["ETag"]}

                parts = list(pool.map(part, range(max(1, math.ceil(size / PART)))))
            finally:
                os.close(fd)
            s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})


def delete_prefix(s3: Any, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def download_fileobj(s3: Any, keys: list[str], _: list[memoryview]) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    for k in keys:
        bio = io.BytesIO()
        s3.download_fileobj(BUCKET, k, bio, Config=cfg)
        del bio


def readinto_all(body: Any, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        n = body.readinto(buf[done:])  # botocore's StreamingBody wraps urllib3's, which reads into a buffer
        if not n:
            raise RuntimeError(f"short read: {done} of {len(buf)} bytes")
        done += n


def get_whole(s3: Any, keys: list[str], bufs: list[memoryview]) -> None:
    for k, buf in zip(keys, bufs):
        body = s3.get_object(Bucket=BUCKET, Key=k)["Body"]
        readinto_all(body._raw_stream, buf)


def get_ranged(s3: Any, keys: list[str], bufs: list[memoryview], step: int = 64 << 20, threads: int = 8) -> None:
    with ThreadPoolExecutor(threads) as pool:
        for k, buf in zip(keys, bufs):
            def rng(off: int) -> None:
                end = min(off + step, len(buf))
                body = s3.get_object(Bucket=BUCKET, Key=k, Range=f"bytes={off}-{end - 1}")["Body"]
                readinto_all(body._raw_stream, buf[off:end])

            list(pool.map(rng, range(0, len(buf), step)))


class Uploader:
    """boto3's own best upload (``upload_fileobj``, 16 MiB parts, 8 at once) of each committed file, in a process of
    its own under SCHED_IDLE, as the daemon's upload threads are, the newest file first (older ones waiting are
    dropped, as the daemon supersedes them): what uploading the same bytes costs the trainer with the library alone."""

    def __init__(self, prefix: str) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--upload-worker", prefix],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        self.fds: list[int] = []

    def committed(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)  # open now: the fast tier's keep_last may delete it before it goes up
        with self.lock:
            self.fds.append(fd)
            self.proc.stdin.write(f"/proc/{os.getpid()}/fd/{fd} {os.path.basename(os.path.dirname(path))}\n")
            self.proc.stdin.flush()

    def drain(self) -> list[str]:
        """Wait until every file sent is uploaded or dropped: each one's fate, sorted."""
        with self.lock:
            self.proc.stdin.write("drain\n")
            self.proc.stdin.flush()
            fates = self.proc.stdout.readline().split()
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()
        return sorted(fates)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def upload_worker(prefix: str) -> int:
    """``--upload-worker PREFIX``: upload each "PATH TAG" line read from stdin, the newest waiting only; "drain"
    waits for every one sent and answers their fates on one line."""
    from boto3.s3.transfer import TransferConfig

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    s3 = s3_client()
    cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    waiting: list[tuple[str, str]] = []
    fates: list[str] = []
    received = [0]
    cond = threading.Condition()

    def work() -> None:
        while True:
            with cond:
                while not waiting:
                    cond.wait()
                path, tag = waiting.pop()
                fates.extend(["superseded"] * len(waiting))
                waiting.clear()
            try:
                with open(path, "rb") as f:
                    s3.upload_fileobj(f, BUCKET, f"{prefix}/{tag}/rank0.pt", Config=cfg)
                fate = "uploaded"
            except Exception as exc:  # noqa: BLE001 - said in the fates, so a drain never waits for it
                fate = f"failed:{type(exc).__name__}"
            with cond:
                fates.append(fate)
                cond.notify_all()

    threading.Thread(target=work, daemon=True).start()
    for line in sys.stdin:
        with cond:
            if line.strip() == "drain":
                while len(fates) < received[0]:
                    cond.wait()
                print(" ".join(fates), flush=True)
                fates.clear()
                received[0] = 0
                continue
            path, tag = line.split()
            waiting.append((path, tag))
            received[0] += 1
            cond.notify_all()
    return 0


# ---------------------------------------------------------------- states

def file_states(mib: int, files: int) -> list[dict[str, Any]]:
    """``files`` states of ``mib / files`` MiB each: 4 fp32 tensors apiece and a step count."""
    per = (mib << 20) // files // 4 // 4  # elements per tensor
    g = torch.Generator().manual_seed(0)
    return [{"layers": {f"w{j}": torch.empty(per).uniform_(-1, 1, generator=g) for j in range(4)},
             "step": 100 + i} for i in range(files)]


def zeros_like_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# ---------------------------------------------------------------- training

def train(endpoint: str, folder: str, args: argparse.Namespace, seed: int,
          committed: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One timed loop: each step's seconds; checkpoints snapshot after a step, wait() before the next opt.step(),
    then commit; ``committed`` is called with each committed file's path, from the thread that learns it."""
    from datastates.client import Client

    setup = build(args.params, args.layers, args.batch, seed)  # train_overhead.py's MLP
    model, opt, x, y = setup.model, setup.opt, setup.x, setup.y

    def fwd_bwd() -> None:
        F.mse_loss(model(x), y).backward()

    for _ in range(2):  # AdamW makes its state on its first step
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
    steps: list[float] = []
    fences: list[float] = []
    futures = []
    pending: str | None = None
    nbytes = 0
    with Client(endpoint, timeout=600) as client:
        def commit(tag: str) -> Any:
            future = client.commit(tag)
            if committed is not None:
                path = os.path.join(folder, tag, "rank0.pt")
                future.add_done_callback(lambda f: f.exception() is None and committed(path))
            return future

        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            fwd_bwd()
            if pending is not None:
                t1 = time.perf_counter()
                client.wait()
                fences.append(time.perf_counter() - t1)
                futures.append(commit(pending))
                pending = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.every == 0:
                pending = f"s{seed}-step{step}"
                h = client.snapshot({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                                    os.path.join(folder, pending, "rank0.pt"), tag=pending)
                nbytes = h.nbytes
            steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if pending is not None:
            client.wait()
            futures.append(commit(pending))
        for f in futures:
            f.result()
        drain = time.perf_counter() - t0
    del model, opt
    gc.collect()
    return {"step_s": sum(steps) / len(steps), "drain_s": drain, "checkpoints": len(futures), "ckpt_bytes": nbytes,
            "fence_s": sum(fences), "steps_ms": [round(1e3 * t, 1) for t in steps]}


# ---------------------------------------------------------------- main

def main() -> int:
    if sys.argv[1:2] == ["--upload-worker"]:
        return upload_worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help="the tag's size for upload/download, MiB (default 2048)")
    ap.add_argument("--files", type=int, default=8, help="files in that tag (default 8: 256 MiB each at the default)")
    ap.add_argument("--runs", type=int, default=3, help="runs; medians reported (default 3)")
    ap.add_argument("--port", type=int, default=0, help="moto_server's port (default: a free one)")
    ap.add_argument("--steps", type=int, default=40, help="training: timed steps per run (default 40)")
    ap.add_argument("--every", type=int, default=10, help="training: checkpoint every N steps (default 10)")
    ap.add_argument("--params", type=float, default=24, help="training: millions of fp32 parameters (default 24: "
                    "a checkpoint of ~0.29 GB with the AdamW state)")
    ap.add_argument("--layers", type=int, default=6, help="training: Linear layers (default 6)")
    ap.add_argument("--batch", type=int, default=256, help="training: rows per step (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="training: torch.set_num_threads (default 2: every core "
                    "of this machine, the worst case; 1 leaves a core free, as a GPU trainer leaves its node's cores)")
    ap.add_argument("--skip-transfers", action="store_true", help="only the training runs")
    ap.add_argument("--http", action="store_true", help="moto over plain HTTP (default HTTPS, as S3 is: over HTTP "
                    "botocore also signs every part's payload with a SHA-256, which costs the node's CPU)")
    ap.add_argument("--upload-priority", choices=("low", "idle"), default="low", help="the S3 tier's "
                    "storage.upload_priority in the training runs: its upload process at nice 19, or under SCHED_IDLE")
    ap.add_argument("--moto-training", choices=("idle", "normal"), default="idle", help="moto_server's CPU policy "
                    "during the training runs (default idle: SCHED_IDLE, so it takes only the CPU the trainer leaves, "
                    "as a remote S3 takes none of the node's; normal: it competes with the trainer for the 2 cores)")
    ap.add_argument("--pin", action="store_true", help="training: the trainer on CPU 0, and everything else (the "
                    "daemons, their upload process, moto_server, boto3's uploader) on the other CPUs, as a GPU node "
                    "gives its daemon cores the trainer does not use; with --threads 1")
    ap.add_argument("--raw-threads", type=int, default=2, help="threads of the raw O_DIRECT write (default 2)")
    ap.add_argument("--root", default=os.environ.get("TMPDIR", "/var/tmp"), help="where the temp folder goes "
                    "(default $TMPDIR or /var/tmp); removed at the end")
    args = ap.parse_args()
    if min(args.mib, args.files, args.runs, args.steps, args.every) < 1 or (args.mib << 20) // args.files < (1 << 20):
        ap.error("--mib, --files, --runs, --steps, --every must be >= 1, and each file at least 1 MiB")
    others = os.sched_getaffinity(0) - {0}
    if args.pin and (args.threads != 1 or 0 not in os.sched_getaffinity(0) or not others):
        ap.error("--pin needs --threads 1, and CPU 0 and another CPU to run on")
    torch.set_num_threads(args.threads)

    port = args.port or free_port()
    work = tempfile.mkdtemp(prefix="ds-bench-s3-", dir=args.root)
    fast = os.path.join(work, "fast")
    tls = None if args.http else self_signed(work)
    os.environ.update(AWS_ENDPOINT_URL=f"{'http' if args.http else 'https'}://127.0.0.1:{port}",
                      AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      **({"AWS_CA_BUNDLE": tls[0]} if tls else {}))  # the daemons inherit these
    import datastates
    from datastates.client import Client, daemon_status

    moto = start_moto(port, tls)
    times: dict[str, list[float]] = {}
    train_runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": [], "boto3": []}
    extra: dict[str, Any] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    try:
        s3 = s3_client()
        s3.create_bucket(Bucket=BUCKET)
        states = file_states(args.mib, args.files)
        nbytes = sum(state_bytes(s) for s in states)
        names = [f"rank{i}.pt" for i in range(args.files)]
        print(f"tag: {args.files} files, {nbytes / 1e9:.2f} GB of tensors; {args.runs} runs; moto on port {port}; "
              f"temp {work}; {'HTTP' if args.http else 'HTTPS'}", flush=True)
        common = {"host_memory": "1GiB", "memory_restore": "none"}
        cloud_tiers = {"tiers": [{"name": "fast", "path": fast, "keep_last": 1},
                                 {"name": "cloud", "path": f"s3://{BUCKET}/{PREFIX}", "keep_last": 1}]}

        # ---- upload, download, fast-tier commit vs torch.save / DCP / raw
        if not args.skip_transfers:
            with datastatesd(work, **common, storage=cloud_tiers) as ep, Client(ep, timeout=600) as client:
                wait_pool_mapped(ep)
                into = [zeros_like_state(s) for s in states]
                bufs: list[memoryview] = []
                for r in range(args.runs):
                    tag = f"u{r}"
                    wait_idle(ep)
                    gc.collect()
                    # ours: snapshot + wait + commit on the fast tier, then the background upload
                    t0 = time.perf_counter()
                    for name, st in zip(names, states):
                        client.snapshot(st, os.path.join(fast, "run", tag, name), tag=tag)
                    client.wait()
                    client.commit(tag).result()
                    t_commit = time.perf_counter()
                    t_cloud, entry = wait_cloud(ep, tag)
                    add("commit on fast tier", t_commit - t0)
                    add("upload: datastates tier", t_cloud - t_commit)
                    sent = entry["bytes_total"]
                    paths = [os.path.join(fast, "run", tag, n) for n in names]
                    file_bytes = sum(os.path.getsize(p) for p in paths)
                    if sent != file_bytes:
                        print(f"note: the S3 tier's bytes_total {sent} != the files' {file_bytes}")

                    # peers of the fast-tier commit, on the same disk
                    ts = os.path.join(work, "ts")
                    os.makedirs(ts)
                    t0 = time.perf_counter()
                    for name, st in zip(names, states):
                        torch.save(st, os.path.join(ts, name))
                    fsync_tree(ts)
                    add("torch.save (fsync)", time.perf_counter() - t0)
                    shutil.rmtree(ts)
                    t0 = time.perf_counter()
                    dcp.save({f"r{i}": st for i, st in enumerate(states)}, checkpoint_id=os.path.join(work, "dcp"),
                             no_dist=True)
                    fsync_tree(os.path.join(work, "dcp"))
                    add("dcp.save (fsync)", time.perf_counter() - t0)
                    shutil.rmtree(os.path.join(work, "dcp"))
                    add("raw O_DIRECT write", raw_write(os.path.join(work, "raw.bin"), file_bytes, args.raw_threads))

                    # boto3 uploads of the same files
                    ups: dict[str, Callable[[], None]] = {
                        "upload: boto3 upload_file c8": lambda: upload_file(s3, paths, "client/a", 8),
                        "upload: boto3 upload_file c16": lambda: upload_file(s3, paths, "client/b", 16),
                        "upload: boto3 parts pool8": lambda: upload_parts(s3, paths, "client/c", 8),
                    }
                    for name, fn in ups.items():
                        gc.collect()
                        t0 = time.perf_counter()
                        fn()
                        add(name, time.perf_counter() - t0)
                    for p in ("client/a", "client/b", "client/c"):
                        delete_prefix(s3, p)
                    print(f"run {r + 1}/{args.runs} upload: " + ", ".join(
                        f"{n.split(': ')[1]} {times[n][-1]:.2f} s" for n in ["upload: datastates tier", *ups]), flush=True)

                    # downloads of the tag's objects
                    urls = [f"s3://{BUCKET}/{PREFIX}/run/{tag}/{n}" for n in names]
                    keys = [f"{PREFIX}/run/{tag}/{n}" for n in names]
                    if not bufs:
                        sizes = [s3.head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in keys]
                        bufs = [memoryview(bytearray(n)) for n in sizes]  # preallocated and touched: the client's best
                    gc.collect()
                    t0 = time.perf_counter()
                    got = [datastates.load(u) for u in urls]
                    add("download: datastates load", time.perf_counter() - t0)
                    if r == 0 and not all(same(a, b) for a, b in zip(states, got)):
                        raise RuntimeError("datastates.load from S3 returned other values than were saved")
                    del got
                    gc.collect()
                    t0 = time.perf_counter()
                    for u, st in zip(urls, into):
                        datastates.load(u, into=st)
                    add("download: datastates load into", time.perf_counter() - t0)
                    if r == 0 and not all(same(a, b) for a, b in zip(states, into)):
                        raise RuntimeError("datastates.load(into=) from S3 left other values than were saved")
                    gc.collect()
                    t0 = time.perf_counter()  # each file by its own thread at once, as a node's ranks restore
                    with ThreadPoolExecutor(len(urls)) as ex:
                        list(ex.map(lambda job: datastates.load(job[0], into=job[1]), zip(urls, into)))
                    add("download: datastates load into, files at once", time.perf_counter() - t0)
                    downs: dict[str, Callable[[], None]] = {
                        "download: boto3 download_fileobj": lambda: download_fileobj(s3, keys, bufs),
                        "whole GET: boto3 get_object readinto": lambda: get_whole(s3, keys, bufs),
                        "download: boto3 ranged 64MiB x8": lambda: get_ranged(s3, keys, bufs),
                        # as ``load`` must: into memory allocated for this read, its pages faulted in as they fill
                        "fresh: boto3 ranged 64MiB x8 into new buffers":
                            lambda: get_ranged(s3, keys, [memoryview(bytearray(len(b))) for b in bufs]),
                    }
                    for name, fn in downs.items():
                        gc.collect()
                        t0 = time.perf_counter()
                        fn()
                        add(name, time.perf_counter() - t0)
                    print(f"run {r + 1}/{args.runs} download: " + ", ".join(
                        f"{n.split(': ')[1]} {times[n][-1]:.2f} s" for n in times if n.startswith(("download", "whole", "fresh"))),
                        flush=True)

                # moto's ranged GET: one 8 MiB range of the first object against the whole object
                k, size = keys[0], len(bufs[0])
                one = min(8 << 20, size)
                t0 = time.perf_counter()
                s3.get_object(Bucket=BUCKET, Key=k, Range=f"bytes=0-{one - 1}")["Body"].read()
                t_range = time.perf_counter() - t0
                t0 = time.perf_counter()
                readinto_all(s3.get_object(Bucket=BUCKET, Key=k)["Body"]._raw_stream, bufs[0])
                t_whole = time.perf_counter() - t0
                extra["moto_range"] = {"object_mib": size / 2**20, "range_mib": one / 2**20, "range_s": t_range,
                                       "whole_s": t_whole}
                # the requests one load of one object makes (each a whole-object read on moto)
                with CountRequests() as n_load:
                    datastates.load(urls[0])
                with CountRequests() as n_into:
                    datastates.load(urls[0], into=into[0])
                extra["requests_per_object"] = {"load": n_load, "load into": n_into}
                del into, bufs
                gc.collect()

        # ---- training with the S3 tier on and off
        if args.moto_training == "idle":
            set_policy(moto.pid, os.SCHED_IDLE)
        if args.pin:  # the daemons and boto3's uploader inherit this thread's CPUs as they start
            pin(moto.pid, others)
            os.sched_setaffinity(0, others)
        fast_only = {"tiers": [{"name": "fast", "path": fast + "-t", "keep_last": 1}]}
        cloud_t = {"tiers": [{"name": "fast", "path": fast + "-t", "keep_last": 1},
                             {"name": "cloud", "path": f"s3://{BUCKET}/{PREFIX}-t", "keep_last": 1}],
                   "upload_priority": args.upload_priority}
        with datastatesd(work, **common, storage=cloud_t) as on_ep, datastatesd(work, **common, storage=fast_only) as off_ep:
            wait_pool_mapped(on_ep)
            wait_pool_mapped(off_ep)
            uploader = Uploader(f"{PREFIX}-b")
            if args.pin:
                os.sched_setaffinity(0, {0})  # the trainer: this thread, and the client's threads it starts
            try:
                for r in range(args.runs):
                    modes = ["on", "off", "boto3"]
                    for mode in modes[r % 3:] + modes[:r % 3]:  # each first in turn
                        wait_idle(on_ep)
                        ep = on_ep if mode == "on" else off_ep
                        spent = (lambda: cpu_s(uploader.proc.pid)) if mode == "boto3" else lambda: daemon_cpu_s(ep)
                        c0 = (cpu_s(moto.pid), spent())
                        t0 = time.perf_counter()
                        res = train(ep, os.path.join(fast + "-t", mode), args, seed=r,
                                    committed=uploader.committed if mode == "boto3" else None)
                        wait_idle(ep)
                        if mode == "on":
                            tags = daemon_status(on_ep)["tier_transfers"]["tags"]
                            res["s3_states"] = sorted(t["state"] for e in tags if e["tag"].startswith(f"s{r}-")
                                                      for t in e["tiers"] if t["tier"] == "cloud")
                        elif mode == "boto3":
                            res["s3_states"] = uploader.drain()
                            delete_prefix(s3, f"{PREFIX}-b")  # as the tier's keep_last does: moto keeps all in memory
                        res["uploader_cpu_s"] = spent() - c0[1]  # the daemon, or boto3's process: the upload's cost
                        res["moto_cpu_s"] = cpu_s(moto.pid) - c0[0]
                        res["until_uploaded_s"] = time.perf_counter() - t0
                        train_runs[mode].append(res)
                        print(f"run {r + 1}/{args.runs} training, {TRAIN_MODES[mode]:<22}: step "
                              f"{1e3 * res['step_s']:7.1f} ms, {res['checkpoints']} checkpoints of "
                              f"{res['ckpt_bytes'] / 1e9:.2f} GB, fences {res['fence_s']:.2f} s, drain "
                              f"{res['drain_s']:.2f} s; moto {res['moto_cpu_s']:.1f} CPU s, "
                              f"{'daemon' if mode != 'boto3' else 'boto3'} {res['uploader_cpu_s']:.1f} CPU s"
                              + (f"; S3: {', '.join(res['s3_states'])}" if mode != "off" else ""), flush=True)
            finally:
                uploader.close()
    finally:
        moto.terminate()
        try:
            moto.wait(30)
        except subprocess.TimeoutExpired:
            moto.kill()
            moto.wait()
        shutil.rmtree(work, ignore_errors=True)

    # ---- report
    med = {n: median(t) for n, t in times.items()}
    width = max((len(n) for n in med), default=0) + 1
    print(f"\nmedians of {args.runs} runs, {nbytes / 1e9:.2f} GB ({args.files} files):")
    for name, seconds in med.items():
        print(f"  {name:<{width}} {seconds:8.3f} s  {nbytes / seconds / 1e9:6.3f} GB/s")
    ratios: dict[str, float] = {}
    up_best = down_best = ""
    if not args.skip_transfers:
        up_best = min((n for n in med if n.startswith("upload: boto3")), key=med.__getitem__)
        down_best = min((n for n in med if n.startswith("download: boto3")), key=med.__getitem__)  # ranged reads
        ratios["upload ours/best client (throughput)"] = med[up_best] / med["upload: datastates tier"]
        ratios["download load ours/best client (throughput)"] = med[down_best] / med["download: datastates load"]
        ratios["download load ours/boto3 ranged into new buffers"] = \
            med["fresh: boto3 ranged 64MiB x8 into new buffers"] / med["download: datastates load"]
        ratios["download load-into ours/best client (throughput)"] = \
            med[down_best] / med["download: datastates load into"]
        ratios["download load-into, files at once, ours/best client"] = \
            med[down_best] / med["download: datastates load into, files at once"]
        for peer in ("torch.save (fsync)", "dcp.save (fsync)", "raw O_DIRECT write"):
            ratios[f"fast-tier commit time / {peer}"] = med["commit on fast tier"] / med[peer]
    on, off, b3 = ([x["step_s"] for x in train_runs[m]] for m in ("on", "off", "boto3"))
    ratios["training step time S3 on / off"] = median([a / b for a, b in zip(on, off)])
    ratios["training step time boto3 uploads / off"] = median([a / b for a, b in zip(b3, off)])
    ratios["training step time S3 on / boto3 uploads"] = median([a / b for a, b in zip(on, b3)])
    if not args.skip_transfers:
        print(f"  best client upload: {up_best.split(': ')[1]}; best client download: {down_best.split(': ')[1]}")
    print()
    for name, v in ratios.items():
        print(f"  {name:<52} {v:7.3f}")
    for name, (xs, ys) in {"S3 on / off": (on, off), "boto3 uploads / off": (b3, off)}.items():
        per_run = [a / b for a, b in zip(xs, ys)]
        if len(per_run) > 1:  # the machine's own noise, which a ratio near 1 must be read against
            print(f"  training {name}, run by run: mean {statistics.mean(per_run):.3f} ± "
                  f"{statistics.stdev(per_run) / math.sqrt(len(per_run)):.3f} (standard error), from "
                  f"{min(per_run):.3f} to {max(per_run):.3f}")
    mr = extra.get("moto_range", {})
    if mr:
        print(f"\nmoto: one {mr['range_mib']:.0f} MiB ranged GET of a {mr['object_mib']:.0f} MiB object took "
              f"{mr['range_s']:.3f} s, the whole object {mr['whole_s']:.3f} s (moto reads the whole object for each "
              f"range: ranged reads, as datastates.load makes, cost about a whole GET each on moto, not on S3)")
        print(f"S3 requests of one load of one {mr['object_mib']:.0f} MiB object: load "
              f"{extra['requests_per_object']['load']}, load into {extra['requests_per_object']['load into']}; "
              "a boto3 get_object: 1")
    cpu = {m: (median([x["moto_cpu_s"] for x in train_runs[m]]), median([x["uploader_cpu_s"] for x in train_runs[m]]))
           for m in train_runs}
    print(f"training: {args.steps} steps, checkpoint every {args.every}, {args.threads} torch thread(s); step "
          f"{1e3 * median(on):.1f} ms with the S3 tier, {1e3 * median(off):.1f} ms without, {1e3 * median(b3):.1f} ms "
          f"without but boto3 uploading the same files; CPU s per run (medians): S3 tier on: moto {cpu['on'][0]:.1f}, "
          f"daemon {cpu['on'][1]:.1f}; off: daemon {cpu['off'][1]:.1f}; boto3 uploads: moto {cpu['boto3'][0]:.1f}, "
          f"boto3 {cpu['boto3'][1]:.1f} (the daemon as off); on this {os.cpu_count()}-core machine"
          + ("; the trainer on CPU 0, all else on the others" if args.pin else ""))
    print(json.dumps({"bytes": nbytes, "files": args.files, "runs": args.runs,
                      "medians_s": {n: round(v, 4) for n, v in med.items()},
                      "ratios": {n: round(v, 4) for n, v in ratios.items()},
                      "best_client": {"upload": up_best, "download": down_best},
                      "moto_range": {k: round(v, 4) for k, v in mr.items()},
                      "requests_per_object": extra.get("requests_per_object", {}), "moto_training": args.moto_training, "https": not args.http, "pin": args.pin,
                      "training": {m: [{k: v for k, v in x.items()} for x in xs] for m, xs in train_runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
