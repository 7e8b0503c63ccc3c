"""Optional TLS and mutual TLS for every SinkFlex gRPC server and client: `TLSConfig`.

Off by default: a server listens in plaintext and a channel is plaintext. TLS is
on as soon as a certificate file is given (or `enabled: true`):

- a server (`sinkflex.serving.ServiceServer(tls=...)`, each service's `tls:` config section and
  `--tls-cert/--tls-key/--tls-ca/--tls-client-auth` flags) needs `cert_file` + `key_file`
  (PEM); with `require_client_auth` (mutual TLS) also `ca_file`, the CA that signed the
  clients' certificates: a client without such a certificate is refused in the handshake.
- a client (`sinkflex.serving.make_channel`, every `Grpc*Client`, the health check, the
  launcher's readiness checks, the learner's weight push) verifies the server against
  `ca_file` (None: the system roots) and, for mutual TLS, presents `cert_file` + `key_file`.
  `server_name` is the name checked against the server's certificate when it is not the
  address's host (e.g. an IP address that is not in the certificate's SANs).

A process's clients take `client_tls()`: what `set_client_tls` set (each service sets its
own `tls` section, so its clients to other services use the same files), else the
environment (`from_env`):

    SINKFLEX_TLS_CERT_FILE   certificate (PEM): the server's, or the client's for mTLS
    SINKFLEX_TLS_KEY_FILE    its private key (PEM)
    SINKFLEX_TLS_CA_FILE     CA bundle (PEM) that verifies the peer
    SINKFLEX_TLS_CLIENT_AUTH 1/true: a server requires client certificates (mTLS)
    SINKFLEX_TLS_SERVER_NAME name to verify in the server's certificate
    SINKFLEX_TLS             1/true: TLS with none of the files (a client, system roots)

A file that is missing or unreadable, or is not PEM, fails at start with its name (`TLSError`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import grpc
from pydantic import Field

from sinkflex.config import ConfigError, StrictModel

#: The environment variables `from_env` reads (and the services' `--tls-*` flags' envvars).
ENV_CERT = "SINKFLEX_TLS_CERT_FILE"
ENV_KEY = "SINKFLEX_TLS_KEY_FILE"
ENV_CA = "SINKFLEX_TLS_CA_FILE"
ENV_CLIENT_AUTH = "SINKFLEX_TLS_CLIENT_AUTH"
ENV_SERVER_NAME = "SINKFLEX_TLS_SERVER_NAME"
ENV_ENABLED = "SINKFLEX_TLS"

_TRUE = {"1", "true", "yes", "on"}


class TLSError(ConfigError):
    """A TLS setting cannot be used: a file missing, unreadable or not PEM, or a half pair."""


class TLSConfig(StrictModel):
    """TLS of one gRPC server or client (all None/False: plaintext)."""

    enabled: bool = Field(default=False, description="TLS even with no file given (a client trusting the system roots).")
    cert_file: str | None = Field(default=None, description="PEM certificate (chain): the server's, or the client's for mTLS.")
    key_file: str | None = Field(default=None, description="PEM private key of cert_file.")
    ca_file: str | None = Field(default=None, description="PEM CA bundle verifying the peer (client: the server; "
                                "server with require_client_auth: the clients). Client default: the system roots.")
    require_client_auth: bool = Field(default=False, description="Server: refuse clients without a certificate "
                                      "signed by ca_file (mutual TLS).")
    server_name: str | None = Field(default=None, description="Client: the name to verify in the server's "
                                    "certificate (default: the address's host).")

    @property
    def active(self) -> bool:
        """TLS is on: `enabled`, or any file or mTLS set."""
        return bool(self.enabled or self.cert_file or self.key_file or self.ca_file or self.require_client_auth)

    # -------------------------------------------------------------- credentials
    def server_credentials(self) -> grpc.ServerCredentials:
        """The server's credentials; raises `TLSError` naming what is missing or unreadable."""
        if not (self.cert_file and self.key_file):
            raise TLSError("TLS server: cert_file and key_file are both required (--tls-cert, --tls-key / "
                           f"{ENV_CERT}, {ENV_KEY})")
        if self.require_client_auth and not self.ca_file:
            raise TLSError(f"TLS server with require_client_auth (mutual TLS): ca_file is required (--tls-ca / {ENV_CA})")
        cert, key = _read(self.cert_file, "cert_file"), _read(self.key_file, "key_file")
        ca = _read(self.ca_file, "ca_file") if self.ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=self.require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's credentials; raises `TLSError` naming what is missing or unreadable."""
        if bool(self.cert_file) != bool(self.key_file):
            raise TLSError("TLS client: a client certificate needs both cert_file and key_file "
                           f"(--tls-cert, --tls-key / {ENV_CERT}, {ENV_KEY})")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "ca_file") if self.ca_file else None,
            private_key=_read(self.key_file, "key_file") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "cert_file") if self.cert_file else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """Extra channel options: the target-name override when `server_name` is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.active and self.server_name else []

    def check(self, side: str = "server") -> None:
        """Reads the files now (`side` "server" or "client"): a bad one fails here, at start."""
        if self.active:
            self.server_credentials() if side == "server" else self.channel_credentials()

    def describe(self) -> str:
        """"plaintext", "TLS" or "mutual TLS" (for log lines)."""
        if not self.active:
            return "plaintext"
        return "mutual TLS" if self.require_client_auth else "TLS"


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise TLSError(f"TLS {what} {path}: cannot read: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"TLS {what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def from_env(environ: Mapping[str, str] | None = None) -> TLSConfig:
    """The `TLSConfig` the SINKFLEX_TLS_* environment variables describe (none set: plaintext)."""
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    return TLSConfig(
        enabled=(get(ENV_ENABLED) or "").lower() in _TRUE,
        cert_file=get(ENV_CERT), key_file=get(ENV_KEY), ca_file=get(ENV_CA),
        require_client_auth=(get(ENV_CLIENT_AUTH) or "").lower() in _TRUE,
        server_name=get(ENV_SERVER_NAME),
    )


def merge_flags(base: TLSConfig | Mapping | None, *, cert: str | None = None, key: str | None = None,
                ca: str | None = None, client_auth: bool | None = None, server_name: str | None = None) -> dict:
    """A service config's `tls` section (a dict) with the `--tls-*` flags that were given laid over it."""
    out = dict(base.model_dump() if isinstance(base, TLSConfig) else (base or {}))
    for field, value in (("cert_file", cert), ("key_file", key), ("ca_file", ca), ("server_name", server_name)):
        if value:
            out[field] = value
    if client_auth:
        out["require_client_auth"] = True
    return out


_client_tls: TLSConfig | None = None


def set_client_tls(config: TLSConfig | None) -> None:
    """Sets the TLS of every channel this process opens without its own (None: back to the environment)."""
    global _client_tls
    _client_tls = config


def client_tls() -> TLSConfig:
    """The TLS of this process's channels: `set_client_tls`'s, else `from_env()`."""
    return _client_tls if _client_tls is not None else from_env()


def unavailable_hint(details: str, tls_active: bool) -> str:
    """A sentence to add to an UNAVAILABLE error whose `details` look like a TLS mismatch ("" if none)."""
    text = (details or "").lower()
    if not tls_active and any(s in text for s in ("socket closed", "connection reset", "ssl", "tls", "handshake",
                                                   "end of tcp stream", "eof")):
        return (f"the server may require TLS while this client is plaintext: give it the CA ({ENV_CA} or "
                "--tls-ca) and, for mutual TLS, a client certificate")
    if tls_active and any(s in text for s in ("ssl", "tls", "handshake", "certificate", "socket closed")):
        return ("TLS handshake failed: check that the server uses TLS, that the CA verifies its certificate "
                f"(and server name, {ENV_SERVER_NAME}), and, for mutual TLS, that this client presents a "
                f"certificate ({ENV_CERT}, {ENV_KEY}) the server's CA signed")
    return ""
