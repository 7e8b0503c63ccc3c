"""Prometheus metrics of a real ServiceServer over real gRPC and HTTP on loopback.

The RPCs are grpc.health.v1's own (unary Check, server-streaming Watch), which every
service serves, so the interceptor is tested on a real servicer with real status codes.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from sinkflex.metrics import TokenRate
from sinkflex.serving import ServiceServer, make_channel

SERVICE = "sinkflex.api.env.v1.EnvService"
HEALTH = "grpc.health.v1.Health"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def server():
    srv = ServiceServer(port=0, service_names=[SERVICE], metrics_port=0)
    srv.start()
    srv.set_serving()
    yield srv
    srv.stop()


def test_requests_codes_and_latency_by_method(server):
    base = scrape(server.metrics_port)
    assert server.metrics_service == "env"
    lbl = {"sinkflex_service": "env", "grpc_type": "unary", "grpc_service": HEALTH, "grpc_method": "Check"}
    with make_channel(f"127.0.0.1:{server.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(3):
            assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    after = scrape(server.metrics_port)
    ok = sample(after, "grpc_server_handled_total", **lbl, grpc_code="OK") - sample(base, "grpc_server_handled_total", **lbl, grpc_code="OK")
    nf = sample(after, "grpc_server_handled_total", **lbl, grpc_code="NOT_FOUND") - sample(base, "grpc_server_handled_total", **lbl, grpc_code="NOT_FOUND")
    started = sample(after, "grpc_server_started_total", **lbl) - sample(base, "grpc_server_started_total", **lbl)
    count = sample(after, "grpc_server_handling_seconds_count", **lbl) - sample(base, "grpc_server_handling_seconds_count", **lbl)
    total_s = sample(after, "grpc_server_handling_seconds_sum", **lbl) - sample(base, "grpc_server_handling_seconds_sum", **lbl)
    assert (ok, nf, started, count) == (3, 1, 4, 4)
    assert 0 < total_s < 5.0
    # every latency observation falls in some bucket; +Inf holds all of them
    inf = sample(after, "grpc_server_handling_seconds_bucket", **lbl, le="+Inf") - sample(base, "grpc_server_handling_seconds_bucket", **lbl, le="+Inf")
    assert inf == 4


def test_streaming_rpc_cancelled_by_client_counts_cancelled(server):
    lbl = {"sinkflex_service": "env", "grpc_type": "server_stream", "grpc_service": HEALTH, "grpc_method": "Watch"}
    base = scrape(server.metrics_port)
    with make_channel(f"127.0.0.1:{server.port}") as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        first = next(call)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()
    # the server sees the cancellation asynchronously
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = scrape(server.metrics_port)
        if sample(after, "grpc_server_handled_total", **lbl, grpc_code="CANCELLED") > sample(base, "grpc_server_handled_total", **lbl, grpc_code="CANCELLED"):
            break
        time.sleep(0.1)
    assert sample(after, "grpc_server_handled_total", **lbl, grpc_code="CANCELLED") - sample(base, "grpc_server_handled_total", **lbl, grpc_code="CANCELLED") == 1
    assert sample(after, "grpc_server_started_total", **lbl) - sample(base, "grpc_server_started_total", **lbl) == 1


def test_streaming_rpc_past_its_deadline_counts_deadline_exceeded(server):
    import time

    lbl = dict(sinkflex_service="env", grpc_type="server_stream", grpc_service=HEALTH, grpc_method="Watch")  # noqa: C408
    base = scrape(server.metrics_port)
    with make_channel(f"127.0.0.1:{server.port}") as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # SERVING, then nothing until the deadline
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    key = ("grpc_server_handled_total", dict(lbl, grpc_code="DEADLINE_EXCEEDED"))
    while time.monotonic() < deadline:
        after = scrape(server.metrics_port)
        if sample(after, key[0], **key[1]) > sample(base, key[0], **key[1]):
            break
        time.sleep(0.1)
    assert sample(after, key[0], **key[1]) - sample(base, key[0], **key[1]) == 1


def test_service_gauges(server):
    server.metrics.set_sessions(7)
    server.metrics.set_queue_lag("sinkflex:groups", "learners", 12)
    server.metrics.tokens("generated").add(300)
    after = scrape(server.metrics_port)
    assert sample(after, "sinkflex_sessions", sinkflex_service="env") == 7
    assert sample(after, "sinkflex_queue_lag", sinkflex_service="env", stream="sinkflex:groups", group="learners") == 12
    assert sample(after, "sinkflex_tokens_total", sinkflex_service="env", kind="generated") >= 300
    assert sample(after, "sinkflex_tokens_per_second", sinkflex_service="env", kind="generated") > 0


def test_token_rate_sliding_window():
    now = [100.0]
    rate = TokenRate("test", "trained", window_s=10.0, clock=lambda: now[0])
    now[0] = 110.0
    assert rate.add(500) == pytest.approx(50.0)  # 500 tokens over the 10 s window
    now[0] = 115.0
    assert rate.add(100) == pytest.approx(60.0)  # 600 tokens, both in (105, 115]
    now[0] = 121.0
    assert rate.rate() == pytest.approx(10.0)  # the 500 at t=110 left the window
    with pytest.raises(ValueError, match="n_tokens"):
        rate.add(-1)


def test_stop_frees_metrics_port_and_no_metrics_by_default():
    srv = ServiceServer(port=0, service_names=[SERVICE], metrics_port=0)
    srv.start()
    port = srv.metrics_port
    assert scrape(port)
    srv.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    plain = ServiceServer(port=0, service_names=[SERVICE])  # backward compatible: no metrics
    plain.start()
    assert plain.metrics_port is None and plain._metrics_server is None
    plain.stop()


def test_healthcheck_cli_exit_codes(server):
    """`python -m sinkflex.healthcheck` (the Docker HEALTHCHECK): 0 SERVING, 1 otherwise."""
    addr = f"127.0.0.1:{server.port}"
    run = lambda *a: subprocess.run([sys.executable, "-m", "sinkflex.healthcheck", *a], capture_output=True, text=True, timeout=60, check=False)
    ok = run(addr, "--service", SERVICE)
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout
    server.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    bad = run(addr, "--service", SERVICE)
    assert bad.returncode == 1 and "NOT_SERVING" in bad.stdout + bad.stderr
    unknown = run(addr, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    down = run("127.0.0.1:1", "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_healthcheck_wait_until_serving(server):
    """--wait (the driver's init containers): returns once the service turns SERVING."""
    import threading
    import time

    server.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    threading.Timer(3.0, server.health.set, (SERVICE, health_pb2.HealthCheckResponse.SERVING)).start()
    start = time.monotonic()
    ok = subprocess.run([sys.executable, "-m", "sinkflex.healthcheck", f"127.0.0.1:{server.port}", "--service", SERVICE,
                         "--wait", "60"], capture_output=True, text=True, timeout=90, check=False)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert 2.5 < time.monotonic() - start < 60
    gone = subprocess.run([sys.executable, "-m", "sinkflex.healthcheck", "127.0.0.1:1", "--timeout", "0.5", "--wait", "2"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
