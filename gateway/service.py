"""The gateway process: `run(settings)` logs, loads the tokenizer, serves HTTP until a signal.

SIGTERM and SIGINT stop accepting connections, give open requests `GRACE_S` seconds, fail the
rest with a retryable 503, close the scheduler socket and return normally (exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from switchyard.gateway.app import build_app
from switchyard.gateway.http_limits import server_limits
from switchyard.proto.ids import new_boot_id
from switchyard.common.logs import configure_logging
from switchyard.common.secret_keys import SecretKeyError
from switchyard.common.settings import Settings, SettingsError, add_arguments, from_namespace

# On SIGTERM open requests get this long to finish; then they end with a retryable 503.
GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, with two changes for a supervised service:

    - it re-raises the signal that stopped it after shutdown (exit status 128+n); a requested,
      clean stop should exit 0 instead;
    - requests still open `GRACE_S` after the stop are failed (503, Retry-After) and cancelled
      at the scheduler, rather than cut off mid-response.
    """

    def __init__(self, config: uvicorn.Config, on_grace_expired: Callable[[], Any]) -> None:
        super().__init__(config)
        self.on_grace_expired = on_grace_expired

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        async def expire() -> None:
            await asyncio.sleep(GRACE_S)
            self.on_grace_expired()

        timer = asyncio.create_task(expire())
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(app: Starlette, host: str, port: int) -> uvicorn.Server:
    gateway = app.state.gateway
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_config=None,
                            lifespan="on", loop="asyncio",
                            timeout_graceful_shutdown=GRACE_S + 2.0,
                            **server_limits(app.state.connection_limits,
                                            gateway.settings.read_timeout_s))
    client = gateway.client
    return _Server(config, on_grace_expired=client.fail_in_flight)


def run(settings: Settings) -> None:
    boot_id = new_boot_id()
    log = configure_logging("gateway", boot_id, level=settings.log_level,
                            fmt=settings.log_format, log_content=settings.log_content)
    from switchyard.common.tokenizer_loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(settings.model)
    except Exception as exc:  # process boundary: say why, exit non-zero
        log.error("gateway.tokenizer_failed", model=settings.model,
                  error_type=type(exc).__name__, error=str(exc))
        raise SystemExit(1) from None
    try:
        app = build_app(settings, tokenizer, boot_id=boot_id)
    except SecretKeyError as exc:  # the salt key is not ours or not private: say so, exit 2
        log.error("gateway.salt_key_refused", error=str(exc))
        raise SystemExit(2) from None
    except SettingsError as exc:  # the peer key (--peer): missing, not private, not a key
        log.error("gateway.peer_key_refused", error=str(exc))
        raise SystemExit(2) from None
    log.info("gateway.starting", host=settings.host, port=settings.port,
             model=app.state.gateway.model_id)
    server = make_server(app, settings.host, settings.port)
    server.run()  # a port that cannot be bound: uvicorn logs it and exits non-zero
    log.info("gateway.stopped")


def main(argv: list[str] | None = None) -> None:
    """`python -m switchyard.gateway --model ...`: the gateway alone (the supervisor uses `run`)."""
    parser = argparse.ArgumentParser(prog="python -m switchyard.gateway", description=__doc__)
    add_arguments(parser)
    try:
        settings = from_namespace(parser.parse_args(argv))
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run(settings)
