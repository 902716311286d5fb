"""structlog, configured once per process: JSON lines, or a console renderer on a TTY.

Every line carries the process role and boot_id. Event names are dotted (`request.finished`).
Prompt and output text never go into fields unless `--log-content` is set; callers check
`content_allowed()` before adding any text.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_content_allowed = False


def configure_logging(role: str, boot_id: str, level: str = "info", fmt: str = "auto",
                      log_content: bool = False) -> structlog.stdlib.BoundLogger:
    global _content_allowed
    _content_allowed = log_content
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())),
        # One write() per line: print() writes the newline separately, and with
        # PYTHONUNBUFFERED the lines of several processes sharing stderr interleave.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, boot_id=boot_id, pid=os.getpid())
    # Libraries (uvicorn) log through stdlib logging: their warnings and errors become
    # structlog lines like ours (event `library.log`), tracebacks only with --log-content
    # (an exception's text may quote a prompt).
    root = logging.getLogger()
    root.handlers[:] = [_ToStructlog()]
    root.setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    return structlog.get_logger()


class _ToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {"logger": record.name, "message": record.getMessage()[:500]}
            if record.exc_info and record.exc_info[0] is not None:
                fields["error_type"] = record.exc_info[0].__name__
                if _content_allowed:
                    fields["traceback"] = logging.Formatter().formatException(record.exc_info)
            method = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
                      logging.ERROR: "error"}.get(record.levelno, "critical")
            getattr(structlog.get_logger(), method)("library.log", **fields)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


def content_allowed() -> bool:
    return _content_allowed
