"""--image-fetch against local servers that drip their answer: one deadline for the whole
fetch (headers and body alike), fetches on threads of their own so a data: URL image of
another request is not held behind them, and a request that ends shuts its fetches down.
The public-address check is lifted for 127.0.0.1 here (it is tested in
tests/unit/test_gateway_images.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time

import pytest
from PIL import Image

from switchyard.gateway.errors import APIError
from switchyard.gateway.vision import fetch as fetch_module
from switchyard.gateway.vision.fetch import FetchLimits, fetch_image
from switchyard.gateway.vision.images import ImageDecoder
from switchyard.gateway.vision.parts import ImageRef

DEADLINE = 1.5
DRIP_S = 0.2


def png(width=16, height=16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


class DripServer:
    """Answers every connection one byte every DRIP_S s: the head itself (`phase="header"`),
    or a whole head and then the body (`phase="body"`). Counts the connections still open."""

    def __init__(self, phase: str):
        self.phase = phase
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = 0
        self.closed_at: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with self._lock:
            self.open += 1
        try:
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
            if self.phase == "header":
                stream = head + b"X-Slow: " + b"a" * 100000
            else:
                conn.sendall(head + b"Content-Length: 1000000\r\n\r\n")
                stream = png() * 1000
            for i in range(len(stream)):
                if self._stop.is_set():
                    return
                conn.sendall(stream[i:i + 1])
                time.sleep(DRIP_S)
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self.open -= 1
                self.closed_at.append(time.monotonic())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/a.png"

    def close(self):
        self._stop.set()
        self.listener.close()


@pytest.fixture(autouse=True)
def loopback_is_public(monkeypatch):
    monkeypatch.setattr(fetch_module, "is_public", lambda address: True)


@pytest.fixture(params=["header", "body"])
def drip(request):
    server = DripServer(request.param)
    yield server
    server.close()


def test_a_dripping_server_is_cut_at_the_deadline(drip):
    began = time.monotonic()
    with pytest.raises(APIError) as raised:
        fetch_image(ImageRef("u", url=drip.url), FetchLimits(10_000_000, DEADLINE))
    took = time.monotonic() - began
    print(f"{drip.phase} drip: fetch ended after {took:.3f} s, deadline {DEADLINE} s")
    assert raised.value.status == 400 and raised.value.code == "image_fetch_timeout"
    assert abs(took - DEADLINE) <= 0.5, took


def test_a_data_url_image_is_not_held_behind_dripping_fetches():
    drip = DripServer("header")
    decoder = ImageDecoder(200 * 200, FetchLimits(10_000_000, 2.0))
    data_ref = ImageRef("d", data=png())

    async def scenario():
        began = time.monotonic()
        await decoder.decode_all([data_ref])  # warm: Pillow's import, the pools' threads
        solo = time.monotonic() - began
        slow = [asyncio.ensure_future(decoder.decode_all([ImageRef(f"u{i}", url=drip.url)]))
                for i in range(2)]
        while drip.open < 2:
            await asyncio.sleep(0.02)
        began = time.monotonic()
        (image,) = await decoder.decode_all([data_ref])
        delayed = time.monotonic() - began
        for task in slow:
            with pytest.raises(APIError):
                await task
        return solo, delayed, image

    try:
        solo, delayed, image = asyncio.run(scenario())
    finally:
        decoder.shutdown()
        drip.close()
    print(f"data: URL image decoded in {delayed:.3f} s beside two dripping fetches "
          f"(alone {solo:.3f} s)")
    assert image.width == 16 and delayed <= 0.5, delayed


def test_a_request_that_ends_shuts_its_fetch_down():
    drip = DripServer("body")
    decoder = ImageDecoder(200 * 200, FetchLimits(10_000_000, 30.0))

    async def scenario():
        task = asyncio.ensure_future(decoder.decode_all([ImageRef("u", url=drip.url)]))
        while drip.open < 1:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        task.cancel()
        cancelled = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        while drip.open:
            assert time.monotonic() - cancelled < 2.0, "the fetch kept its connection"
            await asyncio.sleep(0.02)
        return drip.closed_at[0] - cancelled

    try:
        after = asyncio.run(scenario())
    finally:
        decoder.shutdown()
        drip.close()
    # the server notices at its next byte written into the shut connection
    assert after < 2 * DRIP_S + 0.5, after
