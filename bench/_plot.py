"""The benchmarks' plots, drawn by the bench itself (never by hand): matplotlib's Agg backend
without pyplot's global state, so a plot is a pure function of its figures.

Not a benchmark itself (bench/agent_traffic.py `--plot` and bench/agent_session.py use it). matplotlib comes with the
`bench` extra (`pip install -e '.[bench]'`), not with the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WIDTH, HEIGHT, DPI = 1200, 700, 100  # pixels of every plot


def check_plotting(ap) -> None:
    """`--plot` without matplotlib: the argument parser's error, before anything runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        ap.error("--plot needs matplotlib: pip install -e '.[bench]'")


def plot_ttft(series: dict[str, list[tuple[float, float]]], path: Path, title: str = "") -> Path:
    """A PNG of TTFT per request: `series` maps a server to its (seconds after its run's first
    request, TTFT seconds) points, one marker series each."""
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("plot_ttft: no series to draw")
    fig = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    ax = fig.subplots()
    for (name, points), marker in zip(series.items(), "os^vDx+*"):
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker=marker, linestyle="", markersize=4, alpha=0.8,
                label=f"{name} ({len(points)} requests)")
    ax.set_xlabel("request sent (s after the run's first request)")
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)  # a fixed size: no bbox_inches="tight"
    return path


# A session's timeline (bench/agent_session.py), drawn as the dashboard draws it: the parts of
# a request's bar, in order, and their colours (gateway/static/dashboard.css).
PARTS = ("reused", "copied", "restored", "prefilled", "decoded")
COLOURS = {"reused": "#2f9e44", "copied": "#74b816", "restored": "#1c7ed6",
           "prefilled": "#e8590c", "decoded": "#868e96"}
PROMPT_PARTS = PARTS[:-1]


@dataclass(frozen=True)
class Bar:
    """One request: its conversation's lane, its times (seconds after the session's start:
    arrival, first token, end) and its tokens by part (`PARTS`: the prompt's by source, and
    those decoded)."""

    lane: str
    start_s: float
    first_token_s: float
    end_s: float
    tokens: dict[str, int]


def bar_parts(bar: Bar) -> list[tuple[str, float, float]]:
    """(part, start, width) in seconds: until its first token the bar is split in proportion
    to where its prompt's tokens came from (their share of the prompt, not of the time), then
    it decodes until its end. Parts without tokens are left out."""
    prompt = sum(bar.tokens.get(k, 0) for k in PROMPT_PARTS)
    out, x = [], bar.start_s
    waited = max(0.0, bar.first_token_s - bar.start_s)
    for k in PROMPT_PARTS:
        width = waited * bar.tokens.get(k, 0) / prompt if prompt else 0.0
        if width > 0:
            out.append((k, x, width))
        x += width
    if bar.tokens.get("decoded", 0) and bar.end_s > bar.first_token_s:
        out.append(("decoded", bar.first_token_s, bar.end_s - bar.first_token_s))
    return out


def plot_timeline(bars: list[Bar], path: Path, title: str = "") -> Path:
    """A PNG of a session: a lane per conversation (in the order each started), a bar per
    request (`bar_parts`), its TTFT written beside it."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not bars:
        raise ValueError("plot_timeline: no requests to draw")
    lanes = list(dict.fromkeys(b.lane for b in sorted(bars, key=lambda b: b.start_s)))
    height = max(HEIGHT // 2, 140 + 46 * len(lanes))
    fig = Figure(figsize=(WIDTH / DPI, height / DPI), dpi=DPI)
    ax = fig.subplots()
    end = max(b.end_s for b in bars)
    least = end / 400  # a bar narrower than a few pixels is widened to be seen
    for bar in bars:
        y = len(lanes) - 1 - lanes.index(bar.lane)
        for part, x, width in bar_parts(bar):
            ax.broken_barh([(x, max(width, least))], (y - 0.32, 0.64),
                           facecolors=COLOURS[part], edgecolor="white", linewidth=0.4)
        ax.text(bar.end_s + end * 0.005, y, f"{1000 * (bar.first_token_s - bar.start_s):.0f} ms",
                va="center", fontsize=7, color="#495057")
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)), fontsize=8)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlim(0, end * 1.08)
    ax.set_xlabel("seconds after the session's first request (until its first token, a bar is "
                  "split by where its prompt's tokens came from; its TTFT beside it)")
    ax.grid(axis="x", alpha=0.3)
    totals = {k: sum(b.tokens.get(k, 0) for b in bars) for k in PARTS}
    ax.legend(handles=[Patch(color=COLOURS[k], label=f"{k} {totals[k]:,}") for k in PARTS],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(PARTS), fontsize=8,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path
