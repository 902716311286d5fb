"""A launchd or systemd unit for SMG (the Shepherd Model Gateway) in front of several servers
(docs/operations.md "Behind a router (SMG)").

    plan = router_plan(settings, ["http://10.0.0.1:8001", "http://10.0.0.2:8001"])  # I/O: finds smg
    smg_arguments(plan)                  # pure from here on: `smg launch ...`
    launchd_files(plan), systemd_files(plan)

One unit, `com.switchyard.router[.suffix]` / `switchyard[-suffix]-router.service`, apart from
the servers' own units: SMG listens on the settings' --host and --port and sends each request
to one of the servers with `--policy cache_aware`, with the health-check and failover flags
of FAILOVER_FLAGS. No key is ever in the unit: SMG passes each client's key through unchanged
to the servers, which check it (docs/security.md "Tenants").
"""

from __future__ import annotations

import dataclasses
import plistlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from switchyard.common.settings import Settings, user_cache_dir
from switchyard.deploy import launchd, systemd
from switchyard.deploy.service_units import UnitError, check_suffix, project_root

ROLE = "router"
POLICY = "cache_aware"
# SMG's flags for a server that stops answering, and each value's reason. SMG 1.13's own
# defaults probe every 60 s and give up registering a server after 30 minutes.
FAILOVER_FLAGS = (
    # Switchyard's /health answers 503 while a server starts or its scheduler is gone.
    "--health-check-endpoint", "/health",
    # Probed every 5 s; two failures take a server out (about 10 s), one success brings it back.
    "--health-check-interval-secs", "5",
    "--health-check-timeout-secs", "5",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    # Without service discovery nothing would add a removed server again: keep it listed.
    "--no-remove-unhealthy-workers",
    # A server that starts after the router (another Mac waking up) joins within 5 s, for a day.
    "--worker-startup-check-interval", "5",
    "--worker-startup-timeout-secs", "86400",
    # A request that failed on a server (connection refused, reset) is sent again, to another.
    "--retry-max-retries", "3",
    # ... which SMG can do only for a body it kept: an agent resends its whole history, often
    # more than SMG's 1 MiB default.
    "--max-buffered-request-bytes", str(64 * 2**20),
    # A long prefill sends no token for a while; SMG's default (3 s) would send the
    # conversation's next turn away from its pages meanwhile. A server that is really stuck
    # fails its health checks instead.
    "--worker-wedge-secs", "120",
    # Open requests get 20 s after SIGTERM (the units allow 40 s before SIGKILL).
    "--shutdown-grace-period-secs", "20",
    # SMG's own Prometheus metrics listen on 0.0.0.0:29000 unless told: keep them on this host.
    "--prometheus-host", "127.0.0.1",
)


@dataclass(frozen=True)
class RouterPlan:
    """Everything the router's unit depends on, resolved; rendering is a pure function of it."""

    smg: str  # the `smg` executable, absolute
    worker_urls: tuple[str, ...]
    host: str
    port: int
    home: str
    working_dir: str
    model_aliases: tuple[str, ...] = ()  # NAME=SERVED, SMG's --model-alias
    smg_args: tuple[str, ...] = ()  # more SMG flags, appended (a later flag wins)
    label_suffix: str = ""


def check_worker_url(url: str) -> str:
    """`http(s)://HOST:PORT`, nothing else (SMG appends the API paths itself)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme not in ("http", "https") or not parts.hostname or port is None
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username):
        raise UnitError(f"--worker-url {url!r}: expected http://HOST:PORT of a Switchyard "
                        "server (e.g. http://10.0.0.2:8001)")
    return url.rstrip("/")


def check_alias(alias: str) -> str:
    name, sep, served = alias.partition("=")
    if not sep or not name or not served:
        raise UnitError(f"--model-alias {alias!r}: expected NAME=SERVED (e.g. "
                        "claude-sonnet-4-5=local)")
    return alias


def check_router_settings(settings: Settings) -> None:
    """Only --host and --port mean something to the router's unit (where SMG listens)."""
    defaults = Settings()
    given = [f.name.replace("_", "-") for f in dataclasses.fields(settings)
             if f.name not in ("host", "port")
             and getattr(settings, f.name) != getattr(defaults, f.name)]
    if given:
        raise UnitError(f"--router: only --host and --port apply (where SMG listens), not "
                        f"--{', --'.join(given)}: the servers' settings go in their own units; "
                        "tenants' keys pass through SMG to them")


def find_smg(given: str | None) -> str:
    """`given`, else `smg` on PATH, else the one switchyard.testing.smg installs."""
    candidates = [given] if given else [shutil.which("smg"),
                                        str(user_cache_dir() / "smg-venv" / "bin" / "smg")]
    for candidate in candidates:
        if candidate and Path(candidate).expanduser().is_file():
            return str(Path(candidate).expanduser().absolute())
    raise UnitError((f"--smg {given}: no such file" if given else "smg not found") +
                    ": install SMG (python3 -m venv ~/.smg && ~/.smg/bin/pip install smg) and "
                    "give --smg ~/.smg/bin/smg")


def router_plan(settings: Settings, worker_urls: list[str] | None, *, smg: str | None = None,
                model_aliases: list[str] | None = None, smg_args: list[str] | None = None,
                label_suffix: str = "", home: str | None = None) -> RouterPlan:
    check_router_settings(settings)
    if not worker_urls:
        raise UnitError("--router needs the servers: --worker-url http://HOST:PORT, once per "
                        "server")
    home = home or str(Path.home())
    root = project_root()
    return RouterPlan(smg=find_smg(smg), worker_urls=tuple(map(check_worker_url, worker_urls)),
                      host=settings.host, port=settings.port, home=home,
                      working_dir=str(root) if root else home,
                      model_aliases=tuple(map(check_alias, model_aliases or ())),
                      smg_args=tuple(smg_args or ()), label_suffix=check_suffix(label_suffix))


# -- rendering (pure) -----------------------------------------------------------------------------

def smg_arguments(plan: RouterPlan) -> list[str]:
    argv = [plan.smg, "launch", "--worker-urls", *plan.worker_urls, "--policy", POLICY,
            "--host", plan.host, "--port", str(plan.port), *FAILOVER_FLAGS]
    for alias in plan.model_aliases:
        argv += ["--model-alias", alias]
    return argv + list(plan.smg_args)


def launchd_files(plan: RouterPlan) -> dict[str, str]:
    raw = plistlib.loads((launchd.TEMPLATE_DIR / launchd.plist_name(ROLE)).read_bytes())
    words = {"@LABEL@": launchd.label(ROLE, plan.label_suffix),
             "@WORKING_DIRECTORY@": plan.working_dir, "@HOME@": plan.home,
             "@LOG_DIR@": str(launchd.log_dir(plan))}
    agent = launchd._fill(raw, words, smg_arguments(plan))
    return {launchd.plist_name(ROLE, plan.label_suffix):
            plistlib.dumps(agent, sort_keys=False).decode()}


def systemd_files(plan: RouterPlan) -> dict[str, str]:
    name = systemd.unit_name(ROLE, plan.label_suffix)
    words = {"@WORKER_COUNT@": str(len(plan.worker_urls)),
             "@SUFFIX_NOTE@": f" [{plan.label_suffix}]" if plan.label_suffix else "",
             "@EXEC_START@": systemd.exec_line(smg_arguments(plan)),
             "@WORKING_DIRECTORY@": plan.working_dir.replace("%", "%%"),
             "@UNIT_STEM@": name.removesuffix(".service")}
    return {name: systemd.fill(systemd.template(f"switchyard-{ROLE}.service"), words)}


# -- service manager command lines (pure) ---------------------------------------------------------

def launchd_install(uid: int, path: Path, suffix: str = "") -> list[list[str]]:
    return [launchd.enable(uid, ROLE, suffix), launchd.bootstrap(uid, path)]


def systemd_install(suffix: str = "") -> list[list[str]]:
    return [systemd.systemctl("daemon-reload"),
            systemd.systemctl("enable", "--now", systemd.unit_name(ROLE, suffix))]


def systemd_uninstall(suffix: str = "") -> list[list[str]]:
    return [systemd.systemctl("disable", "--now", systemd.unit_name(ROLE, suffix))]
