"""Remembered assistant turns on disk: prefix-stable rendering survives a gateway restart
(docs/design/requests.md "Prefix-stable history").

Without it, a restarted gateway renders each earlier reply from its text again, and for a
family whose rendering does not round-trip (Qwen3's think blocks, a tokenization decode +
encode does not reproduce) the next turn's prompt leaves the KV the server holds at the first
such reply: it pays a re-read although its pages are in a slot or on disk.

`<runtime dir>/turns-<first 8 hex of the tokenizer identity>.journal` (the group's private 0700
directory, which outlives its processes; what it holds is as sensitive as the page files' token
ids): a header (magic, which is also the format version, the tokenizer's identity), then
records: length, blake2b-128 checksum, msgpack body. A record is a remembered turn (with the
digest of the prompt tokens it followed: the conversation it belongs to), or names an
earlier turn record by its offset in the file: "forgotten" (the memory's LRU let it go, one per
turn remembered once the memory is full: it does not load back, so a restarted memory holds
just the turns the old one held, not the last `max_turns` remembered), or "used" (looked up: it
loads back as recently used, so the turns pushed out after a restart are the ones the old
memory would have pushed out; an agent resends its whole history, so its early turns are the
ones in use). A turn gets a "used" record only when it was last appended or marked more than
max_turns/2 turns ago: an agent that resends 200 turns per request writes none for most
requests, each live turn at most one per max_turns/2 turns remembered (two per turn remembered,
plus one per live turn after a load or rewrite), and the loaded order is the LRU's with each
turn's last use known to within max_turns/2 remembered turns.

The file is created 0600 without following a symlink. Loading keeps the records up to the
first that does not verify (an append torn by kill -9) and cuts the file there; a file of
another tokenizer or format, or one that cannot be read, is started afresh. When the file
outgrows twice what its live turns need (or `max_bytes`), it is rewritten with them in LRU
order (temp file, rename): the most recently used that fit in half of `max_bytes`; offsets
change only then. One file per tokenizer identity, so switching models on a runtime dir and
back keeps each model's turns; the `KEEP_JOURNALS` most recently used stay (loading one
touches it), older ones are removed.
A write error turns persistence off with a warning; the in-memory turns keep working.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

log = structlog.get_logger()

# 2: "used" records (turns load back in LRU order), one file per tokenizer; 3: a turn names
# the prompt tokens it followed (its prefix digest). A file of an older format loads as empty.
MAGIC = b"SYTURNS3"
_NAME = re.compile(r"turns-[0-9a-f]{8}\.journal")
_FIRST_FORMAT_NAME = "turns.journal"
KEEP_JOURNALS = 4  # tokenizers whose journals a runtime dir keeps (the most recently used)
_HEADER = struct.Struct("<8s16s")  # magic, tokenizer identity
_RECORD = struct.Struct("<I16s")  # body length, blake2b-128 of the body
DEFAULT_MAX_BYTES = 64 << 20
_MIN_REWRITE_BYTES = 1 << 20
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


class TurnRecord(msgspec.Struct, array_like=True, tag=0):
    key: str
    calls: str  # JSON of [[name, arguments], ...] as `history._calls` gives them
    call_ids: list[str]
    body: bytes  # int32 token ids
    opening: str | None
    has_reasoning: bool
    prefix: bytes  # turn_keys.prefix_digest of the prompt tokens the turn followed

    def body_ids(self) -> array:
        ids = array("i")
        ids.frombytes(self.body)
        return array("l", ids)


class Used(msgspec.Struct, array_like=True, tag=1):
    offset: int  # of the turn's record in the file


class Forgotten(msgspec.Struct, array_like=True, tag=2):
    offset: int  # of the turn's record in the file


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TurnRecord | Used | Forgotten)


def make_record(key: str, calls: Iterable[tuple[str, Any]], call_ids: Iterable[str],
                body: Iterable[int], opening: str | None, has_reasoning: bool,
                prefix: bytes) -> TurnRecord:
    return TurnRecord(key, json.dumps([list(c) for c in calls], default=str), list(call_ids),
                      array("i", body).tobytes(), opening, has_reasoning, prefix)


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


def _frame(record: TurnRecord | Used | Forgotten) -> bytes:
    body = _encoder.encode(record)
    return _RECORD.pack(len(body), hashlib.blake2b(body, digest_size=16).digest()) + body


@dataclass(slots=True)
class Placed:
    """Where a turn's record is in the file, and when it was last appended or marked used."""
    offset: int
    nbytes: int
    mark: int  # the file's count of turn records then


class TurnJournal:
    def __init__(self, path: Path, identity: bytes, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = Path(path)
        self.identity = identity
        self.max_bytes = max_bytes
        self.fd = -1
        self.size = 0
        self.turns = 0  # turn records in the file: the clock "used" marks are timed by
        self.enabled = True

    @classmethod
    def in_dir(cls, directory: Path, identity: bytes,
               max_bytes: int = DEFAULT_MAX_BYTES) -> TurnJournal:
        """The journal of this tokenizer in a runtime dir (one file per identity)."""
        return cls(Path(directory) / f"turns-{identity.hex()[:8]}.journal", identity, max_bytes)

    def load(self) -> list[tuple[TurnRecord, Placed]]:
        """The turns on disk, least recently used first; opens the journal for appending and
        removes other tokenizers' journals beyond the `KEEP_JOURNALS` most recently used."""
        turns: list[tuple[TurnRecord, Placed]] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
            if not _is_regular(self.fd):
                raise OSError(f"{self.path} is not a regular file")
            data = _read_all(self.fd)
            good = self._parse(data, turns)
            if good == 0:
                turns = []
                self.turns = 0
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, _HEADER.pack(MAGIC, self.identity), 0)
                good = _HEADER.size
            elif good < len(data):
                os.ftruncate(self.fd, good)  # a torn or damaged append: keep what verified
            self.size = good
            os.utime(self.fd)  # used now: pruning keeps the most recently used
        except OSError as exc:
            self._off(exc)
            return []
        log.info("history.journal_loaded", path=str(self.path), num_turns=len(turns),
                 num_bytes=self.size)
        self._remove_others()
        return turns

    def _parse(self, data: bytes, out: list[tuple[TurnRecord, Placed]]) -> int:
        """Bytes of `data` that verify (0: not our journal, or another tokenizer's); the turns
        go to `out` in the order of their last record (a turn's own, or its last "used"),
        without those forgotten."""
        if len(data) < _HEADER.size or _HEADER.unpack_from(data) != (MAGIC, self.identity):
            return 0
        turns: OrderedDict[int, tuple[TurnRecord, Placed]] = OrderedDict()  # by offset
        self.turns = 0
        pos = _HEADER.size
        while pos + _RECORD.size <= len(data):
            length, digest = _RECORD.unpack_from(data, pos)
            body = data[pos + _RECORD.size:pos + _RECORD.size + length]
            if len(body) != length or hashlib.blake2b(body, digest_size=16).digest() != digest:
                break
            try:
                item = _decoder.decode(body)
            except msgspec.DecodeError:
                break
            if isinstance(item, TurnRecord):
                self.turns += 1
                turns[pos] = (item, Placed(pos, _RECORD.size + length, self.turns))
            elif isinstance(item, Forgotten):
                turns.pop(item.offset, None)
            elif item.offset in turns:  # used (a record names only a turn before it)
                turns.move_to_end(item.offset)
                turns[item.offset][1].mark = self.turns
            pos += _RECORD.size + length
        out.extend(turns.values())
        return pos

    def append(self, record: TurnRecord) -> Placed | None:
        """Add a turn; where it is (None: not persisted)."""
        frame = _frame(record)
        if not self._write(frame):
            return None
        self.turns += 1
        return Placed(self.size - len(frame), len(frame), self.turns)

    def mark_used(self, placed: Placed) -> None:
        """Record that the turn at `placed` was looked up (it loads back as recently used)."""
        if self._write(_frame(Used(placed.offset))):
            placed.mark = self.turns

    def forget(self, placed: Placed) -> None:
        """Record that the turn at `placed` left the memory (it does not load back)."""
        self._write(_frame(Forgotten(placed.offset)))

    def _write(self, frame: bytes) -> bool:
        if self.fd < 0:
            return False
        try:
            os.pwrite(self.fd, frame, self.size)
        except OSError as exc:
            self._off(exc)
            return False
        self.size += len(frame)
        return True

    def needs_rewrite(self, live_bytes: int) -> bool:
        """Whether the file has grown well past what the live turns take (or past the cap)."""
        return self.fd >= 0 and (self.size > max(2 * live_bytes, _MIN_REWRITE_BYTES)
                                 or self.size > self.max_bytes)

    def rewrite(self, live: list[TurnRecord]) -> list[Placed | None]:
        """The file again, with only `live` (least recently used first; the most recently used
        that fit in half of `max_bytes`); where each is now (None: left out)."""
        if self.fd < 0:
            return [None] * len(live)
        try:
            return self._rewrite(live)
        except OSError as exc:
            self._off(exc)
            return [None] * len(live)

    def _rewrite(self, live: list[TurnRecord]) -> list[Placed | None]:
        frames, total = [], _HEADER.size
        for record in reversed(live):  # newest first, up to the cap
            frame = _frame(record)
            if total + len(frame) > self.max_bytes // 2:  # room to append before the next
                break
            frames.append(frame)
            total += len(frame)
        frames.reverse()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
        try:
            os.write(fd, _HEADER.pack(MAGIC, self.identity) + b"".join(frames))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR | _OPEN_FLAGS)
        self.size = total
        self.turns = len(frames)
        placed: list[Placed | None] = [None] * (len(live) - len(frames))
        offset = _HEADER.size
        for n, frame in enumerate(frames, 1):
            placed.append(Placed(offset, len(frame), n))
            offset += len(frame)
        return placed

    def _remove_others(self) -> None:
        """Other tokenizers' journals beyond the most recently used (this one counts) go, and a
        journal of the first format (`turns.journal`, which no gateway reads any more)."""
        others, stale = [], []
        try:
            with os.scandir(self.path.parent) as entries:
                for entry in entries:
                    if entry.name == self.path.name:
                        continue
                    if entry.name == _FIRST_FORMAT_NAME:
                        stale.append(entry.name)
                    elif _NAME.fullmatch(entry.name):
                        others.append((entry.stat(follow_symlinks=False).st_mtime_ns,
                                       entry.name))
        except OSError as exc:
            log.warning("history.journal_prune_failed", path=str(self.path.parent),
                        error=str(exc))
            return
        others.sort(reverse=True)  # most recently used first
        for name in stale + [name for _, name in others[KEEP_JOURNALS - 1:]]:
            try:
                os.unlink(self.path.parent / name)  # a symlink itself, never its target
            except OSError as exc:
                log.warning("history.journal_prune_failed", path=name, error=str(exc))
                continue
            log.info("history.journal_removed", path=str(self.path.parent / name))

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
