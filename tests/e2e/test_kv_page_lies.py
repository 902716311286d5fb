"""Page files that lie, and a full disk, against the whole group.

Each lie is written into a conversation's third page on disk, with the file size and the
keyed checksum made to agree (the install's key: what a bug, or someone holding the key, could
write), or the file cut short, or a checksum an attacker without the key could make. The next
turn must be answered as before: the page is a miss (removed, logged as `kv.corrupt_page` with
the reason), the pages before it restored, the rest re-read; the kvstore never restarts. Before
the fix the 64x payload crashed the kvstore on every restart until the group stopped.

The full disk is a small tmpfs mounted at the kv dir (skipped where mounting is not allowed):
the group keeps answering, pages not written are only not cached, what was on disk stays and
is restored, and `switchyard status` says why writes are refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from switchyard.kvstore.page_key import key_path, load_page_key
from switchyard.kvstore.pages import decode_header, encode_header, make_header
from switchyard.kvstore.store import PageStore, read_entries
from switchyard.proto.page_flags import PageFlags
from switchyard.common.settings import user_cache_dir
from tests.e2e.test_kv_crash_safety import _tokenizer, page_tokens
from tests.e2e.test_kv_persistence import Conversation
from switchyard.testing.group import ServerGroup, short_tmp_dir
from switchyard.testing.workload import wait_written
from tests.helpers.checkout import REPO_ROOT

P = 256


def _rewrite(path: Path, *, payload=None, flags=None, key: bytes | None = None) -> None:
    """The page at `path` with another payload or flags, its file size and keyed checksum
    recomputed (with the install's key unless `key`)."""
    data = path.read_bytes()
    header = decode_header(data)
    body = data[header.header_len:] if payload is None else payload
    key = key if key is not None else load_page_key(key_path(user_cache_dir()))[0]
    new = make_header(header.namespace, header.parent_id, header.token_ids, body,
                      flags=header.flags if flags is None else flags, key=key)
    path.write_bytes(encode_header(new) + bytes(body))


def _payload(path: Path) -> bytes:
    data = path.read_bytes()
    return data[decode_header(data).header_len:]


# name -> (how to write the lie into the page at `path`, what the logged reason says)
LIES = {
    # The reported reproduction: ValueError "page payload is ... bytes, buffer ...".
    # (Judged against the model's geometry first, then against the buffer.)
    "payload 64x the buffer": (lambda p: _rewrite(p, payload=bytes(64 * len(_payload(p)))),
                               "payload is 67108864 bytes"),
    # Fits the buffer, but the worker would load the rest of it from an earlier page.
    "payload half the model's page": (lambda p: _rewrite(p, payload=_payload(p)[:len(
        _payload(p)) // 2]), "the model's page of 256 tokens"),
    "a state flag without the state": (
        lambda p: _rewrite(p, flags=PageFlags.RECURRENT_STATE), "no recurrent state"),
    "forged without the key": (lambda p: _rewrite(p, payload=bytes(len(_payload(p))),
                                                  key=b"not the install's key, 32 bytes!"),
                               "checksum"),
    "file cut short": (lambda p: p.write_bytes(p.read_bytes()[:-4096]), "file is"),
}


@pytest.fixture(scope="module")
def one_slot(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384) as group:
        yield group


@pytest.mark.parametrize("lie", list(LIES))
def test_a_page_that_lies_is_a_miss_and_the_conversation_is_answered(one_slot, tiny_qwen3,
                                                                       lie):
    group = one_slot
    client = openai.OpenAI(base_url=group.base_url, api_key="none")
    seed = 900 + 10 * list(LIES).index(lie)
    a, b = Conversation(client, seed), Conversation(client, seed + 5)
    a.turn()
    a.add_tool_result(0, as_tool_call=True)
    reference = a.turn(max_tokens=16)  # served from memory
    b.turn()  # A now lives on disk only
    wait_written(group, a.prompt_tokens[-1] // P, time.time())
    kvstore = group.pid_of("kvstore")
    num_events = len(group.log_events("kv.corrupt_page"))
    prompt = _tokenizer(tiny_qwen3).apply_chat_template(
        a.messages, tools=[Conversation.TOOL], add_generation_prompt=True, tokenize=True)
    [target] = [path for path, tokens in page_tokens(group.kv_dir).items()
                if list(tokens) == prompt[2 * P:3 * P]]  # A's third page
    write_lie, reason = LIES[lie]
    write_lie(target)
    assert a.turn(max_tokens=16) == reference
    assert 2 * P <= a.cached_tokens[-1] < 3 * P, "the pages before the lie were restored"
    assert group.pid_of("kvstore") == kvstore, "the kvstore never died"
    events = group.wait_events("kv.corrupt_page", at_least=num_events + 1)[num_events:]
    assert [reason in e["reason"] for e in events] == [True], events
    wait_written(group, a.prompt_tokens[-1] // P, time.time())
    # Removed, re-read and written through again: the page on disk is honest now.
    assert read_entries(group.kv_dir)[1] == 0
    store = PageStore(group.kv_dir)
    store.scan()
    header = decode_header(target.read_bytes())
    assert store.read_into(header.namespace, header.page_id, header.token_ids,
                           memoryview(bytearray(8 << 20))) is not None


# --- a full disk -----------------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True)
    return done.returncode == 0


def _fill(path: Path) -> Path:
    """Take every free byte of the file system at `path`."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        except OSError:
            pass
    return filler


def _status(group) -> dict:
    done = subprocess.run([sys.executable, "-m", "switchyard.deploy.cli", "status", "--json",
                           "--runtime-dir", str(group.runtime_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout)


def test_a_full_kv_dir_keeps_the_group_answering_and_loses_nothing(tiny_qwen3):
    kv_dir = short_tmp_dir("sykvfull")
    if not _mount_tmpfs(kv_dir, "16m"):
        kv_dir.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        with ServerGroup(tiny_qwen3, slots=1, ctx=16384, kv_dir=kv_dir) as group:
            client = openai.OpenAI(base_url=group.base_url, api_key="none")
            a, b, c = (Conversation(client, seed) for seed in (951, 961, 971))
            a.turn()
            a.add_tool_result(0, as_tool_call=True)
            reference = a.turn(max_tokens=16)
            wait_written(group, a.prompt_tokens[-1] // P, time.time())
            before = {e.path: e.nbytes for e in read_entries(kv_dir)[0]}
            assert len(before) >= 3, "A's pages were written through"
            filler = _fill(kv_dir)
            # B's pages find no room: B is answered, A is pushed out of the slot to disk.
            b.turn()
            b.add_tool_result(0, as_tool_call=False)
            b.turn()
            off = group.wait_events("kv.persistence_off")
            assert off and "No space left" in off[0]["error"]
            # Nothing on disk was lost: A comes back from its pages.
            assert a.turn(max_tokens=16) == reference
            assert a.cached_tokens[-1] >= 3 * P
            after = {e.path: e.nbytes for e in read_entries(kv_dir)[0]}
            assert after.keys() >= before.keys() and read_entries(kv_dir)[1] == 0
            assert not list(kv_dir.rglob("*.tmp"))
            # `switchyard status` says so.
            deadline = time.monotonic() + 15
            while (disk := _status(group)["snapshot"]["disk"])["writable"] \
                    and time.monotonic() < deadline:
                time.sleep(0.5)  # the status document is rewritten every heartbeat
            assert not disk["writable"] and "No space left" in disk["error"]
            assert disk["num_unwritten"] > 0
            shown = subprocess.run(
                [sys.executable, "-m", "switchyard.deploy.cli", "status", "--runtime-dir",
                 str(group.runtime_dir)], cwd=REPO_ROOT, capture_output=True, text=True,
                timeout=60).stdout
            assert "writes paused" in shown and "No space left on device" in shown
            # Room again: persistence comes back (a backoff of at most a few seconds here).
            filler.unlink()
            c.turn()
            assert group.wait_events("kv.persistence_on", timeout_s=60)
    finally:
        subprocess.run(["umount", "-l", str(kv_dir)], capture_output=True)
        try:
            kv_dir.rmdir()
        except OSError:
            pass
