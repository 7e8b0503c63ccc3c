"""TLS and mutual TLS of the gRPC servers and clients (`sinkflex.tls`), on loopback.

A throw-away CA, server and client certificates are made at test time (`cryptography`); a
real reward service (`reward_service.server.build_server`, no task set loaded) serves with
TLS and with mTLS; its gRPC client, the health check and `wait_for_serving` call it.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from reward_service.client import GrpcRewardClient
from reward_service.config import RewardServiceConfig
from reward_service.server import build_server
from sinkflex import healthcheck, tls
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import ServiceError
from sinkflex.serving import make_channel, wait_for_serving
from sinkflex.tls import TLSConfig, TLSError


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, usage=None, sans=()):
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, stem: str, cert, key) -> tuple[str, str]:
    (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(folder / f"{stem}.crt"), str(folder / f"{stem}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """ca.crt; server.crt/key (SANs localhost, 127.0.0.1); client.crt/key; other-ca.crt and a client it signed."""
    d = tmp_path_factory.mktemp("pki")
    out: dict[str, str] = {}
    for ca_stem in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(f"SinkFlex test {ca_stem}", ca_key, _name(f"SinkFlex test {ca_stem}"), ca_key, ca=True)
        out[ca_stem], _ = _write(d, ca_stem, ca_cert, ca_key)
        prefix = "" if ca_stem == "ca" else "other-"
        if ca_stem == "ca":
            key = ec.generate_private_key(ec.SECP256R1())
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            cert = _cert("reward", key, ca_cert.subject, ca_key, usage=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans)
            out["server_cert"], out["server_key"] = _write(d, "server", cert, key)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert("driver", key, ca_cert.subject, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
        out[f"{prefix}client_cert"], out[f"{prefix}client_key"] = _write(d, f"{prefix}client", cert, key)
    return out


def _serve(tls_config: TLSConfig):
    server, _ = build_server(RewardServiceConfig(port=0, metrics_port=None, preload_envs=[], grace_seconds=0.0,
                                                 tls=tls_config))
    server.start()
    server.set_serving()
    return server


def _unknown_env() -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(env="no-such-env", task_id="0",
                                   termination_reason=common_pb2.TERMINATION_REASON_MAX_TURNS)


@pytest.fixture(scope="module")
def tls_server(pki):
    server = _serve(TLSConfig(cert_file=pki["server_cert"], key_file=pki["server_key"]))
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(pki):
    server = _serve(TLSConfig(cert_file=pki["server_cert"], key_file=pki["server_key"], ca_file=pki["ca"],
                              require_client_auth=True))
    yield f"127.0.0.1:{server.port}"
    server.stop()


def _score(address: str, config: TLSConfig | None) -> ServiceError:
    """The reward service's answer to a Score of an unknown env: NOT_FOUND when the call got through."""
    client = GrpcRewardClient(address, timeout=60.0)
    client.channel.close()
    client.channel = make_channel(address, tls=config)
    from sinkflex.api.reward.v1 import reward_pb2_grpc

    client.stub = reward_pb2_grpc.RewardServiceStub(client.channel)
    with client, pytest.raises(ServiceError) as info:
        client.score(_unknown_env())
    return info.value


def test_tls_client_reaches_a_tls_server(pki, tls_server):
    err = _score(tls_server, TLSConfig(ca_file=pki["ca"]))
    assert err.code == grpc.StatusCode.NOT_FOUND  # the call reached the servicer
    with make_channel(tls_server, tls=TLSConfig(ca_file=pki["ca"])) as channel:
        wait_for_serving(channel, timeout=3.0)
    assert healthcheck.main([tls_server, "--tls-ca", pki["ca"]]) == 0


def test_plaintext_client_to_a_tls_server_fails_saying_tls(tls_server, capsys):
    err = _score(tls_server, TLSConfig())
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "TLS" in err.message
    with make_channel(tls_server, tls=TLSConfig()) as channel, pytest.raises(TimeoutError, match="TLS"):
        wait_for_serving(channel, timeout=0.5)
    assert healthcheck.main([tls_server]) == 1
    assert "TLS" in capsys.readouterr().err


def test_client_with_the_wrong_ca_fails(pki, tls_server):
    err = _score(tls_server, TLSConfig(ca_file=pki["other-ca"]))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "TLS" in err.message


def test_mtls_server_accepts_a_client_certificate(pki, mtls_server):
    err = _score(mtls_server, TLSConfig(ca_file=pki["ca"], cert_file=pki["client_cert"], key_file=pki["client_key"]))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert healthcheck.main([mtls_server, "--tls-ca", pki["ca"], "--tls-cert", pki["client_cert"],
                             "--tls-key", pki["client_key"]]) == 0


def test_mtls_server_refuses_a_client_without_certificate(pki, mtls_server):
    err = _score(mtls_server, TLSConfig(ca_file=pki["ca"]))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "TLS" in err.message


def test_mtls_server_refuses_a_certificate_another_ca_signed(pki, mtls_server):
    err = _score(mtls_server, TLSConfig(ca_file=pki["ca"], cert_file=pki["other-client_cert"],
                                        key_file=pki["other-client_key"]))
    assert err.code == grpc.StatusCode.UNAVAILABLE


def test_client_tls_from_the_environment(pki, tls_server, monkeypatch):
    monkeypatch.setenv(tls.ENV_CA, pki["ca"])
    tls.set_client_tls(None)
    assert tls.client_tls().ca_file == pki["ca"]
    with GrpcRewardClient(tls_server, timeout=60.0) as client, pytest.raises(ServiceError) as info:
        client.score(_unknown_env())
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_bad_files_are_named_at_start(pki, tmp_path):
    missing = str(tmp_path / "nope.crt")
    with pytest.raises(TLSError, match="nope.crt"):
        _serve(TLSConfig(cert_file=missing, key_file=pki["server_key"]))
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(TLSError, match="junk.key.*PEM"):
        _serve(TLSConfig(cert_file=pki["server_cert"], key_file=str(tmp_path / "junk.key")))
    with pytest.raises(TLSError, match="key_file"):
        _serve(TLSConfig(cert_file=pki["server_cert"]))
    with pytest.raises(TLSError, match="ca_file"):
        _serve(TLSConfig(cert_file=pki["server_cert"], key_file=pki["server_key"], require_client_auth=True))
    with pytest.raises(TLSError, match="nope.crt"):
        make_channel("127.0.0.1:1", tls=TLSConfig(ca_file=missing))


def test_off_by_default(monkeypatch):
    for name in (tls.ENV_CA, tls.ENV_CERT, tls.ENV_KEY, tls.ENV_CLIENT_AUTH, tls.ENV_ENABLED, tls.ENV_SERVER_NAME):
        monkeypatch.delenv(name, raising=False)
    assert not tls.from_env().active and not RewardServiceConfig().tls.active
    assert tls.from_env({tls.ENV_CA: "/x/ca.crt", tls.ENV_CLIENT_AUTH: "true"}) == TLSConfig(
        ca_file="/x/ca.crt", require_client_auth=True)


def test_dev_certificate_serves_and_authenticates_every_side(tmp_path):
    """scripts/tls_dev_certs.py: each service's certificate is its server and its client certificate (mTLS),
    its common name the service's identity."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tls_dev_certs", Path(__file__).parents[1] / "scripts/tls_dev_certs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_certs(tmp_path, mod.NAMES)
    assert sorted(p.name for p in tmp_path.glob("*.crt")) == ["ca.crt", *sorted(f"{i}.crt" for i in mod.IDENTITIES)]
    both = TLSConfig(cert_file=str(tmp_path / "reward.crt"), key_file=str(tmp_path / "reward.key"),
                     ca_file=str(tmp_path / "ca.crt"), require_client_auth=True)
    server = _serve(both)
    try:
        address = f"127.0.0.1:{server.port}"
        assert _score(address, both).code == grpc.StatusCode.NOT_FOUND
        assert _score(f"localhost:{server.port}", both).code == grpc.StatusCode.NOT_FOUND
        assert _score(address, TLSConfig(ca_file=str(tmp_path / "ca.crt"))).code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_service_flags_set_tls_and_a_bad_file_fails_the_start(pki, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import env_service.__main__ as env_main
    from reward_service.__main__ import app as reward_app

    for name in (tls.ENV_CA, tls.ENV_CERT, tls.ENV_KEY, tls.ENV_CLIENT_AUTH):
        monkeypatch.delenv(name, raising=False)
    args = env_main.parse_args(["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                                "--tls-ca", pki["ca"], "--tls-client-auth"])
    cfg = env_main.config_from_args(args)
    assert cfg.tls == TLSConfig(cert_file=pki["server_cert"], key_file=pki["server_key"], ca_file=pki["ca"],
                                require_client_auth=True)
    monkeypatch.setenv(tls.ENV_CERT, pki["server_cert"])  # the flags' environment variables
    monkeypatch.setenv(tls.ENV_KEY, pki["server_key"])
    assert env_main.config_from_args(env_main.parse_args([])).tls.cert_file == pki["server_cert"]
    result = CliRunner().invoke(reward_app, ["--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", pki["server_key"],
                                             "--port", "0", "--no-metrics"])
    assert result.exit_code == 2
    assert "missing.crt" in result.output and "cannot read" in result.output
