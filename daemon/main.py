"""``datastatesd``: load the node config, bind the endpoint, serve until shutdown or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import signal
import sys

import torch
import uvloop
import zmq
import zmq.asyncio

from datastates.protocol.errors import ConfigError, DatastatesError

from . import config
from .server import Daemon

log = logging.getLogger("datastatesd")


def _prepare_endpoint(endpoint: str) -> int:
    """Make the socket's folder private (0700) and take a lock so two daemons never share it."""
    path = endpoint.removeprefix("ipc://")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700)
    st = os.stat(folder)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"endpoint folder {folder} must belong to this user with mode 0700 (it is {oct(st.st_mode & 0o777)}, "
            f"uid {st.st_uid}), so no other user can connect: give the socket a folder of its own"
        )
    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise ConfigError(f"another datastatesd is already serving {endpoint}") from None
    return lock


async def _serve(cfg: config.NodeConfig) -> None:
    daemon = Daemon(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_shutdown)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(cfg.endpoint)
    log.info("datastatesd %d ready on %s, roots %s, host_memory %d bytes", os.getpid(), cfg.endpoint, cfg.storage.roots, cfg.host_memory)
    try:
        await daemon.serve(sock)
    finally:
        sock.close()
        ctx.term()
        daemon.engine.close()
        log.info("datastatesd stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="datastatesd", description="The per-node datastates checkpoint daemon.")
    parser.add_argument("--node-config", metavar="PATH", help="node.yaml (default: built-in defaults)")
    args = parser.parse_args(argv)
    try:
        cfg = config.load(args.node_config)
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s datastatesd %(levelname)s %(message)s")
        lock = _prepare_endpoint(cfg.endpoint)
    except DatastatesError as exc:
        print(f"datastatesd: error: {exc.message}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # parallelism comes from copy_threads, not from intra-op threads
    try:
        uvloop.run(_serve(cfg))
    finally:
        sock_path = cfg.endpoint.removeprefix("ipc://")
        if os.path.exists(sock_path):
            os.unlink(sock_path)  # still under our lock, so no other daemon's socket
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
