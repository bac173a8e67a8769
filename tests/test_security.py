"""Inter-instance TLS (`[tls]`, `pdd cert`) and where a deployment listens."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from procs import HTTP, pdd_up

from pdd.config import TLSSpec, load
from pdd.transfer.tls import client_context, make_self_signed, server_context
from pdd.transfer.wire import (
    FramedConnection,
    MsgType,
    client_handshake,
    connection_key,
    open_connection,
    serve,
    server_handshake,
)

KEY = b"k" * 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> TLSSpec:
    out = tmp_path_factory.mktemp("tls")
    done = subprocess.run([sys.executable, "-m", "pdd.cli", "cert", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "key.pem").stat().st_mode & 0o077 == 0  # the key is the owner's alone
    return TLSSpec(str(out / "cert.pem"), str(out / "key.pem"), str(out / "cert.pem"))


async def _echo(conn: FramedConnection) -> None:
    await server_handshake(conn)
    frame = await conn.next_frame()
    await conn.send(MsgType.TOKENS, frame.payload)


def _trusting_client(ca: str, cert_key: tuple[Path, Path] | None) -> ssl.SSLContext:
    """A client that trusts the deployment's CA, so it never refuses the server itself,
    presenting `cert_key` (or no certificate at all): a refusal is then the server's."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.check_hostname = False
    if cert_key is not None:
        ctx.load_cert_chain(*cert_key)
    return ctx


async def _exchange(port: int, tls: ssl.SSLContext | None, key: bytes = KEY, send: bool = True) -> bytes:
    """HELLO, then (`send`) a TOKENS frame; the first frame that comes back. A real
    instance sends a router its cache snapshot unasked, and drops a connection whose
    payload is no message (this one): there `send` is False, or its drop races the send
    (a CI run's ConnectionResetError)."""
    conn = await open_connection("127.0.0.1", port, key, tls=tls, connect_timeout=5)
    try:
        await asyncio.wait_for(client_handshake(conn, {"role": "router"}), 5)
        if send:
            await conn.send(MsgType.TOKENS, b"over tls")
        return (await asyncio.wait_for(conn.next_frame(), 5)).payload
    finally:
        conn.close()


def test_frames_cross_tls_and_nothing_else_gets_in(pair, tmp_path):
    other = make_self_signed(tmp_path / "other", 1, ["127.0.0.1"])
    stranger = TLSSpec(str(other[0]), str(other[1]), str(other[0]))

    async def go() -> None:
        server = await serve(_echo, "127.0.0.1", 0, KEY, tls=server_context(pair))
        port = server.sockets[0].getsockname()[1]
        try:
            assert await _exchange(port, client_context(pair)) == b"over tls"
            with pytest.raises((ConnectionError, OSError, asyncio.TimeoutError)):  # plain TCP: no TLS handshake
                await _exchange(port, None)
            with pytest.raises(ssl.SSLError):  # a certificate the CA did not sign
                await _exchange(port, client_context(stranger))
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(go())


def test_the_server_refuses_a_client_without_a_certificate_its_ca_signed(pair, tmp_path):
    """Mutual TLS is the server's check too: a client that trusts the right CA but
    presents a certificate another CA signed, or none, never reaches a frame handler."""
    foreign = make_self_signed(tmp_path / "foreign", 1, ["127.0.0.1"])
    handled: list[bytes] = []

    async def echo(conn: FramedConnection) -> None:
        await server_handshake(conn)
        handled.append((await conn.next_frame()).payload)
        await conn.send(MsgType.TOKENS, handled[-1])

    async def go() -> None:
        server = await serve(echo, "127.0.0.1", 0, KEY, tls=server_context(pair))
        port = server.sockets[0].getsockname()[1]
        try:
            assert await _exchange(port, _trusting_client(pair.ca, (Path(pair.cert), Path(pair.key)))) == b"over tls"
            for cert_key in (foreign, None):
                with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError)):
                    await _exchange(port, _trusting_client(pair.ca, cert_key))
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(go())
    assert handled == [b"over tls"]  # only the client with the deployment's certificate got in


def test_tls_settings_come_together_or_not_at_all():
    with pytest.raises(ValueError):
        TLSSpec(cert="c.pem")
    with pytest.raises(ValueError):
        TLSSpec(cert="c.pem", key="k.pem")
    assert not TLSSpec().enabled and server_context(TLSSpec()) is None


def _listening(pid: int) -> list[str]:
    """The addresses a process listens on (from /proc: its socket inodes in tcp/tcp6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                raw = bytes.fromhex(cols[1].split(":")[0])
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(socket.inet_ntop(family, words))
    return out


def test_a_tls_deployment_serves_and_listens_only_where_its_config_says(pair, tmp_path):
    conf = tmp_path / "tls.toml"
    conf.write_text(f'mode = "pd-cross-dc"\n[tls]\ncert = "{pair.cert}"\nkey = "{pair.key}"\nca = "{pair.ca}"\n')
    with pdd_up("--config", str(conf)) as dep:
        r = HTTP.post(f"{dep.url}/v1/completions", json={"model": "tiny", "prompt": "over the line", "max_tokens": 12,
                                                          "ignore_eos": True, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        deployed = load(dep.run_dir / "deployment.toml")
        md0, key = deployed.instance("md0"), connection_key(deployed.secret, "instances")
        # with the deployment's own key, a router's HELLO over TLS gets MD's first frame (its cache
        # snapshot); the same over plain TCP is refused: only the missing TLS can refuse it
        assert asyncio.run(_exchange(md0.kv_port, client_context(pair), key, send=False))
        with pytest.raises((ConnectionError, OSError, asyncio.TimeoutError)):  # its framed port speaks only TLS
            asyncio.run(_exchange(md0.kv_port, None, key, send=False))
        addresses = {name: _listening(pid) for name, pid in dep.pids.items()}
    assert all(addresses.values()), addresses
    assert {a for found in addresses.values() for a in found} == {"127.0.0.1"}, addresses
