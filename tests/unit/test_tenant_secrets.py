"""What one tenant can learn of another's text (docs/design/security.md "Tenants"): salts no tenant can
compute, page ids that never reach a tenant, the status and metrics each key sees, the
speculative proposer's tables per tenant, the cache dir's keys. Pure: no sockets, no MLX."""

import hashlib
import os
import stat

import pytest

from switchyard.common.page_ids import chain_page_ids, chain_root
from switchyard.common.secret_keys import SecretKeyError, ensure_cache_dir
from switchyard.common.tenants import (
    SALT_BYTES,
    Tenants,
    load_salt_key,
    parse_keys,
    resolved_keys,
    tenants_of,
)

KEYS = "alice sk-a\nbob sk-b\nops,role=operator sk-o\n"


def _unkeyed_salt(parts: list[bytes]) -> bytes:
    """The salt every earlier release computed: anyone who knows a tenant's name could too."""
    h = hashlib.blake2b(digest_size=SALT_BYTES, person=b"sy-cache-salt")
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


# --- salts keyed with the install's salt key ------------------------------------------------


def test_a_tenants_salt_cannot_be_computed_from_its_name(tmp_path):
    key, warning = load_salt_key(tmp_path / "cache")
    assert len(key) == 32 and not warning
    tenants = Tenants(parse_keys(KEYS), secret=key)
    alice = tenants.tenants[0]
    salt = tenants.salt(alice)
    # The audit's offline search: Bob computed Alice's salt from "tenant:alice".
    assert salt != _unkeyed_salt([b"tenant:alice"])
    assert salt != Tenants(parse_keys(KEYS)).salt(alice)
    assert salt != Tenants(parse_keys(KEYS), secret=os.urandom(32)).salt(alice)
    door = [100 + (i * 31) % 900 for i in range(64)]
    guesses = {chain_page_ids(b"n" * 16, door, 16, chain_root(_unkeyed_salt([b"tenant:alice"])))[0]}
    assert chain_page_ids(b"n" * 16, door, 16, chain_root(salt))[0] not in guesses
    # kept across restarts: the same key, the same salt, the same page ids
    again = Tenants(parse_keys(KEYS), secret=load_salt_key(tmp_path / "cache")[0])
    assert again.salt(again.tenants[0]) == salt
    assert again.salt(again.tenants[0], "x") == tenants.salt(alice, "x")


def test_one_tenant_without_cache_salt_stays_unsalted_whatever_the_key(tmp_path):
    key, _ = load_salt_key(tmp_path / "cache")
    one = Tenants(tenants_of("sk-only"), secret=key)
    assert one.salt(one.tenants[0]) == b"" == Tenants(secret=key).salt(None)


def test_the_salt_key_is_private_ours_and_made_once(tmp_path):
    cache = tmp_path / "cache"
    key, _ = load_salt_key(cache)
    path = cache / "salt.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_salt_key(cache) == (key, "")
    path.chmod(0o640)
    with pytest.raises(SecretKeyError, match="salt key .* group or other users"):
        load_salt_key(cache)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SecretKeyError, match="symbolic link"):
        load_salt_key(cache)


# --- the cache dir --------------------------------------------------------------------------


def test_the_cache_dir_is_made_0700_and_a_loose_one_is_tightened(tmp_path):
    made = ensure_cache_dir(tmp_path / "a" / "cache")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    load_salt_key(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_a_cache_dir_that_is_a_symlink_or_not_a_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(SecretKeyError, match="cache dir .* symbolic link"):
        ensure_cache_dir(link)
    with pytest.raises(SecretKeyError, match="cache dir .* symbolic link"):
        load_salt_key(link)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SecretKeyError, match="not a directory"):
        ensure_cache_dir(tmp_path / "file")


def test_a_cache_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.raises(SecretKeyError, match="cache dir .* belongs to uid"):
        ensure_cache_dir(cache)


# --- the operator role in the key file ------------------------------------------------------


def test_an_operator_key_is_a_role_in_the_key_file():
    tenants = tenants_of(resolved_keys(KEYS))
    assert [(t.name, t.operator) for t in tenants] == [
        ("alice", False), ("bob", False), ("ops", True)]
    several = Tenants(tenants)
    assert several.sees_all(tenants[2]) and not several.sees_all(tenants[0])
    assert not several.sees_all(None)
    assert Tenants(tenants_of("sk-only")).sees_all(None)  # one tenant: it is the operator
    with pytest.raises(Exception, match="line 1.*not an option"):
        parse_keys("alice,role=root sk-a\nbob sk-b\n")


# --- what the status shows each key ---------------------------------------------------------


def _record(tenant: str, **kw):
    from types import SimpleNamespace
    fields = dict(finish_reason="stop", num_prompt_tokens=723, num_reused_tokens=0,
                  num_copied_tokens=0, num_restored_tokens=0, num_prefilled_tokens=723,
                  num_generated_tokens=5, num_cached_tokens=0, ttft_s=0.2, priority="interactive",
                  num_proposed_tokens=0, num_accepted_tokens=0, tenant=tenant)
    return SimpleNamespace(**(fields | kw))


def two_tenants_status(now: float = 1000.0):
    """Alice's request decoding with drafts accepted, an idle slot of hers, one of Bob's."""
    from switchyard.proto.status import (STATUS_VERSION, DiskStatus, QueuedRequest, SlotStatus,
                                         Status)
    from switchyard.scheduler.stats import SchedulerStats

    stats = SchedulerStats()
    stats.request_finished(_record("alice", num_proposed_tokens=8, num_accepted_tokens=8,
                                   num_cached_tokens=704, num_reused_tokens=704), now)
    stats.request_finished(_record("bob", ttft_s=3.0), now)
    stats.request_failed("context_length_exceeded")
    stats.step_done(0.02)
    slot = dict(last_used=now, priority="interactive", waiting_s=None)
    return Status(
        version=STATUS_VERSION, at=now, boot_id="b" * 16, pid=1, started_at=now - 60,
        worker_ready=True, kvstore_ready=True, peers={},
        slots=[SlotStatus(slot=0, num_tokens=723, conversation="aaaaaaaaaaaa", rid="ra",
                          state="decoding", tenant="alice", **slot),
               SlotStatus(slot=1, num_tokens=500, conversation="cccccccccccc", rid=None,
                          state="idle", tenant="alice", **slot),
               SlotStatus(slot=2, num_tokens=64, conversation="bbbbbbbbbbbb", rid="rb",
                          state="prefilling", tenant="bob", **(slot | {"waiting_s": 2.0})),
               SlotStatus(slot=3, num_tokens=9, conversation="dddddddddddd", rid=None,
                          state="idle", **slot)],  # adopted after a restart: nobody's
        queue=[QueuedRequest(rid="ra2", priority="interactive", waiting_s=9.0, prompt_tokens=723,
                             tenant="alice")],
        oldest_waiting_s=9.0,
        disk=DiskStatus(bytes=1000, budget_bytes=5000, num_pages=3, writable=False, num_evicted=0,
                        num_thrash=0, num_writing=0,
                        error="[Errno 28] No space left on device: '/Users/alice/kv/ab/x.tmp'"),
        ranks=[], stats=stats.snapshot())


def test_a_tenant_is_shown_its_own_requests_and_no_one_elses():
    from switchyard.gateway.tenant_view import status_for

    tenants = Tenants(parse_keys(KEYS))
    alice, bob, ops = tenants.tenants
    status = two_tenants_status()
    seen = status_for(status, bob, tenants)
    assert [s.rid for s in seen.slots] == ["rb"] and seen.queue == []
    assert seen.oldest_waiting_s == 2.0
    assert [r.tenant for r in seen.stats.recent_requests] == ["bob"]
    # No counter Bob sees moves with Alice's text: her drafts and cached tokens are hers.
    assert seen.stats.tokens.draft_proposed == 0 and seen.stats.tokens.reused == 0
    assert seen.stats.tokens.prompt == 723 and seen.stats.requests_finished == {"stop": 1}
    assert seen.stats.ttft.count == 1 and seen.stats.requests_failed == {}
    assert set(seen.stats.by_tenant) == {"bob"}
    assert "alice" not in repr(seen) and "aaaaaaaaaaaa" not in repr(seen)
    # No path: the disk's reason alone.
    assert seen.disk.error == "No space left on device" and "/Users" not in repr(seen)
    assert seen.stats.step_time == status.stats.step_time  # the machine's, not a tenant's
    mine = status_for(status, alice, tenants)
    assert [s.slot for s in mine.slots] == [0, 1] and [q.rid for q in mine.queue] == ["ra2"]
    assert mine.stats.tokens.draft_accepted == 8
    # The operator, and a single key, see everything.
    assert status_for(status, ops, tenants) == status
    one = Tenants(tenants_of("sk-only"))
    assert status_for(status, one.tenants[0], one) == status


def test_the_status_and_metrics_routes_cut_the_document_for_the_key(tmp_path):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.testclient import TestClient

    from switchyard.gateway import dashboard, metrics
    from switchyard.gateway.app import RequestLogMiddleware
    from switchyard.common.settings import Settings
    from switchyard.proto.status import write_status

    keys = resolved_keys(KEYS)
    tenants = Tenants.from_settings(keys)
    app = Starlette(middleware=[Middleware(RequestLogMiddleware, tenants=tenants)])
    settings = Settings(runtime_dir=str(tmp_path), api_key=keys)
    metrics.mount(app, settings, tenants)
    dashboard.mount(app, settings, tenants)
    write_status(tmp_path / "status.json", two_tenants_status())
    client = TestClient(app)

    def status(key):
        return client.get("/v1/switchyard/status", headers={"Authorization": f"Bearer {key}"})

    def scrape(key):
        return client.get("/metrics", headers={"Authorization": f"Bearer {key}"}).text

    bob = status("sk-b").json()
    assert [s["rid"] for s in bob["slots"]] == ["rb"] and bob["queue"] == []
    assert bob["stats"]["tokens"]["draft_proposed"] == 0 and "/Users" not in str(bob)
    assert [s["rid"] for s in status("sk-o").json()["slots"]] == ["ra", None, "rb", None]
    proposed = 'switchyard_speculative_tokens_total{kind="proposed"}'
    assert f"{proposed} 0.0" in scrape("sk-b") and f"{proposed} 8.0" in scrape("sk-a")
    assert f"{proposed} 8.0" in scrape("sk-o")
    assert 'slot="0"' not in scrape("sk-b") and 'slot="0"' in scrape("sk-o")
    assert status("sk-nope").status_code == 401


def test_the_core_shows_no_page_id_and_says_whose_each_slot_is():
    from switchyard.proto.values import SamplingParams
    from switchyard.proto.gateway_scheduler import SubmitRequest
    from switchyard.scheduler.status_rows import conversation_label

    from tests.unit.test_scheduler_pages import EOS, NS, P, Group, conv

    g = Group(num_slots=2)
    salt = os.urandom(16)
    prompt = conv(1, 3 * P + 5)
    g.do(SubmitRequest("alice-1", tuple(prompt), 4, SamplingParams(), (EOS,), "interactive",
                       cache_salt=salt, tenant="alice"))
    g.run()
    g.do(SubmitRequest("bob-1", tuple(conv(2, P + 3)), 4, SamplingParams(), (EOS,),
                       "interactive", cache_salt=os.urandom(16), tenant="bob"))
    g.run()
    slots = g.core.snapshot(g.now).slots
    assert sorted(s.tenant for s in slots) == ["alice", "bob"]  # idle slots: still theirs
    page_id = chain_page_ids(NS, prompt, P, chain_root(salt))[0].hex()
    labels = {s.conversation for s in slots if s.tenant == "alice"}
    # The audit read the first 12 hex digits of the page id here; no prefix of it is shown.
    assert labels == {conversation_label(bytes.fromhex(page_id))}
    assert not any(page_id.startswith(label[:4]) for label in labels)
    assert conversation_label(b"x" * 16) != conversation_label(b"x" * 16, key=b"k" * 32)
    assert g.records["alice-1"].tenant == "alice"


# --- speculation per tenant: the n-gram probe -----------------------------------------------


def _probe_run(alice_tenant: str, bob_tenant: str, alice_present: bool, bob_floods: bool):
    """The audit's n-gram probe on a small table: Alice's prompt holds a door code; Bob plants
    his own text (enough to fill the table), and reads what his requests and hers are
    proposed. Returns (Bob's proposals, Alice's proposal for the text after "code is 4")."""
    import random

    from switchyard.scheduler.proposer import Proposer, ProposerConfig

    p = Proposer(ProposerConfig(max_draft=8, always=True, table_bits=10, tenant_table_bits=10,
                                keep_tokens=1 << 16, tenant_keep_tokens=1 << 16))
    rng = random.Random(7)
    salt_a, salt_b = b"a" * 16, b"b" * 16
    code_is = [901, 902, 903]
    secret = [rng.randrange(1000, 5000) for _ in range(300)]
    alice_text = secret[:150] + code_is + [4, 8, 2, 1] + secret[150:]
    bob_text = [rng.randrange(5000, 9000) for _ in range(3000)]
    if bob_floods:
        p.start("bob-plant", list(bob_text), salt_b, bob_tenant)
        p.finish("bob-plant")
    if alice_present:
        p.start("alice", list(alice_text), salt_a, alice_tenant)
        p.finish("alice")
    bob = []
    for k in range(40, 3000, 97):  # Bob resends the start of his text: what is he proposed?
        if not bob_floods:
            break
        p.start(f"bob-{k}", list(bob_text[:k]), salt_b, bob_tenant)
        found = p.propose(f"bob-{k}", 8)
        bob.append(found.tokens if found else None)
        p.observe(f"bob-{k}", len(found.tokens) if found else 0, 0)
        p.finish(f"bob-{k}")
    p.start("alice-2", secret[140:150] + code_is + [4], salt_a, alice_tenant)
    found = p.propose("alice-2", 8)
    return bob, found.tokens if found else None


def test_another_tenants_text_neither_displaces_nor_shows_in_ones_drafts():
    # Each tenant its own table: Bob's flood leaves Alice's drafts as they were, and Bob is
    # proposed exactly the same with or without Alice's text in the server.
    quiet = _probe_run("alice", "bob", alice_present=True, bob_floods=False)[1]
    assert quiet[:3] == (8, 2, 1)
    assert _probe_run("alice", "bob", alice_present=True, bob_floods=True)[1] == quiet
    assert (_probe_run("alice", "bob", alice_present=True, bob_floods=True)[0]
            == _probe_run("alice", "bob", alice_present=False, bob_floods=True)[0])


def test_the_probe_does_work_on_one_shared_table():
    """The control: with both tenants' n-grams in one table (as before), Bob's text displaces
    Alice's entries and hers shows in what Bob is proposed, which is what the audit read."""
    quiet = _probe_run("", "", alice_present=True, bob_floods=False)[1]
    assert _probe_run("", "", alice_present=True, bob_floods=True)[1] != quiet
    assert (_probe_run("", "", alice_present=True, bob_floods=True)[0]
            != _probe_run("", "", alice_present=False, bob_floods=True)[0])


def test_each_tenants_table_has_its_own_hash_key_and_size():
    from switchyard.scheduler.proposer import Proposer, ProposerConfig

    p = Proposer(ProposerConfig(table_bits=12, tenant_table_bits=10))
    assert p.table().hash_key == 0 and p.table().size == 1 << 12  # one key: as it always was
    alice, bob = p.table("alice"), p.table("bob")
    assert alice is not bob and alice.size == bob.size == 1 << 10
    assert len({alice.hash_key, bob.hash_key, 0}) == 3


def test_a_draft_models_acceptance_is_learned_per_tenant():
    from switchyard.scheduler.proposer import Proposer, ProposerConfig

    p = Proposer(ProposerConfig(table_bits=10, tenant_table_bits=10))
    p.start("bob-0", [1, 2, 3], b"b" * 16, "bob")
    before = p.draft_acceptance("bob-0")
    p.start("alice", [1, 2, 3], b"a" * 16, "alice")
    for _ in range(20):  # Alice's text is one the draft model predicts well
        p.observe_draft("alice", 8, 8)
    p.start("bob-1", [1, 2, 3], b"b" * 16, "bob")
    assert p.draft_acceptance("bob-1") == before < p.draft_acceptance("alice")


def test_switchyard_status_the_operators_view_says_whose_each_slot_is():
    from switchyard.deploy.status import format_slots

    lines = format_slots(two_tenants_status(), 1000.0)
    assert "tenant" in lines[1] and "alice" in lines[2] and "bob" in lines[4]
