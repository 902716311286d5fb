"""Remembered turns on disk (gateway/prompting/turn_journal.py): a restarted gateway loads them;
the file is private, bounded, and a torn, damaged or foreign file never yields a wrong turn."""

import os
import stat

from gateway.prompting.history import TurnMemory
from gateway.prompting.turn_journal import TurnJournal

ID = b"i" * 16
CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def reply(i, calls=False):
    msg = {"role": "assistant", "content": f"reply number {i}"}
    if calls:
        msg["tool_calls"] = [CALL]
    return msg


def memory(path, identity=ID, max_bytes=64 << 20, max_turns=1024):
    return TurnMemory(max_turns, journal=TurnJournal(path, identity, max_bytes))


def test_a_new_gateway_finds_the_turns_the_last_one_remembered(tmp_path):
    path = tmp_path / "turns.journal"
    first = memory(path)
    first.remember(reply(1), [5, 6, 7], "<|im_start|>assistant\n", False)
    first.remember(reply(2, calls=True), list(range(300, 800)), None, True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = memory(path)  # kill -9 of the first: nothing was closed or flushed beyond write()
    assert len(again) == 2
    one = again.lookup(reply(1))
    assert list(one.body) == [5, 6, 7] and one.opening == "<|im_start|>assistant\n"
    two = again.lookup({"role": "assistant", "content": "other text", "tool_calls": [CALL]})
    assert two is not None  # by its call id, its calls unchanged (as in memory)
    assert again.lookup({**reply(2), "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}) is None
    two = again.lookup(reply(2, calls=True))
    assert list(two.body) == list(range(300, 800)) and two.has_reasoning
    assert two.call_ids == ("call_7",)


def test_a_torn_append_keeps_the_turns_before_it(tmp_path):
    path = tmp_path / "turns.journal"
    m = memory(path)
    for i in range(3):
        m.remember(reply(i), [i] * 10, None, False)
    size = os.path.getsize(path)
    os.truncate(path, size - 5)  # the last append cut short
    again = memory(path)
    assert len(again) == 2 and again.lookup(reply(2)) is None
    again.remember(reply(9), [9], None, False)  # appends after the good part
    assert len(memory(path)) == 3


def test_a_damaged_record_ends_what_is_loaded(tmp_path):
    path = tmp_path / "turns.journal"
    m = memory(path)
    for i in range(3):
        m.remember(reply(i), [i] * 50, None, False)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = memory(path)
    assert len(again) < 3
    for i in range(3):
        turn = again.lookup(reply(i))
        assert turn is None or list(turn.body) == [i] * 50


def test_another_tokenizers_or_garbage_file_starts_empty(tmp_path):
    path = tmp_path / "turns.journal"
    memory(path).remember(reply(1), [1, 2], None, False)
    assert len(memory(path, identity=b"x" * 16)) == 0  # token ids of another vocabulary
    path.write_bytes(b"not a journal at all")
    m = memory(path)
    assert len(m) == 0
    m.remember(reply(3), [3], None, False)
    assert len(memory(path)) == 1


def test_a_symlink_is_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    path = tmp_path / "turns.journal"
    path.symlink_to(target)
    m = memory(path)
    m.remember(reply(1), [1], None, False)
    assert m.lookup(reply(1)) is not None  # memory still works, without the file
    assert target.read_bytes() == b"keep me"


def test_the_file_stays_bounded_and_keeps_the_newest(tmp_path):
    path = tmp_path / "turns.journal"
    cap = 256 << 10
    m = memory(path, max_bytes=cap)
    sizes = []
    for i in range(400):
        m.remember(reply(i), list(range(i, i + 500)), None, False)  # ~2 KB each
        sizes.append(os.path.getsize(path))
    assert max(sizes) <= cap + 4096
    again = memory(path)
    assert again.lookup(reply(399)) is not None
    assert again.lookup(reply(0)) is None


def test_only_live_turns_are_kept_on_disk(tmp_path):
    path = tmp_path / "turns.journal"
    m = memory(path, max_turns=4)
    for i in range(2000):
        m.remember(reply(i), list(range(100)), None, False)
    assert os.path.getsize(path) < (2 << 20)  # rewritten with the 4 live turns
    assert len(memory(path, max_turns=4)) == 4
