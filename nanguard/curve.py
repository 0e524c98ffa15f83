"""CurveZMQ, as an option: an encrypted link to a coordinator that proves who it is.

With ``NANGUARD_CURVE_SECRET_KEY`` on the coordinator and the matching public key
(``NANGUARD_CURVE_PUBLIC_KEY``) on the ranks and operator commands, ZeroMQ encrypts every
connection (CurveZMQ: Curve25519 keys, a fresh short-term key pair per connection), so nobody on the
network reads hosts, reasons or incident paths, nor replays or injects anything; and a rank or an
operator only completes a connection with the coordinator that holds the secret key. Clients make
a fresh key pair per socket and the coordinator accepts any client key: who may say what stays the
tokens' job (``wire.py``), so only the coordinator's public key has to be handed out, and it is no
secret. ``nanguard keys`` makes a pair. No torch.
"""

from __future__ import annotations

import zmq

def keypair() -> tuple[str, str]:
    """A new (public, secret) key pair, as Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def public_key(secret: str) -> str:
    """The public key that goes with ``secret``."""
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


def serve(sock: zmq.Socket, secret: str) -> None:
    """Make ``sock`` (before it binds) a CurveZMQ server holding ``secret``."""
    sock.curve_server = True
    sock.curve_secretkey = secret.encode("ascii")


def connect(sock: zmq.Socket, server_public: str) -> None:
    """Make ``sock`` (before it connects) a CurveZMQ client of the server whose public key this
    is, with a key pair of its own made now."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_public.encode("ascii")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
