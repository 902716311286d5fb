"""Tenants: who a request belongs to, and the salt that keeps its cached text its own
(docs/design/security.md "Security", "Tenants").

A tenant is an API key. The key file (`--api-key-file`, mode 0600) holds one key per line,
each with an optional name before it; `#` starts a comment line:

    # NAME KEY, or KEY alone; NAME,role=operator KEY for a key that sees every tenant;
    # NAME,weight=N KEY for a larger share
    alice  sk-alice-7f3a...
    bob,weight=2  sk-bob-91c2...
    ops,role=operator  sk-ops-0d1e...
    sk-unnamed-key...

A line is split at its first whitespace: the name, then the key (which may hold spaces); a
line without whitespace is a key alone, named `key-` and 8 hex digits of its hash (stable
however the lines are ordered). A file of one line is one key, the whole line (spaces
included), exactly as every release read its single-key file. `--api-key` and
`$SWITCHYARD_API_KEY` give one key. With no key, or with one, there is one tenant.

A name may carry a **weight** (`NAME,weight=N`, a positive number, 1 when not given): active
tenants divide the queue, the running requests and the prefill in proportion to their weights
(scheduler/tenant_shares.py). A name with a comma was refused before, so no file that parsed
changes meaning.

What a tenant's requests leave behind that another request could sense (KV pages and the
prefix they make faster, the speculative proposer's n-grams, the gateway's remembered turns)
is keyed by a **salt**: with several tenants, each tenant's own, and within a tenant the
request's `cache_salt` (vLLM's field) isolates further. A salt is keyed with the install's
salt key (`<cache dir>/salt.key`, common/secret_keys.py), so no tenant can compute another's,
nor the page ids its text makes. The tenants named by
`--shared-prefix-tenants` share one salt (their pages, drafts and turns), for an operator who
wants a common system prompt prefilled once for all of them: they can sense each other's text.
A single tenant (no key, or one) shares its text with itself by design: its salt is empty
unless a request gives a `cache_salt`, and its page ids are the ones every release computed.

With several keys, what the status, the dashboard and /metrics show a key is its own requests
and aggregates (gateway/tenant_view.py); a key whose name carries `role=operator` sees all.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.common.secret_keys import load_secret_key

SALT_BYTES = 16
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The resolved keys of a file with names or several keys, as settings.api_key carries them to
# the gateway (a single key alone is carried as itself): a first line no key can be.
_CANONICAL = "#switchyard-tenants-v1"
MAX_CACHE_SALT_CHARS = 1024
SALT_KEY_NAME = "salt.key"
ROLE_TENANT = "tenant"
ROLE_OPERATOR = "operator"  # sees every tenant's requests in the status and metrics
_ROLES = (ROLE_TENANT, ROLE_OPERATOR)
# A weight is at most this many times another's: past it a share rounds to nothing.
MAX_WEIGHT = 1000.0


class KeyFileError(ValueError):
    pass


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str = field(repr=False)
    role: str = ROLE_TENANT
    weight: float = 1.0  # its share beside other active tenants (scheduler/tenant_shares.py)

    @property
    def operator(self) -> bool:
        return self.role == ROLE_OPERATOR


def load_salt_key(cache_dir: Path) -> tuple[bytes, str]:
    """The install's salt key (`<cache dir>/salt.key`) and "" or why it is a key for this run
    only; SecretKeyError when the file is not ours, not private or not a key."""
    return load_secret_key(Path(cache_dir) / SALT_KEY_NAME, "salt key",
                           "salted pages and remembered turns of several keys become misses",
                           "salted pages and remembered turns are misses after a restart")


def _name_and_options(field_text: str, where: str, number: int) -> tuple[str, str, float]:
    """`NAME`, `NAME,role=ROLE`, `NAME,weight=N` or both (the first field of a key file's
    line): the name, its role and its weight."""
    name, *options = field_text.split(",")
    role, weight = ROLE_TENANT, 1.0
    for option in options:
        key, _, value = option.partition("=")
        if key == "weight":
            weight = _weight(value, f"{where}, line {number}")
        elif key != "role" or value not in _ROLES:
            raise KeyFileError(f"{where}, line {number}: {option!r} is not an option of a key "
                               f"(write NAME,role=operator KEY, NAME,weight=N KEY, or NAME KEY)")
        else:
            role = value
    return name, role, weight


def _weight(value: str, where: str) -> float:
    try:
        weight = float(value) if len(value) <= 16 else float("nan")
    except ValueError:
        weight = float("nan")
    if not 1.0 / MAX_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        raise KeyFileError(f"{where}: the weight {value[:16]!r} must be a number from "
                           f"{1.0 / MAX_WEIGHT:g} to {MAX_WEIGHT:g}")
    return weight


def unnamed(key: str) -> str:
    return "key-" + hashlib.blake2b(key.encode(), digest_size=4,
                                    person=b"sy-tenant-name").hexdigest()


def parse_keys(text: str, where: str = "the key file") -> list[Tenant]:
    """The tenants of a key file's text (or of a resolved `api_key`). Refuses duplicate names
    or keys and bad names, naming the line."""
    lines = [(n, raw.strip()) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if len(lines) == 1 and not text.startswith(_CANONICAL):
        return [Tenant(unnamed(lines[0][1]), lines[0][1])]  # a single-key file, as before
    tenants: list[Tenant] = []
    names: set[str] = set()
    keys: set[str] = set()
    for number, line in lines:
        if line.startswith("#"):
            continue
        fields = line.split(None, 1)
        role, weight = ROLE_TENANT, 1.0
        if len(fields) == 1:
            name, key = unnamed(fields[0]), fields[0]
        else:
            (name, role, weight), key = (_name_and_options(fields[0], where, number),
                                         fields[1].strip())
            if not _NAME.fullmatch(name):
                raise KeyFileError(f"{where}, line {number}: the name {name!r} must be 1-64 "
                                   "letters, digits, '_', '.' or '-' (write 'NAME KEY' or a "
                                   "key without spaces)")
        if name in names:
            raise KeyFileError(f"{where}, line {number}: the name {name!r} is given twice")
        if key in keys:
            raise KeyFileError(f"{where}, line {number}: the key is given twice")
        names.add(name)
        keys.add(key)
        tenants.append(Tenant(name, key, role, weight))
    return tenants


def resolved_keys(text: str, where: str = "the key file") -> str:
    """What `settings.api_key` holds for a key file: a single unnamed key as itself (as every
    release read it), anything else as canonical lines."""
    tenants = parse_keys(text, where)
    if not tenants:
        return ""
    only = tenants[0]
    if len(tenants) == 1 and only.name == unnamed(only.key) and not only.operator:
        return only.key
    lines = (f"{t.name}{_options(t)} {t.key}" for t in tenants)
    return "\n".join([_CANONICAL, *lines]) + "\n"


def _options(tenant: Tenant) -> str:
    """A tenant's role and weight as a key file line writes them after its name."""
    role = f",role={tenant.role}" if tenant.role != ROLE_TENANT else ""
    return role + (f",weight={tenant.weight:.17g}" if tenant.weight != 1.0 else "")


def tenants_of(api_key: str) -> list[Tenant]:
    """The tenants of a resolved `settings.api_key` (a single key from a flag, the environment
    or a file, or a file's canonical lines)."""
    if not api_key:
        return []
    if api_key.startswith(_CANONICAL + "\n"):
        return parse_keys(api_key, "the API keys")
    return [Tenant(unnamed(api_key), api_key)]


class Tenants:
    """The gateway's keys: who a request's key names, and the salt of its cache."""

    def __init__(self, tenants: Iterable[Tenant] = (), shared: Iterable[str] = (),
                 secret: bytes = b""):
        """`secret`: the salt key (`load_salt_key`), which keys every salt so that none can
        be computed from a tenant's name; empty only in tests of the salts' structure."""
        self.secret = secret
        self.tenants = list(tenants)
        self.shared = frozenset(shared)
        unknown = self.shared - {t.name for t in self.tenants}
        if unknown:
            raise KeyFileError("--shared-prefix-tenants names no key: "
                               + ", ".join(sorted(unknown)) + " (names are the key file's; "
                               + (", ".join(t.name for t in self.tenants) or "no keys") + ")")
        self._keys = [(t.key.encode(), t) for t in self.tenants]

    @classmethod
    def from_settings(cls, api_key: str, shared: Iterable[str] = (),
                      secret: bytes = b"") -> Tenants:
        return cls(tenants_of(api_key), shared, secret)

    def __bool__(self) -> bool:
        return bool(self.tenants)

    @property
    def several(self) -> bool:
        return len(self.tenants) > 1

    def sees_all(self, tenant: Tenant | None) -> bool:
        """Whether `tenant`'s key is shown every tenant's requests (the status, /metrics): with
        one tenant or none, and for an operator key."""
        return not self.several or (tenant is not None and tenant.operator)

    def match(self, given: str) -> Tenant | None:
        """The tenant whose key was given; every key is compared (in constant time each), so
        the time taken does not say which matched."""
        given_bytes = given.encode()
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given_bytes, key):
                found = tenant
        return found

    def share_of(self, tenant: Tenant | None) -> tuple[str, float]:
        """Whose share a request of `tenant` counts against, and its weight: ("", 1) when
        there is one tenant (the scheduler then divides nothing)."""
        if tenant is None or not self.several:
            return "", 1.0
        return tenant.name, tenant.weight

    def salt(self, tenant: Tenant | None, cache_salt: str | None = None) -> bytes:
        """The salt of a request of `tenant` with `cache_salt` (b"": unsalted, one tenant and
        no cache_salt)."""
        parts = []
        if tenant is not None and self.several:
            parts.append(b"shared" if tenant.name in self.shared
                         else b"tenant:" + tenant.name.encode())
        if cache_salt:
            parts.append(b"cache_salt:" + cache_salt.encode("utf-8", "surrogatepass"))
        return salt_of(parts, self.secret)


def salt_of(parts: list[bytes], secret: bytes = b"") -> bytes:
    """The salt of `parts`, keyed with the salt key; b"" for no parts (unsalted: the page ids
    every release computed)."""
    if not parts:
        return b""
    h = hashlib.blake2b(digest_size=SALT_BYTES, person=b"sy-cache-salt", key=secret)
    for part in parts:  # length-prefixed: no cache_salt makes another tenant's salt
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()
