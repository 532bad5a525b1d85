"""``datastatesd``: load the node config, bind the endpoint, serve until shutdown or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import fcntl
import gc
import io
import logging
import os
import resource
import signal
import sys
import threading
import traceback

import uvloop
import zmq
import zmq.asyncio

from datastates.protocol.endpoint import runtime_dir
from datastates.protocol.errors import ConfigError, DatastatesError
from datastates.protocol.security import is_tcp, secure_server

from . import config, fsops

log = logging.getLogger("datastatesd")


def _private_folder(folder: str, fix: str) -> None:
    """Create ``folder`` with mode 0700 if it is missing; refuse one that other users can enter."""
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700)
    st = os.stat(folder)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"endpoint folder {folder} must belong to this user with mode 0700 (it is {oct(st.st_mode & 0o777)}, "
            f"uid {st.st_uid}), {fix}"
        )


def _prepare_endpoint(endpoint: str) -> int:
    """Take a lock so two daemons never share an endpoint, in a folder (0700) no other user can enter.

    An ipc socket lives beside its lock, so the private folder also keeps other users from
    connecting. A tcp port is locked in the per-user runtime folder (CURVE guards the port
    itself); another user's daemon on the same port fails at bind instead.
    """
    if is_tcp(endpoint):
        folder = runtime_dir()
        _private_folder(folder, "so no other user can take its locks")
        lock_path = os.path.join(folder, f"tcp-{endpoint.rsplit(':', 1)[1]}.lock")
    else:
        path = endpoint.removeprefix("ipc://")
        _private_folder(os.path.dirname(os.path.abspath(path)),
                        "so no other user can connect: give the socket a folder of its own")
        lock_path = path + ".lock"
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise ConfigError(f"another datastatesd is already serving {endpoint}") from None
    return lock


FEW_DESCRIPTORS = 4096
"""Below this hard limit, a burst of connections can exhaust the daemon's descriptors, and ZeroMQ then aborts."""
ENOUGH_DESCRIPTORS = 65536
"""The limit a daemon allowed to raise its hard limit (CAP_SYS_RESOURCE: root) takes when the hard one is lower."""


def _raise_fd_limit() -> None:
    """Take every descriptor allowed: each connection costs one, and ZeroMQ aborts on EMFILE (``ipc_listener.cpp``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < ENOUGH_DESCRIPTORS:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ENOUGH_DESCRIPTORS, ENOUGH_DESCRIPTORS))
        except (ValueError, OSError):
            pass  # not privileged: the hard limit stays
        else:
            log.info("raised the open-files limits from %d (soft) and %d (hard) to %d", soft, hard, ENOUGH_DESCRIPTORS)
            return
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("raised the open-files limit from %d to its hard limit %d", soft, hard)
    if hard != resource.RLIM_INFINITY and hard < FEW_DESCRIPTORS:
        log.warning("the open-files hard limit is %d: that many connections at once would abort the daemon "
                    "(raise it with ulimit -Hn, LimitNOFILE= or docker --ulimit nofile=)", hard)


def _raise_memlock_limit() -> None:
    """Take all the locked memory allowed: committed replicas are locked in memory where it suffices (daemon/replica/locks.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))


def _log_stacks() -> None:
    """On SIGUSR2: every thread's stack (by name) and every task's, in the log, for a daemon that seems stuck
    (``kill -USR2 <pid>``; it goes on serving). faulthandler writes the threads' stacks to stderr first, at once:
    this record waits for the event loop's thread to be free."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"SIGUSR2: {len(names)} thread(s), stacks follow"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)).rstrip())
    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(file=out)
        lines.append(out.getvalue().rstrip())
    log.warning("\n".join(lines))


async def _serve(cfg: config.NodeConfig) -> None:
    from .server import Daemon  # torch, seconds to import: after the config is known to be good

    fsops.install()
    daemon = Daemon(cfg)
    gc.freeze()  # torch's and the daemon's start-up objects, never garbage: full collections skip them from now on
    gc.set_threshold(*GC_THRESHOLDS)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_shutdown)
    loop.add_signal_handler(signal.SIGUSR2, _log_stacks)
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=True)  # at once, even with the loop's thread held
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    auth = secure_server(sock, cfg.curve.server_secret_key, cfg.curve.authorized_clients) if is_tcp(cfg.endpoint) else None
    sock.bind(cfg.endpoint)
    log.info("datastatesd %d ready on %s, owner %s, roots %s, host_memory %d bytes", os.getpid(), cfg.endpoint,
             daemon.instance.owner, cfg.storage.roots, cfg.host_memory)
    try:
        await daemon.serve(sock)
    finally:
        sock.close()
        if auth is not None:
            auth.stop()
        ctx.term()
        daemon.engine.close()
        daemon.replicas.close()
        daemon.instance.close()
        log.info("datastatesd stopped")


GC_THRESHOLDS = (100_000, 20, 100)
"""Python's automatic collection, much less often than its default (700, 10, 10): a snapshot of 100,000 tensors
makes a million short-lived objects as it is decoded and planned, none of them in a cycle, and the default
collected 0.9 of a second's worth of them over and over (in the daemon's 5.4 s of Python for it)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="datastatesd", description="The per-node datastates checkpoint daemon.")
    parser.add_argument("--node-config", metavar="PATH", help="node.yaml (default: built-in defaults)")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # from the start: SIGUSR2's default action would end it
    try:
        cfg = config.load(args.node_config)
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s datastatesd %(levelname)s %(message)s")
        for chatty in ("botocore", "boto3", "urllib3", "s3transfer"):  # their debug lines hold signed request headers
            logging.getLogger(chatty).setLevel(max(logging.INFO, logging.getLogger().level))
        config.make_roots(cfg)
        lock = _prepare_endpoint(cfg.endpoint)
    except DatastatesError as exc:
        print(f"datastatesd: error: {exc.message}", file=sys.stderr)
        return 2
    import torch  # after the config check, so a bad config is refused at once

    torch.set_num_threads(1)  # parallelism comes from copy_threads, not from intra-op threads
    _raise_fd_limit()
    _raise_memlock_limit()
    try:
        uvloop.run(_serve(cfg))
    finally:
        sock_path = cfg.endpoint.removeprefix("ipc://")
        if not is_tcp(cfg.endpoint) and os.path.exists(sock_path):
            os.unlink(sock_path)  # still under our lock, so no other daemon's socket
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
