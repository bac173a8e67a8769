"""Optional TLS under the framed protocol (`[tls]` in the deployment file).

Frames are authenticated with HMAC either way; TLS adds confidentiality for the
prompts, tokens and KV that cross networks we do not own. Both ends present a
certificate and verify the other's against the configured CA (mutual TLS). Peers are
addressed by the IPs in the deployment file, so the CA, not a host name, is what
identifies a peer: host names are not checked.

`pdd cert` makes a self-signed pair (its own CA) for tests and labs.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import ssl
import sys
from pathlib import Path
from typing import Protocol


class TLSPaths(Protocol):
    """What TLS needs of the deployment's `[tls]` (`pdd.config.TLSSpec`): the files, and
    whether they are given."""

    @property
    def cert(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def ca(self) -> str: ...

    @property
    def enabled(self) -> bool: ...


def server_context(tls: TLSPaths) -> ssl.SSLContext | None:
    if not tls.enabled:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TLSPaths) -> ssl.SSLContext | None:
    if not tls.enabled:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # peers are IPs from the config; the CA identifies them
    ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def make_self_signed(out: Path, days: int, hosts: list[str]) -> tuple[Path, Path]:
    """A P-256 key and a self-signed certificate for `hosts` (its own CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdd deployment")])
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / "cert.pem", out / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cert", help="make a self-signed certificate and key for [tls] (tests and labs)")
    p.add_argument("--out", default="pdd-tls", help="directory for cert.pem and key.pem")
    p.add_argument("--days", type=int, default=30)
    p.add_argument(
        "--host",
        action="append",
        default=None,
        help="host name or IP the certificate names (repeatable; default 127.0.0.1 and localhost)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.days < 1:
        print("pdd cert: --days must be at least 1", file=sys.stderr)
        return 2
    cert, key = make_self_signed(Path(args.out), args.days, args.host or ["127.0.0.1", "localhost"])
    print(
        f'certificate {cert}\nkey {key}\nin the deployment file:\n[tls]\ncert = "{cert}"\nkey = "{key}"\nca = "{cert}"'
    )
    return 0
