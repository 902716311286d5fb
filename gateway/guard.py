"""What a web page in the user's browser must not be able to do (docs/design/security.md "Security").

Without an API key (the loopback default) any page the user visits can send requests to
127.0.0.1: a `text/plain` POST needs no CORS preflight, and DNS rebinding (a hostile name that
resolves to 127.0.0.1) lets the page read the replies. Three checks, as Redis' protected mode,
Jupyter and Vite do them, applied to every request before the API key:

- **Host**: a loopback name (`localhost`, `127.0.0.1`, `::1`), the `--host` the gateway binds,
  or one of `--allowed-hosts` ('*': any). A wildcard bind (0.0.0.0, ::) needs an API key
  anyway and accepts any Host unless `--allowed-hosts` is given. Else 403 `host_not_allowed`.
- **Origin** (sent by browsers): absent, the request's own origin (the dashboard), or one of
  `--allowed-origins` ('*': any; such origins also get CORS headers). Else 403
  `origin_not_allowed`.
- **Content-Type** of POSTs to the JSON APIs: JSON (`application/json`, `application/*+json`). Else
  415 `unsupported_media_type`, so no form or `text/plain` body is ever acted on.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Scope

from switchyard.gateway.errors import APIError
from switchyard.common.settings import LOOPBACK_HOSTS, Settings

WILDCARD_BINDS = ("0.0.0.0", "::", "")
# The routes that take a JSON body (others answer a POST with 404/405 as before).
JSON_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                         "/v1/messages", "/v1/messages/count_tokens"})


def _split(text: str) -> frozenset[str]:
    return frozenset(part.strip().lower().rstrip("/") for part in text.split(",")
                     if part.strip())


@dataclass(frozen=True)
class GuardPolicy:
    hosts: frozenset[str]  # allowed Host names (no port); "*" for any
    origins: frozenset[str]  # allowed Origins besides the request's own; "*" for any

    @classmethod
    def from_settings(cls, settings: Settings) -> "GuardPolicy":
        hosts = set(LOOPBACK_HOSTS) | set(_split(settings.allowed_hosts))
        if settings.host in WILDCARD_BINDS and not settings.allowed_hosts:
            hosts.add("*")
        elif settings.host:
            hosts.add(settings.host.lower().strip("[]"))
        return cls(frozenset(hosts), _split(settings.allowed_origins))

    def check(self, scope: Scope) -> APIError | None:
        """The reason to refuse this request, or None."""
        headers = _headers(scope)
        host = headers.get("host")
        if host is not None and "*" not in self.hosts and host_name(host) not in self.hosts:
            return APIError(403, f"Host {host!r} is not allowed: use a loopback address, or "
                                 f"start the server with --allowed-hosts",
                            type="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, scope, host):
            return APIError(403, f"Origin {origin!r} is not allowed (browser requests from "
                                 f"other sites are refused; see --allowed-origins)",
                            type="permission_error", code="origin_not_allowed")
        if scope["method"] == "POST" and scope["path"] in JSON_ROUTES:
            if not is_json(headers.get("content-type", "")):
                return APIError(415, "Content-Type must be application/json",
                                code="unsupported_media_type")
        return None

    def origin_allowed(self, origin: str, scope: Scope, host: str | None) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        scheme = scope.get("scheme", "http")
        return host is not None and origin == f"{scheme}://{host.lower()}"


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def host_name(host: str) -> str:
    """`Host` without its port: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))
