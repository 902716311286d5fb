"""bench/agent_session.py's timeline, without a server: the status's recent requests become
bars in lanes named by who each conversation is (bench/agent_session.py `bars_of`), a bar is
split until its first token by where its prompt came from (bench/_plot.py `bar_parts`), and
the PNG is drawn at a fixed size, small enough for docs/."""

from __future__ import annotations

import pytest

from bench._plot import Bar, bar_parts, plot_timeline
from switchyard.proto.status import RecentRequest


def recent(rid: str, conversation: str, start: float, ttft: float, end: float, **tokens
           ) -> RecentRequest:
    fields = {f"{k}_tokens": v for k, v in tokens.items()}
    prompt = sum(v for k, v in tokens.items() if k != "generated")
    return RecentRequest(at=end, ttft_s=ttft, cause="reused", prompt_tokens=prompt,
                         cached_tokens=prompt - tokens.get("prefilled", 0),
                         priority="interactive", rid=rid, conversation=conversation,
                         started_at=start, **fields)


SESSION = [
    recent("m1", "aaaaaaaaaaaa", 100.0, 1.2, 1.5 + 100, prefilled=20000, generated=90),
    recent("s1", "bbbbbbbbbbbb", 101.6, 0.9, 103.0, prefilled=9000, generated=30),
    recent("s2", "bbbbbbbbbbbb#2", 101.6, 1.3, 103.2, copied=8960, prefilled=60, generated=30),
    recent("s1b", "bbbbbbbbbbbb", 103.1, 0.05, 103.3, reused=9030, prefilled=40, generated=8),
    recent("x", "cccccccccccc", 100.1, 0.1, 100.2, prefilled=30, generated=5),
    recent("m2", "aaaaaaaaaaaa", 103.4, 0.04, 103.6, reused=20090, restored=0, prefilled=200,
           generated=8),
]
RULES = {"m1": "cc.main.start", "s1": "cc.sub.a.txt.start", "s2": "cc.sub.b.txt.start",
         "s1b": "sub.a.txt.counted", "m2": "cc.main.total"}


def test_requests_become_bars_in_lanes_named_by_who_they_are():
    from bench.agent_session import bars_of, figures

    bars = bars_of(SESSION, RULES)
    assert [b.lane for b in bars] == [
        "main agent aaaaaaaaaaaa", "side request cccccccccccc", "sub-agent a.txt bbbbbbbbbbbb",
        "sub-agent b.txt bbbbbbbbbbbb#2", "sub-agent a.txt bbbbbbbbbbbb", "main agent aaaaaaaaaaaa"]
    m2 = bars[-1]
    assert (round(m2.start_s, 2), round(m2.first_token_s, 2), round(m2.end_s, 2)) == (3.4, 3.44, 3.6)
    assert m2.tokens == {"reused": 20090, "copied": 0, "restored": 0, "prefilled": 200,
                         "decoded": 8}
    table = figures(bars, [RULES.get(r.rid) for r in sorted(SESSION,
                                                            key=lambda r: r.started_at)])
    assert len(table) == 1 + len(SESSION) and "cc.main.total" in table[-1]


def test_a_bar_is_split_by_its_prompts_sources_until_its_first_token():
    bar = Bar("l", 1.0, 3.0, 4.0, {"reused": 300, "copied": 100, "restored": 0,
                                   "prefilled": 100, "decoded": 7})
    parts = bar_parts(bar)
    assert [p[0] for p in parts] == ["reused", "copied", "prefilled", "decoded"]
    assert [pytest.approx(p[1:]) for p in parts] == [(1.0, 1.2), (2.2, 0.4), (2.6, 0.4),
                                                      (3.0, 1.0)]
    # Nothing decoded (a stream stopped before its first token): no decoded part.
    assert [p[0] for p in bar_parts(Bar("l", 0, 1, 1, {"prefilled": 5}))] == ["prefilled"]


def test_the_timeline_png_is_drawn_small(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.agent_session import bars_of

    path = plot_timeline(bars_of(SESSION, RULES), tmp_path / "t.png", title="a session")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 200_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 350)  # four lanes: at least half the standard height
    with pytest.raises(ValueError):
        plot_timeline([], tmp_path / "none.png")
