"""The control plane's security: what both sides read, the token and TLS files.

Threat model and deployment: docs/security.md. In short: everything that talks to the
coordinator over gRPC (workers, host launchers, `ripples checkpoint`, the dashboard) may
be encrypted (TLS, the coordinator's certificate checked against a CA; mutual TLS as an
option) and must show a token when the coordinator has one; the data plane (the
rendezvous TCPStore and gloo/NCCL, as in every torch.distributed job) is neither, and
stays on a private network.

**Tokens.** The coordinator holds a token (`--token-file FILE`, else the file named by
RIPPLES_TOKEN_FILE, else the value of RIPPLES_TOKEN), and optionally a read-only one
(`--read-token-file`) that may only read (GetRunStatus, ListRuns, GetLogs, Consensus):
a dashboard's. Every call carries `authorization: Bearer <token>`; one server
interceptor compares it in constant time before any handler runs, so a refused call
(UNAUTHENTICATED: missing or wrong; PERMISSION_DENIED: a read-only token on a call that
changes the run) leaves no trace in the run. gRPC health checking (grpc.health.v1) needs
no token: probes carry none, and it tells nothing about the run.

**Clients** find their settings in the environment (RIPPLES_TOKEN_FILE or RIPPLES_TOKEN,
RIPPLES_TLS_CA, RIPPLES_TLS_CLIENT_CERT, RIPPLES_TLS_CLIENT_KEY), which every `ripples`
command sets from its flags (`--token-file`, `--tls-ca`, ...) before it starts anything,
so that the worker processes it launches inherit them. A token read from a file travels
to children as the file's path, never as its value. Tokens never appear in logs, reprs
or error messages.

The parts: this module holds what both sides read (the variables' names, the token and
TLS files, checked before gRPC sees them); `client_security.py` a client's channels,
`server_security.py` the coordinator's credentials and token check, `http_tokens.py`
the same tokens on the HTTP endpoints.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from ripples.files import read_regular_file
from ripples.v1 import coordinator_pb2 as pb

ENV_TOKEN = "RIPPLES_TOKEN"
ENV_TOKEN_FILE = "RIPPLES_TOKEN_FILE"
ENV_TLS_CA = "RIPPLES_TLS_CA"
ENV_TLS_CLIENT_CERT = "RIPPLES_TLS_CLIENT_CERT"
ENV_TLS_CLIENT_KEY = "RIPPLES_TLS_CLIENT_KEY"

SERVICES: tuple[str, ...] = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())
"""The coordinator's gRPC services: ripples.v1.Worker, ripples.v1.Runs, ripples.v1.Agents
(health checking answers for each)."""
AUTHORIZATION_HEADER = "authorization"
"""The metadata key of a call's bearer token."""

MAX_SECRET_BYTES = 4096
"""A token file holds one word: anything longer is the wrong file."""
MAX_PEM_BYTES = 1 << 20
"""A certificate chain or key in PEM is a few kilobytes."""


def read_secret(path: str | os.PathLike[str], what: str = "token") -> str:
    """The secret in a file (surrounding whitespace dropped); ValueError naming the file
    (never the content) when it is unreadable, not a small regular file, or empty."""
    data = read_regular_file(path, MAX_SECRET_BYTES, what=f"{what} file")
    try:
        value = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"the {what} file {path} is not text: a {what} is one word") from None
    if not value:
        raise ValueError(f"the {what} file {path} is empty")
    if any(c.isspace() for c in value):
        raise ValueError(f"the {what} file {path} holds whitespace inside its value: a "
                         f"{what} is one word")
    return value


def read_pem(path: str, what: str) -> bytes:
    """A certificate or key file, whole (ValueError naming it when it is not a small
    regular file)."""
    return read_regular_file(path, MAX_PEM_BYTES, what=what)


def check_tls_files(cert_file: str, key_file: str, ca_files: tuple[tuple[str, str], ...],
                    *, cert_option: str, key_option: str) -> None:
    """ValueError naming the file and the option unless `cert_file` holds a certificate,
    `key_file` its unencrypted private key, and each (file, option) of `ca_files` a CA
    certificate (empty names are skipped): gRPC itself only says that it cannot listen,
    or that a handshake failed."""
    for path, option in ((cert_file, cert_option), *ca_files):
        if path and b"-----BEGIN CERTIFICATE-----" not in read_pem(path, "certificate"):
            raise ValueError(f"{option} {path} holds no PEM certificate "
                             "('-----BEGIN CERTIFICATE-----')")
    if not key_file:
        return
    key = read_pem(key_file, "key")
    if b"ENCRYPTED" in key:
        raise ValueError(f"{key_option} {key_file} is encrypted: give the key without a "
                         "passphrase (e.g. `openssl pkey -in KEY -out PLAIN`), readable by "
                         "this user only")
    if b"PRIVATE KEY-----" not in key:
        held = " (it holds a certificate)" if b"CERTIFICATE-----" in key else ""
        raise ValueError(f"{key_option} {key_file} holds no PEM private key{held}: give the "
                         f"key of the certificate {cert_option} {cert_file}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file,
                                                                password=lambda: b"")
    except ssl.SSLError as err:
        mismatch = "KEY_VALUES_MISMATCH" in str(err)
        raise ValueError(
            f"{key_option} {key_file} is not the key of the certificate {cert_option} "
            f"{cert_file}: give the pair's key" if mismatch else
            f"cannot use the certificate {cert_option} {cert_file} with the key "
            f"{key_option} {key_file}: {err.reason or err}") from None


def token_from(token_file: str, environ: Mapping[str, str]) -> str:
    """The token: from `token_file`, else RIPPLES_TOKEN_FILE's file, else RIPPLES_TOKEN."""
    path = token_file or environ.get(ENV_TOKEN_FILE, "")
    if path:
        return read_secret(path)
    token = environ.get(ENV_TOKEN, "").strip()
    if any(c.isspace() for c in token):
        raise ValueError(f"{ENV_TOKEN} holds whitespace: a token is one word")
    return token
