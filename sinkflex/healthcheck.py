"""`python -m sinkflex.healthcheck ADDRESS [--service NAME] [--wait SECONDS]`: a grpc.health.v1 probe.

Used as the Docker HEALTHCHECK of every SinkFlex image (Kubernetes uses its native `grpc:`
probes instead), and with `--wait` to hold the training driver until a service is up (the
chart's init containers). Calls `grpc.health.v1.Health/Check` on ADDRESS ("host:port") and
exits 0 when the status is SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable,
deadline exceeded), printing the status; with `--wait`, asks again every 2 s until SERVING
or until SECONDS have passed. Imports only grpcio and the health stubs, so it starts in
well under a second.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name of `service` at `address` ("SERVING", "NOT_SERVING", ...).

    Raises:
        grpc.RpcError: unreachable (UNAVAILABLE), too slow (DEADLINE_EXCEEDED), or the
            service is unknown to the server (NOT_FOUND).
    """
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    name = args.service or "(server)"
    deadline = time.monotonic() + args.wait
    while True:
        try:
            status = check(args.address, args.service, args.timeout)
            line, stream = f"{args.address} {name}: {status}", sys.stdout
        except grpc.RpcError as err:
            status = err.code().name
            line, stream = f"{args.address} {name}: {status}: {err.details()}", sys.stderr
        if status == "SERVING" or time.monotonic() >= deadline:
            print(line, file=stream)
            return 0 if status == "SERVING" else 1
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


if __name__ == "__main__":
    sys.exit(main())
