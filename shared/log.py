"""structlog setup: JSON lines in containers and pipes, pretty output on a terminal.

One event name per line; context (service, worker id) is bound once per process.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, *, fmt: str = "auto", level: str = "info", **context: str) -> structlog.BoundLogger:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    processors.append(structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=True))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, **context)
    return structlog.get_logger()


def get_logger() -> structlog.BoundLogger:
    return structlog.get_logger()
