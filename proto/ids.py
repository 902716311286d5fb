"""Identifiers: boot ids for process incarnations, request ids."""

from __future__ import annotations

import secrets


def new_boot_id() -> str:
    return secrets.token_hex(8)


def new_rid(prefix: str = "req") -> str:
    return f"{prefix}-{secrets.token_hex(12)}"
