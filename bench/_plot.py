"""The benchmarks' plots, drawn by the bench itself (never by hand): matplotlib's Agg backend
without pyplot's global state, so a plot is a pure function of its figures.

Not a benchmark itself (bench/agent_traffic.py `--plot` uses it). matplotlib comes with the
`bench` extra (`pip install -e '.[bench]'`), not with the server.
"""

from __future__ import annotations

from pathlib import Path

WIDTH, HEIGHT, DPI = 1200, 700, 100  # pixels of every plot


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
