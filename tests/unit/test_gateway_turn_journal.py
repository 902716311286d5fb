"""Remembered turns on disk (gateway/prompting/turn_journal.py): a restarted gateway loads them,
the ones in use rather than the last remembered; the file is private, bounded, and a torn,
damaged or foreign file never yields a wrong turn; each tokenizer keeps its own file."""

import os
import stat

from switchyard.gateway.prompting.history import TurnMemory
from switchyard.gateway.prompting.turn_journal import KEEP_JOURNALS, TurnJournal

ID = b"i" * 16
CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def reply(i, calls=False):
    msg = {"role": "assistant", "content": f"reply number {i}"}
    if calls:
        msg["tool_calls"] = [CALL]
    return msg


def journal_path(directory, identity=ID):
    return TurnJournal.in_dir(directory, identity).path


def memory(path, identity=ID, max_bytes=64 << 20, max_turns=1024):
    return TurnMemory(max_turns, journal=TurnJournal(path, identity, max_bytes))


def in_dir(directory, identity=ID, max_turns=1024):
    return TurnMemory(max_turns, journal=TurnJournal.in_dir(directory, identity))


def test_a_new_gateway_finds_the_turns_the_last_one_remembered(tmp_path):
    path = journal_path(tmp_path)
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
    path = journal_path(tmp_path)
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
    path = journal_path(tmp_path)
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
    path = journal_path(tmp_path)
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
    path = journal_path(tmp_path)
    path.symlink_to(target)
    m = memory(path)
    m.remember(reply(1), [1], None, False)
    assert m.lookup(reply(1)) is not None  # memory still works, without the file
    assert target.read_bytes() == b"keep me"


def test_the_file_stays_bounded_and_keeps_the_newest(tmp_path):
    path = journal_path(tmp_path)
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
    path = journal_path(tmp_path)
    m = memory(path, max_turns=4)
    for i in range(2000):
        m.remember(reply(i), list(range(100)), None, False)
    assert os.path.getsize(path) < (2 << 20)  # rewritten with the 4 live turns
    assert len(memory(path, max_turns=4)) == 4


def held(mem, count):
    return {i for i in range(count) if mem.lookup(reply(i)) is not None}


def test_a_restart_keeps_the_turns_in_use_in_the_order_of_use(tmp_path):
    """An agent resends its whole history: its early turns are looked up on every request and
    stay in the LRU while newer turns push past `max_turns`. A restarted memory has them, and
    the next turns push out what they would have without the restart."""
    path = journal_path(tmp_path)
    m, reference = memory(path, max_turns=8), TurnMemory(8)
    for mem in (m, reference):
        for i in range(8):
            mem.remember(reply(i), [i, i], None, False)
        assert mem.lookup(reply(0)) is not None  # turn 0 in use again: the LRU's newest
        for i in range(8, 11):
            mem.remember(reply(i), [i, i], None, False)
    again = memory(path, max_turns=8)
    assert len(again) == 8
    for mem in (again, reference):
        for i in range(11, 15):
            mem.remember(reply(i), [i, i], None, False)
    assert held(again, 15) == held(reference, 15) == {0, *range(8, 15)}
    assert list(again.lookup(reply(0)).body) == [0, 0]


MAX_TURNS, ROUNDS, SHORT_TURNS = 64, 40, 3


def long_among_short(directory, also=None):
    """One agent runs all along, resending all its earlier replies with each request, while
    short-lived agents (SHORT_TURNS each) remember far more turns than the memory holds.
    `also` remembers the same turns without lookups. Returns the memory, the names of the turns
    remembered and the lookups made."""
    m = memory(journal_path(directory), max_turns=MAX_TURNS)
    names, lookups = [], 0
    for r in range(ROUNDS):
        for agent, turns in (("long", [r]), (f"short{r}", range(SHORT_TURNS))):
            for t in turns:
                for earlier in range(t):  # the whole history comes back
                    assert m.lookup(reply(f"{agent}-{earlier}")) is not None
                    lookups += 1
                for mem in (m, also) if also is not None else (m,):
                    mem.remember(reply(f"{agent}-{t}"), [t] * 40, None, False)
                names.append(f"{agent}-{t}")
    assert len(names) > 2 * MAX_TURNS
    return m, names, lookups


def test_a_restart_holds_what_the_old_memory_held(tmp_path):
    """The long agent still finds every earlier reply (remembered long before the last
    `max_turns`), and turns the old memory let go do not come back in their place."""
    m, names, _ = long_among_short(tmp_path)
    m.journal.close()  # the old gateway is gone: its lookups below write nothing
    held = {name for name in names if m.lookup(reply(name))}
    assert len(held) == MAX_TURNS and all(f"long-{t}" in held for t in range(ROUNDS))
    again = memory(journal_path(tmp_path), max_turns=MAX_TURNS)
    assert {name for name in names if again.lookup(reply(name))} == held


def test_used_records_are_bounded_by_the_turns_remembered_not_the_lookups(tmp_path):
    plain = memory(journal_path(tmp_path / "plain"), max_turns=MAX_TURNS)
    m, names, lookups = long_among_short(tmp_path, also=plain)
    path = m.journal.path
    used_records = (os.path.getsize(path) - os.path.getsize(plain.journal.path)) / 22
    assert 0 < used_records <= 2 * len(names) + MAX_TURNS  # >= 22 bytes each
    assert used_records < lookups / 3
    resend = [reply(f"long-{t}") for t in range(ROUNDS)]
    assert all(m.lookup(message) for message in resend)
    size = os.path.getsize(path)
    for _ in range(5):  # resent again without new turns: nothing more to write
        assert all(m.lookup(message) for message in resend)
    assert os.path.getsize(path) == size


def test_marks_after_a_rewrite_name_the_turns_where_it_put_them(tmp_path):
    path = journal_path(tmp_path)
    m, reference = memory(path, max_bytes=4096, max_turns=4), TurnMemory(4)
    size = 0
    for i in range(100):  # ~450-byte turns: the file is rewritten with 4 every few turns
        for mem in (m, reference):
            mem.remember(reply(i), list(range(100)), None, False)
        size, before = os.path.getsize(path), size
        if 0 < size < before:  # just rewritten: all 4 live turns placed by the rewrite
            break
    assert 0 < size < before
    for mem in (m, reference):
        assert mem.lookup(reply(i - 3)) is not None  # the oldest, now the newest
    again = memory(path, max_turns=4)
    for mem in (again, reference):
        mem.remember(reply(i + 1), [1], None, False)
    assert held(again, i + 2) == held(reference, i + 2) == {i - 3, i - 1, i, i + 1}


def test_switching_models_keeps_each_models_turns(tmp_path):
    a, b = b"a" * 16, b"b" * 16
    in_dir(tmp_path, a).remember(reply(1), [1, 2], None, False)
    assert len(in_dir(tmp_path, b)) == 0  # another vocabulary: its own, empty journal
    in_dir(tmp_path, b).remember(reply(2), [3, 4], None, False)
    back = in_dir(tmp_path, a)
    assert list(back.lookup(reply(1)).body) == [1, 2] and back.lookup(reply(2)) is None
    assert len(in_dir(tmp_path, b)) == 1


def test_the_journals_of_models_not_used_lately_are_removed(tmp_path):
    identities = [bytes([65 + n]) * 16 for n in range(KEEP_JOURNALS + 1)]
    for n, identity in enumerate(identities[:KEEP_JOURNALS]):
        in_dir(tmp_path, identity).remember(reply(n), [n], None, False)
        os.utime(journal_path(tmp_path, identity), ns=(n * 10**9, n * 10**9))  # n s apart
    (tmp_path / "turns.journal").write_bytes(b"SYTURNS1 the first format")
    (tmp_path / "status.json").write_text("{}")
    in_dir(tmp_path, identities[KEEP_JOURNALS]).remember(reply(9), [9], None, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [journal_path(tmp_path, i).name for i in identities[1:]] + ["status.json"])
    assert len(in_dir(tmp_path, identities[1])) == 1  # the rest keep their turns


def test_a_journal_of_the_previous_format_loads_as_empty(tmp_path):
    """Format 3 keys a turn by the prompt tokens it followed; a format-2 journal's turns have
    no such key: they load as nothing (never as turns any conversation could get), and the
    file starts again in the new format."""
    import hashlib
    import struct

    path = journal_path(tmp_path)
    body = b"\x93\x00\xa3key\xa2[]"  # any msgpack: the header already decides
    old = struct.pack("<8s16s", b"SYTURNS2", ID) + struct.pack(
        "<I16s", len(body), hashlib.blake2b(body, digest_size=16).digest()) + body
    path.write_bytes(old)
    m = memory(path)
    assert len(m) == 0
    m.remember(reply(1), [1, 2], None, False, b"p" * 16)
    again = memory(path)
    assert len(again) == 1 and again.lookup(reply(1), b"p" * 16) is not None
    assert again.lookup(reply(1)) is None  # another conversation (prefix) finds nothing
    assert path.read_bytes()[:8] == b"SYTURNS3"
