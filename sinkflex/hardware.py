"""What the machine can do fast, read once and shared by every service (the learner's and the
rollout engine's `dtype: auto` follow the same rule)."""

from __future__ import annotations

import functools
import logging
import os
import time

log = logging.getLogger(__name__)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

#: bfloat16 counts as fast when a bf16 matmul is at least this many times as fast as fp32.
FAST_BF16_MIN_SPEEDUP = 1.3


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """This machine's CPU as the benchmarks write it: /proc/cpuinfo's first "model name" with its
    "cpu family" and "model" numbers (e.g. "AMD EPYC (family 25 model 1)": a VM's name alone can
    hide the generation), or `platform.machine()` where /proc/cpuinfo is absent."""
    first: dict[str, str] = {}  # the first processor's block
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                first[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" not in first:
        import platform

        return platform.machine() or "unknown"
    return f"{first['model name']} (family {first.get('cpu family', '?')} model {first.get('model', '?')})"


@functools.lru_cache(maxsize=None)
def bf16_matmul_speedup(m: int = 256, k: int = 576, n: int = 1536, rounds: int = 5) -> float:
    """Measured bfloat16 / float32 matmul throughput ratio on this CPU (>1: bf16 is faster).

    Times an (m × k) @ (k × n) matmul (default: a 256-token slice of SmolLM2's MLP, 0.45 GFLOP)
    in both dtypes with ``torch.matmul`` on the threads torch is set to use, interleaved for
    `rounds` rounds after one warm-up each, and compares the best time of each (so a busy
    machine slows both alike). Cached per process.

    Why measured and not read from the flags: ``avx512_bf16`` alone does not make bf16 fast
    (the ratios measured on several CPUs: docs/architecture.md).

    Raises:
        ImportError: torch is not installed.
    """
    import torch

    times: dict[torch.dtype, float] = {}
    with torch.no_grad():
        pairs = {dt: (torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)) for dt in (torch.float32, torch.bfloat16)}
        for a, b in pairs.values():
            torch.matmul(a, b)  # warm-up: oneDNN primitive creation, page faults
        for _ in range(rounds):
            for dt, (a, b) in pairs.items():
                t0 = time.perf_counter()
                torch.matmul(a, b)
                times[dt] = min(times.get(dt, float("inf")), time.perf_counter() - t0)
    return times[torch.float32] / max(times[torch.bfloat16], 1e-9)


def bf16_verdict() -> tuple[bool, str]:
    """Whether bfloat16 is fast on this CPU, and why (for the logs and `Precision.reason`).

    ``SINKFLEX_CPU_BF16`` decides when set to 0/1 (or false/true, no/yes, off/on; tests,
    benchmarks); another value is logged and ignored. Otherwise a CPU without
    ``amx_bf16`` / ``avx512_bf16`` in /proc/cpuinfo is not fast (nothing measured: bf16 is
    emulated there, hundreds of times slower); with one of them, `bf16_matmul_speedup` must be
    at least `FAST_BF16_MIN_SPEEDUP`.
    """
    forced = os.environ.get("SINKFLEX_CPU_BF16")
    if forced is not None and forced.strip().lower() in _TRUE + _FALSE:
        return forced.strip().lower() in _TRUE, f"SINKFLEX_CPU_BF16={forced}"
    if forced:
        log.warning("SINKFLEX_CPU_BF16=%r is not one of 0/1/true/false/yes/no/on/off: ignored, measuring", forced[:40])
    flags = _cpu_flags()
    has = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if not has:
        return False, "no amx_bf16/avx512_bf16 on this CPU"
    try:
        speedup = bf16_matmul_speedup()
    except ImportError:
        return False, "torch not installed"
    fast = speedup >= FAST_BF16_MIN_SPEEDUP
    return fast, f"{'/'.join(has)}, bf16 matmul measured {speedup:.2f}× fp32"


def cpu_has_fast_bf16() -> bool:
    """True when bfloat16 matmuls are clearly faster than float32 on this CPU (`bf16_verdict`)."""
    fast, why = bf16_verdict()
    log.debug("fast bf16: %s (%s)", fast, why)
    return fast
