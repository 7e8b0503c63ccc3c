"""tau2's logging, tamed: tau2 logs through loguru, whose default sink takes DEBUG."""

from __future__ import annotations

import sys


def quiet_tau2_logs(level: str = "WARNING") -> None:
    """Sends loguru (tau2's) logs to stderr at `level` and above only.

    tau2 logs every orchestrator step at DEBUG, which costs more than the step itself, and its
    registry's contents at import. Entry points (`train`, the servers, CLI, benchmarks, test
    fixtures) call this before importing tau2. Below DEBUG it also drops two import-time warnings
    every tau2 import prints, which say nothing about the run (`IMPORT_NOTICES`): "No .env file
    found" (`tau2.utils.utils` looks for API keys in a .env file; SinkFlex-RL passes them, when a
    hosted user simulator needs any, as environment variables, which litellm reads directly) and
    "Sonnet thinking is disabled" (`tau2.utils.llm_utils`, a module constant about Anthropic's
    extended thinking, which no SinkFlex-RL path uses).
    """
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=level, filter=None if level.upper() == "DEBUG" else _not_import_notice)


#: (logger name, message) of the notices tau2 logs on import, whatever the run does
IMPORT_NOTICES = frozenset({
    ("tau2.utils.utils", "No .env file found"),
    ("tau2.utils.llm_utils", "Sonnet thinking is disabled"),
})


def _not_import_notice(record) -> bool:
    return (record["name"], record["message"]) not in IMPORT_NOTICES
