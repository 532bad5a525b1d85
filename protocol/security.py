"""Who may talk to a daemon: ipc sockets in a private folder, or tcp with CURVE keys.

An ipc socket is guarded by the file system: its folder is mode 0700 (``daemon/main.py``).
A tcp port is open to every host that reaches it, so the daemon binds one only with
ZeroMQ CURVE: traffic is encrypted, a client must know the daemon's public key, and the
daemon's ZAP handler admits only the client public keys found in its authorized folder.
Certificates are the files ``zmq.auth.create_certificates`` writes: ``NAME.key`` holds the
public key, ``NAME.key_secret`` both keys. See docs/security.md.
"""

from __future__ import annotations

import logging
import os

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from .errors import ConfigError

SERVER_KEY_ENV = "DATASTATES_CURVE_SERVER_KEY"
"""Client side: the path of the daemon's public certificate (its ``.key`` file)."""
CLIENT_CERT_ENV = "DATASTATES_CURVE_CLIENT_CERT"
"""Client side: the path of this client's secret certificate (its ``.key_secret`` file)."""
ZAP_DOMAIN = "datastates"

log = logging.getLogger("datastatesd.auth")


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def _read_certificate(path: str, what: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read the certificate {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ConfigError(f"{what}: {path} is not a ZeroMQ certificate (make one with zmq.auth.create_certificates)") from None


def load_public_key(path: str, what: str) -> bytes:
    """The public key of the certificate at ``path``; ``what`` names the setting in errors."""
    return _read_certificate(path, what)[0]


def load_keypair(path: str, what: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate; a public-only ``.key`` file is refused."""
    public, secret = _read_certificate(path, what)
    if secret is None:
        raise ConfigError(f"{what}: {path} holds only a public key; give the secret certificate (the .key_secret file)")
    return public, secret


def authorized_keys(folder: str, what: str) -> set[bytes]:
    """The public keys of every ``*.key`` certificate in ``folder``: the clients a tcp daemon admits.

    Whoever can write the folder can admit themselves, so a folder other users may write is refused.
    """
    try:
        st = os.stat(folder)
        keys = set(zmq.auth.load_certificates(folder))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read the folder {folder}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc} (every *.key file there must be a client's public certificate)") from None
    if st.st_mode & 0o022:
        raise ConfigError(f"{what}: {folder} is writable by other users (mode {oct(st.st_mode & 0o777)}), "
                          "who could authorize their own keys; chmod go-w it")
    if not keys:
        raise ConfigError(f"{what}: {folder} holds no client public certificate (*.key); copy each client's .key file there")
    return keys


def secure_client(sock: zmq.Socket, endpoint: str) -> None:
    """Set up ``sock`` to authenticate to the daemon at ``endpoint`` before it connects.

    ipc needs nothing (the socket's folder is private). tcp needs both CURVE variables: the
    daemon's public key, so the client talks to the right daemon, and the client's keypair,
    which the daemon checks against its authorized folder.
    """
    if not is_tcp(endpoint):
        return
    server_key, client_cert = os.environ.get(SERVER_KEY_ENV), os.environ.get(CLIENT_CERT_ENV)
    missing = [f"${name}" for name, value in ((SERVER_KEY_ENV, server_key), (CLIENT_CERT_ENV, client_cert)) if not value]
    if missing:
        raise ConfigError(
            f"{endpoint} is a tcp endpoint, which needs CURVE keys: set ${SERVER_KEY_ENV} to the daemon's public "
            f"certificate (NAME.key) and ${CLIENT_CERT_ENV} to this client's secret certificate (NAME.key_secret); "
            f"unset: {' and '.join(missing)} (see docs/security.md)"
        )
    sock.curve_serverkey = load_public_key(server_key, f"${SERVER_KEY_ENV}")
    sock.curve_publickey, sock.curve_secretkey = load_keypair(client_cert, f"${CLIENT_CERT_ENV}")


class _AuthorizedKeys:
    """The ZAP callback: a client passes only if its public key was in the authorized folder at start."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.keys = authorized_keys(folder, "curve.authorized_clients")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        log.warning("refused a tcp client: its CURVE public key %s is not in %s", key.decode(), self.folder)
        return False


def secure_server(sock: zmq.Socket, server_secret_key: str, authorized_clients: str) -> AsyncioAuthenticator:
    """Make ``sock`` a CURVE server that admits only the authorized clients; call it before bind.

    It starts a ZAP handler on the running asyncio loop and sets ZAP_ENFORCE_DOMAIN, so a
    missing handler refuses every client instead of admitting any. Stop the returned
    authenticator after the socket is closed.
    """
    public, secret = load_keypair(server_secret_key, "curve.server_secret_key")
    auth = AsyncioAuthenticator(sock.context, log=log)
    auth.configure_curve_callback(ZAP_DOMAIN, _AuthorizedKeys(authorized_clients))
    auth.start()
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True
    return auth
