"""Remembered assistant turns on disk: prefix-stable rendering survives a gateway restart
(docs/design.md "Prefix-stable history").

Without it, a restarted gateway renders each earlier reply from its text again, and for a
family whose rendering does not round-trip (Qwen3's think blocks, a tokenization decode +
encode does not reproduce) the next turn's prompt leaves the KV the server holds at the first
such reply: it pays a re-read although its pages are in a slot or on disk.

`<runtime dir>/turns.journal` (the group's private 0700 directory, which outlives its
processes; what it holds is as sensitive as the page files' token ids): a header (magic,
format version, the tokenizer's identity), then one record per remembered turn: length,
blake2b-128 checksum, msgpack body. It is created 0600 without following a symlink.
Loading keeps the records up to the first that does not verify (an append torn by kill -9) and
cuts the file there; a file of another tokenizer or version, or one that cannot be read, is
started afresh. When the file outgrows twice what its
live turns need (or `max_bytes`), it is rewritten with them (temp file, rename): the newest that
fit in half of `max_bytes`.
A write error turns persistence off with a warning; the in-memory turns keep working.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import structlog

log = structlog.get_logger()

FILE_NAME = "turns.journal"
MAGIC = b"SYTURNS1"
_HEADER = struct.Struct("<8s16s")  # magic, tokenizer identity
_RECORD = struct.Struct("<I16s")  # body length, blake2b-128 of the body
DEFAULT_MAX_BYTES = 64 << 20
_MIN_REWRITE_BYTES = 1 << 20
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


class TurnRecord(msgspec.Struct, array_like=True):
    key: str
    calls: str  # JSON of [[name, arguments], ...] as `history._calls` gives them
    call_ids: list[str]
    body: bytes  # int32 token ids
    opening: str | None
    has_reasoning: bool

    def body_ids(self) -> array:
        ids = array("i")
        ids.frombytes(self.body)
        return array("l", ids)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TurnRecord)


def make_record(key: str, calls: Iterable[tuple[str, Any]], call_ids: Iterable[str],
                body: Iterable[int], opening: str | None, has_reasoning: bool) -> TurnRecord:
    return TurnRecord(key, json.dumps([list(c) for c in calls], default=str), list(call_ids),
                      array("i", body).tobytes(), opening, has_reasoning)


def record_calls(record: TurnRecord) -> tuple[tuple[str, Any], ...]:
    return tuple((str(name), arguments) for name, arguments in json.loads(record.calls))


def tokenizer_identity(tokenizer: Any) -> bytes:
    """What token ids mean: the chat template and a sample of the vocabulary (ids from another
    tokenizer spliced into a prompt would be other text)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(getattr(tokenizer, "chat_template", None)).encode("utf-8", "replace"))
    try:
        size = int(getattr(tokenizer, "vocab_size", 0) or 0) + len(
            getattr(tokenizer, "added_tokens_decoder", {}) or {})
        h.update(str(size).encode())
        sample = list(range(0, size, max(1, size // 512)))
        h.update(json.dumps(tokenizer.convert_ids_to_tokens(sample), default=str)
                 .encode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - a tokenizer without these: the template alone
        h.update(type(tokenizer).__name__.encode())
    return h.digest()


def _frame(record: TurnRecord) -> bytes:
    body = _encoder.encode(record)
    return _RECORD.pack(len(body), hashlib.blake2b(body, digest_size=16).digest()) + body


class TurnJournal:
    def __init__(self, path: Path, identity: bytes, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = Path(path)
        self.identity = identity
        self.max_bytes = max_bytes
        self.fd = -1
        self.size = 0
        self.enabled = True

    def load(self) -> list[tuple[TurnRecord, int]]:
        """The turns on disk, oldest first, with the bytes each takes; opens the journal for
        appending."""
        records: list[tuple[TurnRecord, int]] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
            if not _is_regular(self.fd):
                raise OSError(f"{self.path} is not a regular file")
            data = _read_all(self.fd)
            good = self._parse(data, records)
            if good == 0:
                records = []
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, _HEADER.pack(MAGIC, self.identity), 0)
                good = _HEADER.size
            elif good < len(data):
                os.ftruncate(self.fd, good)  # a torn or damaged append: keep what verified
            self.size = good
        except OSError as exc:
            self._off(exc)
            return []
        log.info("history.journal_loaded", path=str(self.path), num_turns=len(records),
                 num_bytes=self.size)
        return records

    def _parse(self, data: bytes, out: list[tuple[TurnRecord, int]]) -> int:
        """Bytes of `data` that verify (0: not our journal, or another tokenizer's)."""
        if len(data) < _HEADER.size or _HEADER.unpack_from(data) != (MAGIC, self.identity):
            return 0
        pos = _HEADER.size
        while pos + _RECORD.size <= len(data):
            length, digest = _RECORD.unpack_from(data, pos)
            body = data[pos + _RECORD.size:pos + _RECORD.size + length]
            if len(body) != length or hashlib.blake2b(body, digest_size=16).digest() != digest:
                break
            try:
                out.append((_decoder.decode(body), _RECORD.size + length))
            except msgspec.DecodeError:
                break
            pos += _RECORD.size + length
        return pos

    def append(self, record: TurnRecord) -> int:
        """Add a turn; returns the bytes it takes in the file (0: not persisted)."""
        if self.fd < 0:
            return 0
        frame = _frame(record)
        try:
            os.pwrite(self.fd, frame, self.size)
        except OSError as exc:
            self._off(exc)
            return 0
        self.size += len(frame)
        return len(frame)

    def needs_rewrite(self, live_bytes: int) -> bool:
        """Whether the file has grown well past what the live turns take (or past the cap)."""
        return self.fd >= 0 and (self.size > max(2 * live_bytes, _MIN_REWRITE_BYTES)
                                 or self.size > self.max_bytes)

    def rewrite(self, live: list[TurnRecord]) -> list[int]:
        """The file again, with only `live` (oldest first; the newest that fit in half of
        `max_bytes`); returns the bytes each takes now (0: left out)."""
        if self.fd < 0:
            return [0] * len(live)
        try:
            return self._rewrite(live)
        except OSError as exc:
            self._off(exc)
            return [0] * len(live)

    def _rewrite(self, live: list[TurnRecord]) -> list[int]:
        frames, total = [], _HEADER.size
        for record in reversed(live):  # newest first, up to the cap
            frame = _frame(record)
            if total + len(frame) > self.max_bytes // 2:  # room to append before the next
                break
            frames.append(frame)
            total += len(frame)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
        try:
            os.write(fd, _HEADER.pack(MAGIC, self.identity) + b"".join(reversed(frames)))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR | _OPEN_FLAGS)
        self.size = total
        sizes = [len(f) for f in frames]  # newest first
        return [0] * (len(live) - len(sizes)) + sizes[::-1]

    def _off(self, exc: OSError) -> None:
        if self.enabled:
            log.warning("history.journal_off", path=str(self.path), error=str(exc))
        self.enabled = False
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""
