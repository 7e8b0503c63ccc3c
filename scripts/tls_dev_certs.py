"""`python scripts/tls_dev_certs.py DIR [--name NAME ...] [--days N]`: a throw-away CA and certificate for gRPC TLS.

Writes DIR/ca.crt, DIR/ca.key, DIR/tls.crt and DIR/tls.key (PEM, EC P-256): one certificate,
signed by the new CA, for every SinkFlex service, with serverAuth and clientAuth usages (it is
each service's server certificate and its client certificate for mutual TLS) and SANs for the
compose and chart service names (env, reward, rollout, learner, plus `--name`s), localhost and
127.0.0.1. For development and tests only: a real deployment gets its certificates from its
own CA (cert-manager in Kubernetes, docs/deploy.md "Security"). Needs the `cryptography` package.

    python scripts/tls_dev_certs.py tls          # then: docker compose -f docker-compose.yml -f docker-compose.tls.yml up
    kubectl create secret generic sinkflex-tls --from-file=tls/ca.crt --from-file=tls/tls.crt --from-file=tls/tls.key
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

NAMES = ["env", "reward", "rollout", "learner", "localhost"]


def write_certs(folder: Path, names: list[str], days: int = 365) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject: str, key, issuer: x509.Name) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days)))

    def save(stem: str, cert, key) -> None:
        (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        path = folder / f"{stem}.key"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        os.chmod(path, 0o644 if stem == "tls" else 0o600)  # the containers' uid 10001 reads tls.key

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (builder("SinkFlex dev CA", ca_key, name("SinkFlex dev CA"))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in dict.fromkeys(names)] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (builder("sinkflex", key, ca.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    save("ca", ca, ca_key)
    save("tls", cert, key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", action="append", default=[], help="another DNS name for the certificate (repeatable), "
                        "e.g. the chart's service names sinkflex-env, sinkflex-env.NAMESPACE.svc")
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)
    write_certs(args.folder, [*NAMES, *args.name], args.days)
    print(f"wrote {args.folder}/ca.crt, ca.key, tls.crt, tls.key")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
