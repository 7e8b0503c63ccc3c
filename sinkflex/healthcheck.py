"""`python -m sinkflex.healthcheck ADDRESS [--service NAME] [--wait SECONDS]`: a grpc.health.v1 probe.

Used as the Docker HEALTHCHECK of every SinkFlex image (Kubernetes uses its native `grpc:`
probes instead), and with `--wait` to hold the training driver until a service is up (the
chart's init containers). Calls `grpc.health.v1.Health/Check` on ADDRESS ("host:port") and
exits 0 when the status is SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable,
deadline exceeded), printing the status; with `--wait`, asks again every 2 s until SERVING
or until SECONDS have passed. Imports only grpcio and the health stubs, so it starts in
well under a second.

TLS (`sinkflex.tls`): `--tls-ca FILE` (verify the server), `--tls-cert FILE --tls-key FILE`
(a client certificate, for a mutual-TLS server), `--tls-server-name NAME` (the name to verify,
e.g. when ADDRESS is 127.0.0.1); each defaults to its SINKFLEX_TLS_* environment variable, so
the images' HEALTHCHECK follows the container's TLS settings. A plaintext probe of a TLS server
fails saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0, tls=None) -> str:
    """The health status name of `service` at `address` ("SERVING", "NOT_SERVING", ...).

    Raises:
        grpc.RpcError: unreachable (UNAVAILABLE), too slow (DEADLINE_EXCEEDED), or the
            service is unknown to the server (NOT_FOUND).
        sinkflex.tls.TLSError: a file of `tls` (a `sinkflex.tls.TLSConfig`) is missing or not PEM.
    """
    if tls is not None and tls.active:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sinkflex.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for one answer")
    parser.add_argument("--wait", type=float, default=0.0, help="keep asking until SERVING for up to this many seconds")
    env = os.environ.get
    parser.add_argument("--tls-ca", default=env("SINKFLEX_TLS_CA_FILE") or None, metavar="FILE",
                        help="TLS: PEM CA that verifies the server (env SINKFLEX_TLS_CA_FILE)")
    parser.add_argument("--tls-cert", default=env("SINKFLEX_TLS_CERT_FILE") or None, metavar="FILE",
                        help="TLS: client certificate for a mutual-TLS server (env SINKFLEX_TLS_CERT_FILE)")
    parser.add_argument("--tls-key", default=env("SINKFLEX_TLS_KEY_FILE") or None, metavar="FILE",
                        help="TLS: its private key (env SINKFLEX_TLS_KEY_FILE)")
    parser.add_argument("--tls-server-name", default=env("SINKFLEX_TLS_SERVER_NAME") or None, metavar="NAME",
                        help="TLS: name to verify in the server's certificate (env SINKFLEX_TLS_SERVER_NAME)")
    args = parser.parse_args(argv)
    name = args.service or "(server)"
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key or (env("SINKFLEX_TLS") or "").lower() in {"1", "true", "yes", "on"}:
        from sinkflex.tls import TLSConfig, TLSError

        tls = TLSConfig(enabled=True, ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                        server_name=args.tls_server_name)
        try:
            tls.channel_credentials()
        except TLSError as err:
            print(f"{args.address} {name}: {err}", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.wait
    while True:
        try:
            status = check(args.address, args.service, args.timeout, tls)
            line, stream = f"{args.address} {name}: {status}", sys.stdout
        except grpc.RpcError as err:
            status = err.code().name
            line, stream = f"{args.address} {name}: {status}: {err.details()}", sys.stderr
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                from sinkflex.tls import unavailable_hint

                hint = unavailable_hint(err.details() or "", tls is not None)
                line += f" ({hint})" if hint else ""
        if status == "SERVING" or time.monotonic() >= deadline:
            print(line, file=stream)
            return 0 if status == "SERVING" else 1
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


if __name__ == "__main__":
    sys.exit(main())
