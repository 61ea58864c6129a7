"""Test certificates and tokens: a CA, a server certificate for localhost and 127.0.0.1,
a client certificate, a second CA that signed neither, and two tokens (full and
read-only), made with `cryptography` in a directory of the test's."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TOKEN = "f3a9c1d2e4b5a6978877665544332211"
READ_TOKEN = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"


# ---------------------------------------------------------------------------- certificates
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    token: Path
    read_token: Path


def make_pki(directory: Path) -> Pki:
    files: dict[str, bytes] = {}
    cas = {}
    for name in ("ca", "other_ca"):
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ripples test {name}")])
        cas[name] = (subject, key)
        files[name] = _certificate(f"ripples test {name}", key, subject, key,
                                   ca=True).public_bytes(serialization.Encoding.PEM)
    subject, ca_key = cas["ca"]
    for name, server in (("server", True), ("client", False)):
        key = _key()
        files[f"{name}_key"] = _pem_key(key)
        files[f"{name}_cert"] = _certificate(f"ripples {name}", key, subject, ca_key,
                                             server=server).public_bytes(
                                                 serialization.Encoding.PEM)
    files["token"] = f"{TOKEN}\n".encode()
    files["read_token"] = f"{READ_TOKEN}\n".encode()
    for name, data in files.items():
        (directory / f"{name}.pem").write_bytes(data)
    return Pki(**{name: directory / f"{name}.pem" for name in files})
