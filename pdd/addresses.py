"""`HOST:PORT` addresses as deployment files, routes and flags write them (a leaf module:
the config, the line emulator and the command lines all read addresses the same way)."""

from __future__ import annotations

from typing import Any


def parse_addr(text: str) -> tuple[str, int]:
    """Parse `HOST:PORT` (IPv6 hosts in brackets)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host, int(port)


def callable_at(addr: Any) -> bool:
    """Whether `addr` is an address one can connect to: "HOST:PORT" with a port."""
    try:
        return isinstance(addr, str) and parse_addr(addr)[1] > 0
    except ValueError:
        return False


UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")  # a socket can listen on these; nobody can be told to call them
