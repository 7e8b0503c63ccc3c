"""`python scripts/tls_dev_certs.py DIR [--name NAME ...] [--days N]`: a throw-away CA and one certificate per service.

Writes DIR/ca.crt, DIR/ca.key and, for each SinkFlex identity (env, reward, rollout, learner,
driver: `sinkflex.authz.IDENTITIES`), DIR/<identity>.crt and DIR/<identity>.key (PEM, EC
P-256), signed by the new CA. Each certificate's common name is its identity (what the
servers' allow-lists check, `sinkflex.authz`: only learner and driver may UpdateWeights and
Checkpoint, only driver may Rollout with publish); it has serverAuth and clientAuth usages
(the service's server certificate and its client certificate for mutual TLS) and SANs for
the compose and chart names of that service (`<identity>`, `sinkflex-<identity>`, plus
`--name`s), localhost and 127.0.0.1. Give each process its own pair (SINKFLEX_TLS_CERT_FILE /
SINKFLEX_TLS_KEY_FILE, or --tls-cert / --tls-key) and every process the CA. For development
and tests only: a real deployment gets its certificates from its own CA (cert-manager in
Kubernetes, docs/deploy.md "Security"). Needs the `cryptography` package.

    python scripts/tls_dev_certs.py tls          # tls/ca.crt, tls/learner.crt, tls/learner.key, ...
    kubectl create secret generic sinkflex-tls-learner --from-file=tls/ca.crt \
        --from-file=tls.crt=tls/learner.crt --from-file=tls.key=tls/learner.key     # one per service
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

#: The service identities; each gets <identity>.crt / <identity>.key (keep in step with sinkflex.authz.IDENTITIES).
IDENTITIES = ["env", "reward", "rollout", "learner", "driver"]
NAMES = ["localhost"]


def write_certs(folder: Path, names: list[str], days: int = 365, identities: list[str] | None = None) -> None:
    """ca.crt/ca.key and <identity>.crt/<identity>.key for each identity (module docstring);
    `names`: extra DNS names of every certificate."""
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
        os.chmod(path, 0o600 if stem == "ca" else 0o644)  # the containers' uid 10001 reads its key

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (builder("SinkFlex dev CA", ca_key, name("SinkFlex dev CA"))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    save("ca", ca, ca_key)
    for identity in identities or IDENTITIES:
        key = ec.generate_private_key(ec.SECP256R1())
        dns = [identity, f"sinkflex-{identity}", *names]
        sans = [x509.DNSName(n) for n in dict.fromkeys(dns)] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (builder(identity, key, ca.subject)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .sign(ca_key, hashes.SHA256()))
        save(identity, cert, key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", action="append", default=[], help="another DNS name for the certificate (repeatable), "
                        "e.g. the chart's service names sinkflex-env, sinkflex-env.NAMESPACE.svc")
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)
    write_certs(args.folder, [*NAMES, *args.name], args.days)
    print(f"wrote {args.folder}/ca.crt, ca.key and " + ", ".join(f"{i}.crt, {i}.key" for i in IDENTITIES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
