"""The install's page key: the secret that keys page checksums (docs/design/security.md "Security").

`<cache dir>/page.key`, 32 random bytes, created once 0600 and read back on every start
(common/secret_keys.py). It lives outside the page directory, so write access to the pages (a
kv-dir on an external volume that ignores ownership, a copied cache) is not enough to forge one
that verifies. A lost key costs only re-reads: every page becomes a miss.

A cache dir where no key can be created (read-only, full) gets a key for this run only, with
a warning: pages written now verify until the kvstore restarts. A key file that exists but is
not ours, not private or not a key is refused: `PageKeyError`, and the kvstore does not start.
"""

from __future__ import annotations

from pathlib import Path

from switchyard.common.secret_keys import SecretKeyError, load_secret_key

KEY_NAME = "page.key"
PageKeyError = SecretKeyError  # the key file (or its cache dir) cannot be trusted or used


def key_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / KEY_NAME


def load_page_key(path: Path) -> tuple[bytes, str]:
    """(the key, "" or why it is a key for this run only)."""
    return load_secret_key(path, "page key", "pages written with the old one become misses",
                           "pages written now are misses after the kvstore restarts")
