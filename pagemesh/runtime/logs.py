"""Logging set-up, done once in each service's `main`."""

from __future__ import annotations

import contextvars
import logging

from pagemesh.runtime.telemetry import current_trace_id

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds the request id of the current task and the trace id of its current span (each
    '-' when there is none) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.trace_id = current_trace_id()
        return True


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s {service} [%(request_id)s %(trace_id)s] "
            "%(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
