"""Fetching an image URL, only when the server allows it (--image-fetch; off by default).

A client that can make the server fetch URLs can make it probe its own network, so a fetch:
- resolves the host once and refuses it when any address is not a public one (loopback,
  private, link-local, multicast, reserved, unspecified, the cloud metadata address), then
  connects to exactly the address it checked (a DNS answer that changes between the check and
  the connection cannot redirect it; TLS still verifies the host name);
- follows no redirects (a redirect to a private address would bypass the check);
- reads at most --image-fetch-bytes;
- gives up after --image-fetch-timeout-s in all, counted from the moment the request asked for
  the image: the name is resolved on a thread of its own and waited for at most the time left,
  each socket operation times out at the time left, and a timer shuts the socket down at the
  deadline, so a server dripping a byte at a time (into the headers or the body) cannot hold
  the fetch past it; cancelling the fetch (the client left) shuts it down the same way;
- judges an IPv6 address that carries an IPv4 one (6to4 2002::/16, Teredo 2001::/32, NAT64
  64:ff9b::/96 and the local-use 64:ff9b:1::/48) by the IPv4 address inside it as well.
It runs on threads of its own (`FETCH_THREADS`, gateway/vision/images.py), never on the event
loop nor on the decoding threads, so slow URLs cannot hold other clients' images.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


class Fetch:
    """One fetch's deadline and its way out: `cancel` (or the deadline's timer) shuts the
    connection's socket down, which ends a read blocked in it at once."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.cancelled = False
        self.expired = False
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer: threading.Timer | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            self._shut()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def watch(self, sock: socket.socket) -> None:
        """Arms the deadline on the connected socket (shut at once if already past or
        cancelled); called again with the TLS socket that took its place."""
        with self._lock:
            self._sock = sock
            if self._timer is not None:  # the same connection, now wrapped in TLS
                if self.expired or self.cancelled:
                    self._shut()
                return
            left = self.left()
            if self.cancelled or left <= 0:
                self.expired = self.expired or left <= 0
                self._shut()
                return
            self._timer = threading.Timer(left, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._sock = None

    @property
    def over(self) -> bool:
        return self.cancelled or self.expired or self.left() <= 0


# Name resolution cannot be interrupted: it runs here and is waited for at most the time left
# (a resolver that hangs keeps one of these threads until the system's own resolver timeout).
_RESOLVER = ThreadPoolExecutor(4, thread_name_prefix="image-dns")


def fetch_image(ref, limits: FetchLimits | None, fetch: Fetch | None = None) -> bytes:
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
    fetch = fetch or Fetch(limits.timeout_s)
    too_slow = refused(ref, f"fetching the URL took longer than {limits.timeout_s:g} s "
                            "(--image-fetch-timeout-s)", "image_fetch_timeout")
    if fetch.over:
        raise too_slow
    address = _public_address(ref, host, port, fetch, too_slow)
    if fetch.over:
        raise too_slow
    conn = _Connection(address, host, port, parts.scheme == "https", fetch)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Host": parts.netloc.rpartition("@")[2],
                                           "Accept": "image/*", "User-Agent": "switchyard"})
        response = conn.getresponse()
        if fetch.over:
            raise too_slow
        if response.status != 200:
            raise refused(ref, f"fetching the URL answered HTTP {response.status} (redirects "
                               "are not followed)")
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > limits.max_bytes:
            raise refused(ref, f"the image at the URL is {length} bytes, more than "
                               f"{limits.max_bytes} (--image-fetch-bytes)", "image_too_large")
        chunks, size = [], 0
        while True:
            if fetch.over:
                raise too_slow
            chunk = response.read1(_READ)
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_bytes:
                raise refused(ref, f"the image at the URL is more than {limits.max_bytes} "
                                   "bytes (--image-fetch-bytes)", "image_too_large")
            chunks.append(chunk)
        if fetch.over:  # a socket shut at the deadline reads as the end of the body
            raise too_slow
        return b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if fetch.over:
            raise too_slow from None
        raise refused(ref, f"fetching the URL failed ({type(exc).__name__})") from None
    finally:
        fetch.stop()
        conn.close()


def _public_address(ref, host: str, port: int, fetch: Fetch, too_slow: Exception) -> str:
    job = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = job.result(timeout=max(0.0, fetch.left()))
    except FutureTimeout:
        job.cancel()
        raise too_slow from None
    except (OSError, UnicodeError):
        raise refused(ref, f"the host {host!r} could not be resolved") from None
    addresses = {info[4][0] for info in infos}
    for address in addresses:
        if not is_public(address):
            raise refused(ref, f"the host {host!r} is not on the public internet ({address}); "
                               "URLs of loopback, private or link-local addresses are never "
                               "fetched", "image_url_not_allowed")
    return sorted(addresses)[0]


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (and a packet to it may reach)."""
    found = []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)  # (server, client): the client's is de-obfuscated
    if ip in _NAT64:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    elif ip in _NAT64_LOCAL:
        # RFC 6052 lets a local-use prefix be /48, /56, /64 or /96 long, and the address says
        # not which: every place an IPv4 address could sit is judged.
        b = ip.packed
        found.extend(ipaddress.IPv4Address(x) for x in (
            b[6:8] + b[9:11], b[7:8] + b[9:12], b[9:13], b[12:16]))
    return found


def _public_ip(ip) -> bool:
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback
                                 or ip.is_link_local or ip.is_private or ip.is_unspecified)


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_ipv4(ip)
        if ip.ipv4_mapped is not None or ip in _NAT64:
            # the address is only a way to the IPv4 one (Python counts 64:ff9b::/96 in the
            # reserved ::/8, though it is the globally routed well-known NAT64 prefix)
            return _public_ip(inner[0])
        if not all(_public_ip(v4) for v4 in inner):
            return False
    return _public_ip(ip)


class _Connection(http.client.HTTPConnection):
    """An HTTP(S) connection to an address checked beforehand, naming `host` for TLS."""

    def __init__(self, address: str, host: str, port: int, tls: bool, fetch: Fetch):
        super().__init__(address, port, timeout=max(0.01, fetch.left()))
        self._server_name = host
        self._tls = tls
        self._fetch = fetch

    def connect(self) -> None:
        super().connect()  # bounded by the time left (the connection's timeout)
        self._fetch.watch(self.sock)  # from here the timer shuts the socket at the deadline
        self.sock.settimeout(max(0.01, self._fetch.left()))
        if self._tls:
            context = ssl.create_default_context()
            self.sock = context.wrap_socket(self.sock, server_hostname=self._server_name,
                                            do_handshake_on_connect=False)
            self._fetch.watch(self.sock)  # the handshake too is cut at the deadline
            self.sock.do_handshake()
