"""structlog JSON logging, configured once per process."""

from __future__ import annotations

import logging
import sys

import structlog


class _StderrLogger:
    """Writes each line to whatever `sys.stderr` is when it writes, not when logging was set up:
    a caller that swaps stderr for a while (a test runner, an embedding CLI) must not leave every
    later log line aimed at a closed stream."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        if stream is None or stream.closed:
            return
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = msg


def _stderr_logger(*_: object) -> _StderrLogger:
    return _StderrLogger()


def configure(level: int = logging.INFO) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
