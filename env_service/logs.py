"""tau2's logging, tamed: tau2 logs through loguru, whose default sink takes DEBUG."""

from __future__ import annotations

import sys


def quiet_tau2_logs(level: str = "WARNING") -> None:
    """Sends loguru (tau2's) logs to stderr at `level` and above only.

    tau2 logs every orchestrator step at DEBUG, which costs more than the step itself.
    Entry points (server, CLI, benchmarks, test fixtures) call this before importing tau2.
    """
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=level)
