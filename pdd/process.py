"""A pdd server process: which launch it belongs to, as its `/health` says, its log and
its environment's settings.

`pdd up` waits for each child's `/health`; a port held by another server (vLLM's API
server on 8000, a deployment left running) would answer it too, and `pdd up` would take
that server for its own router or instance. So `pdd up` gives its children a launch id
in their environment, every pdd server's `/health` says it back with its pid, and a
`/health` that answers without it is someone else's.
"""

from __future__ import annotations

import logging
import os
import socket

from pdd.errors import Mistake

LAUNCH_ENV = "PDD_LAUNCH_ID"  # set by `pdd up` for the processes it starts


def identity() -> dict[str, object]:
    """What a pdd server's `/health` says of its process."""
    return {"pid": os.getpid(), "launch": os.environ.get(LAUNCH_ENV, "")}


def configure() -> None:
    """Log at `PDD_LOG`'s level (DEBUG, INFO, WARNING, ERROR; INFO when unset), and check
    `PDD_PROTOCOL` (a version this release speaks): a value that is none of them is a
    `Mistake`, before anything starts."""
    from pdd.transfer.wire import offered_protocol

    level = os.environ.get("PDD_LOG", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise Mistake(f"PDD_LOG={os.environ['PDD_LOG']!r} is not one of DEBUG, INFO, WARNING, ERROR")
    try:
        offered_protocol()
    except ValueError as e:
        raise Mistake(str(e)) from None
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def listen(host: str, port: int) -> socket.socket:
    """A server's HTTP socket, bound and listening: taken before its model loads, so a
    port in use is a `Mistake` in a second, not after minutes of loading."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise Mistake(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None
