"""The worker group's key file: CURVE keys that authenticate the scheduler's TCP endpoint.

`switchyard group-key --out PATH` writes one (JSON, mode 0600): the scheduler's CURVE keypair
and one client keypair, z85. The operator copies it to every host of the group; the scheduler
binds `--scheduler-address` as a CURVE server whose ZAP handler admits only the file's client
public key, and other hosts' kvstores connect as that client (docs/design.md "Pages per
rank"). The file's contents never go on a command line; a file other users can read is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from switchyard.common.secret_files import SettingsError, read_private_file

FORMAT = "switchyard-group-key-1"
ZAP_DOMAIN = "switchyard-group"
_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


@dataclass(frozen=True)
class GroupKey:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def new_group_key() -> GroupKey:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return GroupKey(server_public, server_secret, client_public, client_secret)


def write_group_key(path: str) -> GroupKey:
    """A new key file at `path`, created 0600; an existing file is never overwritten."""
    key = new_group_key()
    text = json.dumps({"format": FORMAT, **{f: getattr(key, f).decode() for f in _FIELDS}},
                      indent=2) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        raise SettingsError(f"{path} exists; not overwriting a group key (remove it first, "
                            f"then copy the new one to every host)") from None
    except OSError as exc:
        raise SettingsError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # whatever the umask
        f.write(text)
    return key


def read_group_key(path: str) -> GroupKey:
    """The keys in `path`, refusing a file group or other users can read, or a malformed one."""
    flag = f"--group-key-file {path}"
    raw = read_private_file(path, "--group-key-file", 65536)
    try:
        data = json.loads(raw)
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        key = GroupKey(*(data[f].encode("ascii") for f in _FIELDS))
        if zmq.curve_public(key.server_secret) != key.server_public or \
                zmq.curve_public(key.client_secret) != key.client_public:
            raise ValueError("public and secret keys do not match")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeError, zmq.ZMQError) as exc:
        raise SettingsError(f"{flag} is not a group key file ({exc}); make one with "
                            f"`switchyard group-key --out PATH`") from None
    return key


def start_authenticator(ctx: zmq.Context, key: GroupKey) -> ThreadAuthenticator:
    """A ZAP handler in `ctx` that admits CURVE clients holding the file's client key only."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(key.client_public))
    return auth


class _OnlyKey:
    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return domain == ZAP_DOMAIN and client_key == self.public


def bind_curve(sock: zmq.Socket, address: str, key: GroupKey) -> None:
    """Bind `address` as a CURVE server. Security options apply to the endpoints bound after
    they are set, so endpoints bound before (the local ipc one) keep the NULL mechanism."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.server_secret)
    sock.bind(address)


def curve_client(sock: zmq.Socket, key: GroupKey) -> zmq.Socket:
    """Make `sock` (not yet connected) a CURVE client of the group's scheduler."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, key.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, key.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.client_secret)
    return sock
