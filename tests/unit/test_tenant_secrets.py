"""What one tenant can learn of another's text (docs/design.md "Tenants"): salts no tenant can
compute, page ids that never reach a tenant, the status and metrics each key sees, the
speculative proposer's tables per tenant, the cache dir's keys. Pure: no sockets, no MLX."""

import hashlib
import os
import stat

import pytest

from switchyard.proto.page_ids import chain_page_ids, chain_root
from switchyard.proto.secret_keys import SecretKeyError, ensure_cache_dir
from switchyard.proto.tenants import (SALT_BYTES, Tenants, load_salt_key, parse_keys,
                                      resolved_keys, tenants_of)

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
