"""Every local rank of a worker group gets its own kvstore (docs/design.md "Pages per rank")."""

import json

from deploy.group_roles import rank_roles, serve_roles
from proto.settings import Settings


def test_a_kvstore_per_local_rank(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]},
                                    {"ssh": "b", "ips": ["127.0.0.1"]},
                                    {"ssh": "c", "ips": ["192.0.2.9"]}]))
    settings = Settings(hostfile=str(hostfile))
    assert serve_roles(settings, can_bind=lambda ip: False) == (
        "scheduler", "kvstore", "kvstore.1", "worker.1", "worker", "gateway")
    assert rank_roles(Settings(hostfile=str(hostfile), rank=2)) == ("kvstore.2", "worker.2")
    assert serve_roles(Settings()) == ("scheduler", "kvstore", "worker", "gateway")
