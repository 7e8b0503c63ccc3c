"""`sinkflex.serving.ServiceServer`'s graceful stop: what runs when (real gRPC on loopback)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def test_stopping_callbacks_run_first_while_in_flight_rpcs_may_still_finish_then_stop_callbacks():
    """on_stopping runs as the stop begins (health already NOT_SERVING, the server not yet stopped:
    an in-flight RPC can still finish within the grace period); on_stop after the server stopped;
    a failing callback does not stop the shutdown."""
    from sinkflex.serving import ServiceServer, make_channel

    server = ServiceServer(port=0, service_names=["test.Service"], grace_seconds=5.0)
    port = server.start()
    server.set_serving()
    channel = make_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    seen: list[tuple[str, object]] = []

    def stopping():
        seen.append(("stopping", health.Check(health_pb2.HealthCheckRequest(service="test.Service"), timeout=5).status))

    def broken():
        raise RuntimeError("a callback that fails")

    server.on_stopping(broken)
    server.on_stopping(stopping)
    server.on_stop(lambda: seen.append(("stop", None)))
    server.stop()
    assert seen == [("stopping", health_pb2.HealthCheckResponse.NOT_SERVING), ("stop", None)]
    try:
        health.Check(health_pb2.HealthCheckRequest(service="test.Service"), timeout=2)
        raise AssertionError("the stopped server answered")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
