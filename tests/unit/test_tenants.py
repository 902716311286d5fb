"""Tenants (common/tenants.py, docs/design/security.md "Tenants"): the key file, who a key names, the
cache salt of a request; and the salt at work where text could cross tenants: the
scheduler's page chains and slots, the proposer's n-grams, the gateway's remembered turns.
Pure: no sockets, no MLX."""

import pytest

from switchyard.gateway.prompting.history import TurnMemory
from switchyard.gateway.prompting.turn_keys import message_key, prefix_digest
from switchyard.proto.values import SamplingParams
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, chain_root
from switchyard.common.settings import Settings, SettingsError, read_api_key_file
from switchyard.common.tenants import (
    KeyFileError,
    Tenant,
    Tenants,
    parse_keys,
    resolved_keys,
    tenants_of,
    unnamed,
)
from switchyard.scheduler.proposer import Proposer, ProposerConfig

from tests.unit.test_scheduler_pages import EOS, NS, P, Group, conv

FILE = [100 + (i * 7919) % 5000 for i in range(600)]


# --- the key file --------------------------------------------------------------------------


def test_a_file_of_one_line_is_one_key_read_whole_as_before():
    for line in ("sk-abc", 'k e$y%"\\x', "#starts-with-a-hash", "alice sk-1"):
        assert resolved_keys(f"  {line}  \n\n") == line
        assert tenants_of(line) == [Tenant(unnamed(line), line)]


def test_several_keys_named_or_not_with_comments():
    text = "# our team\nalice  sk-alice\n\nbob\tsk bob with spaces\nsk-nameless\n"
    tenants = tenants_of(resolved_keys(text))
    assert [(t.name, t.key) for t in tenants] == [
        ("alice", "sk-alice"), ("bob", "sk bob with spaces"),
        (unnamed("sk-nameless"), "sk-nameless")]
    assert unnamed("sk-nameless").startswith("key-") and unnamed("a") != unnamed("b")
    assert "sk-alice" not in repr(tenants)  # keys are never in a repr (logs)


@pytest.mark.parametrize("text,problem", [
    ("alice k1\nalice k2\n", "given twice"), ("a k1\nb k1\n", "given twice"),
    ("al/ice k1\nbob k2\n", "1-64 letters"),
])
def test_a_bad_key_file_is_refused_naming_the_line(text, problem):
    with pytest.raises(KeyFileError, match=f"line 2.*{problem}|line 1.*{problem}"):
        parse_keys(text)


def test_a_name_may_carry_a_weight_that_survives_resolution():
    text = "alice sk-a\nbob,weight=3 sk b\ncarol,weight=0.5 sk-c\nsk-nameless\n"
    tenants = tenants_of(resolved_keys(text))
    assert [(t.name, t.key, t.weight) for t in tenants] == [
        ("alice", "sk-a", 1.0), ("bob", "sk b", 3.0), ("carol", "sk-c", 0.5),
        (unnamed("sk-nameless"), "sk-nameless", 1.0)]
    several = Tenants(tenants)
    assert several.share_of(tenants[1]) == ("bob", 3.0)
    assert Tenants(tenants[:1]).share_of(tenants[0]) == ("", 1.0)  # one tenant: no shares
    assert resolved_keys("bob,weight=3 sk-b\n") == "bob,weight=3 sk-b"  # one line: a key


@pytest.mark.parametrize("field", ["bob,weight=0", "bob,weight=-1", "bob,weight=nan",
                                   "bob,weight=inf", "bob,weight=1001", "bob,weight=",
                                   "bob,weight=" + "9" * 5000, "bob,role=x", "bob,"])
def test_a_bad_weight_is_refused_naming_the_line(field):
    with pytest.raises(KeyFileError, match="line 2"):
        parse_keys(f"alice k1\n{field} k2\n")


def test_the_key_file_through_settings(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sk-a\nbob sk-b\n")
    path.chmod(0o600)
    keys = read_api_key_file(str(path))
    assert [t.name for t in tenants_of(keys)] == ["alice", "bob"]
    Settings(api_key=keys, shared_prefix_tenants=("alice", "bob")).validate()
    with pytest.raises(SettingsError, match="shared-prefix-tenants names no key: carol"):
        Settings(api_key=keys, shared_prefix_tenants=("carol",)).validate()
    assert "shared_prefix_tenants" not in " ".join(
        Settings(api_key=keys, shared_prefix_tenants=("alice",)).to_args("scheduler"))


def test_a_key_names_its_tenant_and_only_a_whole_key_does():
    tenants = Tenants(parse_keys("alice sk-a\nbob sk-b\n"))
    assert tenants.match("sk-a").name == "alice" and tenants.match("sk-b").name == "bob"
    assert tenants.match("sk-") is None and tenants.match("") is None
    assert not Tenants() and Tenants().match("x") is None


# --- salts ---------------------------------------------------------------------------------


def test_one_tenant_is_unsalted_and_several_are_each_their_own():
    one = Tenants(tenants_of("sk-only"))
    assert one.salt(one.tenants[0]) == b"" == Tenants().salt(None)
    assert chain_root(b"") == ROOT_ID  # its page ids are the ones every release computed
    several = Tenants(parse_keys("alice sk-a\nbob sk-b\ncarol sk-c\n"), shared=("bob", "carol"))
    alice, bob, carol = several.tenants
    assert len({several.salt(alice), several.salt(bob), b""}) == 3
    assert several.salt(bob) == several.salt(carol)  # --shared-prefix-tenants
    # cache_salt isolates further within a tenant; no cache_salt makes another's salt
    assert several.salt(alice, "x") not in (several.salt(alice), several.salt(alice, "y"))
    assert one.salt(one.tenants[0], "x") != b""
    guesses = {several.salt(bob, guess) for guess in ("", "alice", "tenant:alice", "sk-a")}
    assert several.salt(alice) not in guesses


# --- the scheduler: page chains and slots ---------------------------------------------------


def submit(g: Group, rid: str, prompt, salt: bytes = b"", max_tokens: int = 4):
    g.do(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,), "interactive",
                       cache_salt=salt))


def test_the_same_text_under_two_salts_shares_no_page_and_no_slot():
    a, b = b"a" * 16, b"b" * 16
    prompt = conv(1, 5 * P + 3)
    assert set(chain_page_ids(NS, prompt, P, chain_root(a))).isdisjoint(
        chain_page_ids(NS, prompt, P, chain_root(b)))
    for slots in (1, 2):  # kept in the slot, or copied from the other
        g = Group(num_slots=slots)
        submit(g, "victim", prompt, a)
        g.run()
        since = len(g.steps)
        submit(g, "attacker", prompt, b)
        g.run()
        assert g.finished("attacker").num_cached_tokens == 0, slots
        assert g.prefilled_in(since) == len(prompt) - 1 and not any(s.copies or s.loads
                                                               for s in g.steps[since:])
        submit(g, "victim2", prompt, a)  # the victim's own text is still its own
        g.run()
        assert g.finished("victim2").num_cached_tokens >= 5 * P


def test_pages_on_disk_are_restored_only_under_their_salt():
    a, b = b"a" * 16, b"b" * 16
    g = Group(num_slots=1)
    prompt = conv(1, 4 * P + 2)
    submit(g, "victim", prompt, a)
    g.run()
    submit(g, "other", conv(2, 3 * P), a)  # takes the one slot: the victim's text is on disk
    g.run()
    roots = {info.parent_id for info in g.disk.values()} - set(g.disk)
    assert roots == {chain_root(a)}  # the first pages hang from the salt's root, not ROOT_ID
    submit(g, "attacker", prompt + [7], b)
    g.run()
    assert g.finished("attacker").num_cached_tokens == 0
    submit(g, "victim2", prompt + [7], a)
    g.run()
    assert g.finished("victim2").num_cached_tokens >= 4 * P


# --- the proposer -----------------------------------------------------------------------------


def test_drafts_are_copied_only_from_text_of_the_same_salt():
    p = Proposer(ProposerConfig(max_draft=8, always=True))
    secret = FILE[:200]
    p.start("victim", [1, 2] + secret, b"a" * 16)
    p.finish("victim")
    probe = [3] + secret[:20]  # the attacker knows the start and guesses on
    p.start("attacker", list(probe), b"b" * 16)
    assert p.propose("attacker", 8) is None
    p.start("unsalted", list(probe))
    assert p.propose("unsalted", 8) is None
    p.start("victim2", list(probe), b"a" * 16)
    assert p.propose("victim2", 8).tokens == tuple(secret[20:28])


def test_the_proposers_table_stays_one_bounded_table_whatever_the_salts():
    p = Proposer(ProposerConfig(table_bits=10, keep_tokens=1000))
    for i in range(50):
        p.start(f"r{i}", list(FILE[:300]), bytes([i]) * 16)
        p.finish(f"r{i}")
    table = p.table()
    assert table.size == 1 << 10 and table.finished_tokens <= 1000 + 400


# --- the gateway's remembered turns -----------------------------------------------------------


def test_a_turn_is_remembered_and_found_under_its_salt_only():
    memory = TurnMemory(16)
    message = {"role": "assistant", "content": "the code is 2853"}
    prompt = [5, 6, 7]
    a, b = b"a" * 16, b"b" * 16
    memory.remember(message, [9, 9, 9], "<|im_start|>assistant\n", False,
                    prefix_digest(prompt, a), a)
    assert memory.candidates(message, b) is None  # not even "a reply of this text exists"
    assert memory.candidates(message) is None
    assert memory.lookup(message, prefix_digest(prompt, b), salt=b) is None
    assert memory.lookup(message, prefix_digest(prompt, a), salt=a).body.tolist() == [9, 9, 9]
    assert message_key(message, a) != message_key(message) != message_key(message, b)
