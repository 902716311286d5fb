"""Fetching an image URL, only when the server allows it (--image-fetch; off by default).

A client that can make the server fetch URLs can make it probe its own network, so a fetch:
- resolves the host once and refuses it when any address is not a public one (loopback,
  private, link-local, multicast, reserved, unspecified, the cloud metadata address), then
  connects to exactly the address it checked (a DNS answer that changes between the check and
  the connection cannot redirect it; TLS still verifies the host name);
- follows no redirects (a redirect to a private address would bypass the check);
- reads at most --image-fetch-bytes, and gives up after --image-fetch-timeout-s in all.
It runs in the image decoding threads (gateway/vision/images.py), never on the event loop.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from switchyard.gateway.errors import invalid

_READ = 65536


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int
    timeout_s: float


def refused(ref, problem: str, code: str = "image_fetch_failed") -> Exception:
    return invalid(f"'{ref.param}': {problem}", param=ref.param, code=code)


def fetch_image(ref, limits: FetchLimits | None) -> bytes:
    if limits is None:
        raise refused(ref, "fetching image URLs is off on this server (start it with "
                           "--image-fetch); send the image as a data: URL instead",
                      "image_fetch_disabled")
    parts = urlsplit(ref.url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
        raise refused(ref, "the URL must be http(s)://host/path, without credentials",
                      "invalid_image_url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise refused(ref, "the URL's port is not valid", "invalid_image_url") from None
    deadline = time.monotonic() + limits.timeout_s
    address = _public_address(ref, host, port)
    conn = _Connection(address, host, port, parts.scheme == "https",
                       max(0.1, deadline - time.monotonic()))
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Host": parts.netloc.rpartition("@")[2],
                                           "Accept": "image/*", "User-Agent": "switchyard"})
        response = conn.getresponse()
        if response.status != 200:
            raise refused(ref, f"fetching the URL answered HTTP {response.status} (redirects "
                               "are not followed)")
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > limits.max_bytes:
            raise refused(ref, f"the image at the URL is {length} bytes, more than "
                               f"{limits.max_bytes} (--image-fetch-bytes)", "image_too_large")
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise refused(ref, f"fetching the URL took longer than {limits.timeout_s:g} s")
            chunk = response.read(_READ)
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_bytes:
                raise refused(ref, f"the image at the URL is more than {limits.max_bytes} "
                                   "bytes (--image-fetch-bytes)", "image_too_large")
            chunks.append(chunk)
        return b"".join(chunks)
    except (OSError, http.client.HTTPException) as exc:
        raise refused(ref, f"fetching the URL failed ({type(exc).__name__})") from None
    finally:
        conn.close()


def _public_address(ref, host: str, port: int) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise refused(ref, f"the host {host!r} could not be resolved") from None
    addresses = {info[4][0] for info in infos}
    for address in addresses:
        if not is_public(address):
            raise refused(ref, f"the host {host!r} is not on the public internet ({address}); "
                               "URLs of loopback, private or link-local addresses are never "
                               "fetched", "image_url_not_allowed")
    return sorted(addresses)[0]


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback
                                 or ip.is_link_local or ip.is_private or ip.is_unspecified)


class _Connection(http.client.HTTPConnection):
    """An HTTP(S) connection to an address checked beforehand, naming `host` for TLS."""

    def __init__(self, address: str, host: str, port: int, tls: bool, timeout: float):
        super().__init__(address, port, timeout=timeout)
        self._server_name = host
        self._tls = tls

    def connect(self) -> None:
        super().connect()
        if self._tls:
            context = ssl.create_default_context()
            self.sock = context.wrap_socket(self.sock, server_hostname=self._server_name)
