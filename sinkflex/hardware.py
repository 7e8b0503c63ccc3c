"""What the machine can do fast, read once and shared by every service (the learner's and the
rollout engine's `dtype: auto` follow the same rule)."""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when this CPU computes bfloat16 matmuls natively (AMX-BF16 or AVX512-BF16).

    Read from the /proc/cpuinfo flags (``amx_bf16``, ``avx512_bf16``), falling back to
    ``torch.backends.cpu.get_cpu_capability()`` where torch is importable;
    ``SINKFLEX_CPU_BF16=0/1`` overrides (tests, benchmarks).
    """
    forced = os.environ.get("SINKFLEX_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    flags = _cpu_flags()
    if "amx_bf16" in flags or "avx512_bf16" in flags:
        return True
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX_BF16")
    except Exception:  # noqa: BLE001 - no torch, or an older one
        return False
