"""The local channel between a pdd instance and the vLLM processes it runs.

vLLM builds our KV connector twice, in processes pdd does not own: a scheduler-side
one in the engine core and a worker-side one in every worker (one per tensor-parallel
rank). They reach the pdd instance that started them over this channel: a Unix socket
in a directory only its owner can enter, each connection opened with a random token
the instance handed vLLM in the connector's config. A message is a JSON header (what
to do), with the descriptors of a staging region riding along where one is handed over
(`pdd.engines.vllm.staging`: KV itself crosses through that shared memory, never this
socket); nothing received is unpickled or evaluated, and every size is checked before
it is read.

Both ends are plain blocking sockets with a reader thread: the connector runs inside
vLLM's synchronous loops, and the instance must answer while it is still blocked
building the engine (the workers connect during vLLM's start-up).
"""

from __future__ import annotations

import array
import ctypes
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"PDVB"
_FRAME = struct.Struct("!4sI")  # magic, header length
MAX_HEADER_BYTES = 4 << 20  # block lists of a long request
HELLO_TIMEOUT_S = 10.0
MAX_FDS = 4  # descriptors one message may carry
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


class BridgeError(ConnectionError):
    """The channel broke or carried something that is not a bridge message."""


class Channel:
    """One connection: sends from any thread, receives on one."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._fds: list[int] = []  # descriptors received, not yet handed out with their message

    def send(self, header: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        """One message; `fds` (open descriptors, e.g. a staging region's) ride with its first
        bytes as SCM_RIGHTS, and the header says how many (`"fds"`)."""
        if fds:
            header = {**header, "fds": len(fds)}
        body = json.dumps(header, separators=(",", ":")).encode()
        first = _FRAME.pack(MAGIC, len(body)) + body
        with self._lock:
            if fds:
                sent = socket.send_fds(self._sock, [first], list(fds))
                self._sock.sendall(first[sent:])
            else:
                self._sock.sendall(first)

    def recv(self) -> dict[str, Any]:
        """One message; descriptors that came with it are in its header's `"fds"`, a list."""
        magic, hlen = _FRAME.unpack(self._read(_FRAME.size))
        if magic != MAGIC or hlen > MAX_HEADER_BYTES:
            raise BridgeError("not a bridge frame, or one over the size limits")
        try:
            header = json.loads(self._read(hlen))
        except ValueError as e:
            raise BridgeError(f"bridge header is not JSON: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            raise BridgeError("bridge header is not an object with an op")
        fds, self._fds = self._fds, []
        if header.get("fds", 0) != len(fds):
            for fd in fds:
                os.close(fd)
            raise BridgeError(f"bridge message names {header.get('fds', 0)} descriptors and carried {len(fds)}")
        if fds:
            header["fds"] = fds
        return header

    def _read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k, ancillary, _, _ = self._sock.recvmsg_into([view[got:]], _ANCILLARY)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self._fds += array.array("i", data[: len(data) - len(data) % 4])
            if k == 0:
                raise BridgeError("bridge closed")
            got += k
        return buf

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def die_with_parent() -> None:
    """Have the kernel kill this process when the one that started it dies (Linux).

    vLLM's engine core and workers are processes of the instance's: an instance that is
    killed (or stops while vLLM's teardown hangs) must not leave them running, holding
    memory and cores, with nothing to talk to."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def connect(path: str, token: str, hello: dict[str, Any]) -> Channel:
    """A connector's channel to its instance: the token proves it was started by it."""
    die_with_parent()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    channel = Channel(sock)
    channel.send({"op": "hello", "token": token, **hello})
    return channel


def serve_forever(channel: Channel, on_message: Callable[[dict[str, Any]], None], name: str) -> threading.Thread:
    """Read `channel` on a daemon thread, handing each message to `on_message`, until it closes."""

    def run() -> None:
        try:
            while True:
                on_message(channel.recv())
        except (BridgeError, OSError) as e:
            log.debug("%s: bridge ended: %s", name, e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class BridgeServer:
    """The instance's end: accepts the connectors' connections in `directory`.

    `on_message(peer, header)` runs on the connection's reader thread; `peer`
    is the connection's hello (its side and rank) with `channel` added.
    """

    def __init__(
        self,
        directory: str,
        on_message: Callable[[dict[str, Any], dict[str, Any]], None],
        on_lost: Callable[[dict[str, Any]], None],
    ) -> None:
        os.chmod(directory, 0o700)
        self.path = os.path.join(directory, "bridge.sock")
        self.token = secrets.token_hex(16)
        self._on_message, self._on_lost = on_message, on_lost
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._channels: list[Channel] = []
        threading.Thread(target=self._accept, name="vllm-bridge", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="vllm-bridge-peer", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        channel = Channel(sock)
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = channel.recv()
            if hello.get("op") != "hello" or not hmac.compare_digest(str(hello.get("token", "")), self.token):
                raise BridgeError("bad bridge hello")
        except (BridgeError, OSError) as e:
            log.warning("refused a bridge connection: %s", e)
            channel.close()
            return
        sock.settimeout(None)
        peer = {k: v for k, v in hello.items() if k not in ("op", "token")} | {"channel": channel}
        self._channels.append(channel)
        try:
            self._on_message(peer, {"op": "hello"})
            while True:
                self._on_message(peer, channel.recv())
        except (BridgeError, OSError) as e:
            log.debug("bridge peer %s gone: %s", {k: v for k, v in peer.items() if k != "channel"}, e)
        finally:
            self._on_lost(peer)

    def close(self) -> None:
        self._sock.close()
        for channel in self._channels:
            channel.close()
