"""tau2's logging, tamed: tau2 logs through loguru, whose default sink takes DEBUG."""

from __future__ import annotations

import sys


def quiet_tau2_logs(level: str = "WARNING") -> None:
    """Sends loguru (tau2's) logs to stderr at `level` and above only.

    tau2 logs every orchestrator step at DEBUG, which costs more than the step itself, and its
    registry's contents at import. Entry points (`train`, the servers, CLI, benchmarks, test
    fixtures) call this before importing tau2. Below DEBUG it also drops the one warning every
    tau2 import prints, "No .env file found" (`tau2.utils.utils` looks for API keys in a .env
    file; SinkFlex-RL passes them, when a hosted user simulator needs any, as environment
    variables, which litellm reads directly).
    """
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=level, filter=None if level.upper() == "DEBUG" else _not_dotenv_notice)


def _not_dotenv_notice(record) -> bool:
    return not (record["name"] == "tau2.utils.utils" and record["message"] == "No .env file found")
