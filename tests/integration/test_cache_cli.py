"""`switchyard cache plan` and `cache stats` on a tiny model and a real page directory."""

import json

from switchyard.deploy.cli import main
from switchyard.kvstore.store import PageStore
from switchyard.common.page_ids import ROOT_ID, make_namespace


def test_cache_plan_sizes_linearly(tiny_model_dir, capsys):
    model = str(tiny_model_dir("qwen3"))
    assert main(["cache", "plan", "--model", model, "--conversations", "1",
                 "--tokens", "100000"]) == 0
    one = capsys.readouterr().out
    assert "4,096 bytes" in one  # 4 layers x 2 kv heads x 64 dims x (K+V) x float32
    assert main(["cache", "plan", "--model", model, "--conversations", "10",
                 "--tokens", "100000"]) == 0
    ten = capsys.readouterr().out
    assert "budget needed    3.8 GiB for 10 conversations" in ten
    assert "--kv-disk-budget 4GiB" in ten


def test_cache_plan_counts_quantized_kv(tiny_model_dir, capsys):
    model = str(tiny_model_dir("qwen3"))
    # packed + float32 scale and bias per group: of 64 with 8 bits, of 32 with 4 (the default)
    for bits, per_token, group in ((8, "1,152", 64), (4, "768", 32)):
        assert main(["cache", "plan", "--model", model, "--conversations", "10",
                     "--tokens", "100000", "--kv-bits", str(bits)]) == 0
        assert f"{per_token} bytes ({bits}-bit, groups of {group})" in capsys.readouterr().out


def test_cache_plan_rejects_bad_numbers(capsys):
    assert main(["cache", "plan", "--conversations", "0", "--tokens", "5"]) == 2


def test_cache_stats_reads_without_changing(tmp_path, capsys):
    store = PageStore(tmp_path, sync=False)
    ns = make_namespace("m")
    store.write(ns, ROOT_ID, list(range(16)), b"x" * 1000)
    (tmp_path / "junk.tmp").write_text("left by a crash")
    assert main(["cache", "stats", "--kv-dir", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_pages"] == 1 and report["num_tokens"] == 16
    assert list(report["namespaces"]) == [ns.hex()]
    assert report["ranks"] == []  # not a worker group's directory
    assert (tmp_path / "junk.tmp").exists()


def test_cache_stats_counts_every_ranks_share(tmp_path, capsys):
    """A worker group's rank R keeps its shares in <kv-dir>/rank-R: a line per rank."""
    ns = make_namespace("m")
    PageStore(tmp_path, sync=False).write(ns, ROOT_ID, list(range(16)), b"x" * 1000)
    for rank, num_pages in ((1, 2), (2, 1)):
        store = PageStore(tmp_path / f"rank-{rank}", sync=False)
        for i in range(num_pages):
            store.write(ns, ROOT_ID, list(range(i, 16 + i)), b"y" * 500)
    (tmp_path / "rank-x").mkdir()  # not a rank's directory
    assert main(["cache", "stats", "--kv-dir", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_pages"] == 1  # the totals stay rank 0's, as before
    assert [(r["rank"], r["num_pages"]) for r in report["ranks"]] == [(0, 1), (1, 2), (2, 1)]
    assert report["ranks"][1]["kv_dir"] == str(tmp_path / "rank-1")
    assert main(["cache", "stats", "--kv-dir", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank ")]
    assert [line.split()[:3] for line in lines] == [["rank", "0", "1"], ["rank", "1", "2"],
                                                     ["rank", "2", "1"]]


def test_cache_stats_without_directory(tmp_path, capsys):
    assert main(["cache", "stats", "--kv-dir", str(tmp_path / "none")]) == 1
    assert "no page directory" in capsys.readouterr().out
