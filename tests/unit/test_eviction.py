"""The disk page tree and the eviction policy (docs/design/kv-pages.md "Disk eviction policy")."""

import hashlib
import random

import pytest

from switchyard.proto.scheduler_kvstore import PageInfo
from switchyard.scheduler.eviction import (
    GIB,
    EvictionPlan,
    budget_report,
    plan_budget,
    plan_eviction,
)
from switchyard.scheduler.page_tree import ROOT_ID, DiskPageTree

DAY = 86400.0
NOW = 100 * DAY
OLD = NOW - 10 * DAY  # outside the protection window
PAGE = 1000  # bytes per page in most tests


def pid(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def add_chain(tree, names, t, parent=ROOT_ID, nbytes=PAGE):
    """Add pages `names` as one chain below `parent`, all used at `t`; return their ids."""
    ids = []
    for name in names:
        tree.add(pid(name), parent, nbytes, t)
        parent = pid(name)
        ids.append(parent)
    return ids


def names(page_ids, *chains):
    """Map ids back to names for readable assertions."""
    by_id = {pid(n): n for chain in chains for n in chain}
    return [by_id[p] for p in page_ids]


def apply(tree, plan: EvictionPlan):
    """Remove the plan's pages in order, checking each is a leaf when it goes."""
    for page_id in plan.page_ids:
        assert tree.num_children(page_id) == 0, "evicted a page that still had a child"
        tree.remove(page_id)


SYS = ["s0", "s1"]
CONV_A = ["a0", "a1", "a2", "a3"]
CONV_B = ["b0", "b1", "b2", "b3"]


def two_conversations():
    """A system prompt shared by A (used long ago, many hits) and B (newest, zero hits)."""
    tree = DiskPageTree()
    add_chain(tree, SYS, OLD)
    a = add_chain(tree, CONV_A, OLD, parent=pid("s1"))
    for k in range(20):  # A was hit many times; hit counts must not matter
        tree.touch([pid("s0"), pid("s1"), *a], OLD + 100 + k)
    add_chain(tree, CONV_B, OLD + 1000, parent=pid("s1"))
    tree.touch([pid("s0"), pid("s1")], OLD + 1000)
    return tree


# --- the page tree ----------------------------------------------------------------------------


def test_tree_structure_and_queries():
    tree = two_conversations()
    assert len(tree) == 10 and tree.total_bytes == 10 * PAGE
    assert tree.num_children(pid("s1")) == 2
    assert sorted(names(tree.leaves(), CONV_A, CONV_B)) == ["a3", "b3"]
    assert tree.parent(pid("a0")) == pid("s1") and tree.parent(pid("s0")) is None
    chain = [pid(n) for n in SYS + CONV_A]
    assert tree.longest_prefix(chain) == 6
    assert tree.longest_prefix(chain + [pid("a4")]) == 6
    assert tree.longest_prefix([pid("s0"), pid("x"), pid("s1")]) == 1
    assert tree.longest_prefix([]) == 0


def test_touch_updates_the_whole_chain_and_never_goes_back():
    tree = two_conversations()
    tree.touch([pid(n) for n in SYS + CONV_B], NOW)
    assert all(tree.last_used(pid(n)) == NOW for n in SYS + CONV_B)
    tree.touch([pid("b3"), pid("not-on-disk")], NOW - 5)
    assert tree.last_used(pid("b3")) == NOW


def test_re_adding_a_page_updates_size_and_rejects_another_parent():
    tree = DiskPageTree()
    tree.add(pid("p"), ROOT_ID, 10, 5.0)
    tree.add(pid("p"), ROOT_ID, 30, 1.0)
    assert tree.total_bytes == 30 and tree.last_used(pid("p")) == 5.0 and len(tree) == 1
    with pytest.raises(ValueError):
        tree.add(pid("p"), pid("other"), 30, 1.0)
    for bad in [(b"short", ROOT_ID, 1), (ROOT_ID, ROOT_ID, 1), (pid("q"), ROOT_ID, -1)]:
        with pytest.raises(ValueError):
            tree.add(*bad, 0.0)


def test_missing_parent_is_a_root_until_it_arrives():
    tree = DiskPageTree()
    add_chain(tree, ["c2", "c3"], OLD, parent=pid("c1"))  # c0 and c1 are not on disk
    assert tree.parent(pid("c2")) is None
    assert tree.longest_prefix([pid(n) for n in ["c0", "c1", "c2", "c3"]]) == 0
    plan = plan_eviction(tree, budget_bytes=0, incoming_bytes=0, now=NOW)
    assert names(plan.page_ids, ["c2", "c3"]) == ["c3", "c2"]

    tree.add(pid("c1"), pid("c0"), PAGE, OLD)  # arrives late: the gap closes below it
    assert tree.parent(pid("c2")) == pid("c1") and tree.num_children(pid("c1")) == 1
    assert names(tree.leaves(), ["c3"]) == ["c3"]
    tree.remove(pid("c2"))  # a middle page goes (say, found corrupt): c3 is a root again
    assert tree.parent(pid("c3")) is None and tree.num_children(pid("c1")) == 0
    assert tree.total_bytes == 2 * PAGE


def test_rebuild_from_inventory_in_any_order():
    tree = two_conversations()
    inventory = [PageInfo(p, _parent_of(tree, p), b"ns", 256, tree.nbytes(p), tree.last_used(p))
                 for p in tree.page_ids()]
    random.Random(7).shuffle(inventory)  # children may come before their parents
    rebuilt = DiskPageTree.from_inventory(inventory)
    assert sorted(rebuilt.leaves()) == sorted(tree.leaves())
    assert rebuilt.total_bytes == tree.total_bytes
    assert rebuilt.num_children(pid("s1")) == 2
    expected = plan_eviction(tree, 7 * PAGE, 0, NOW)
    assert plan_eviction(rebuilt, 7 * PAGE, 0, NOW) == expected


def _parent_of(tree, page_id):
    parent = tree.parent(page_id)
    return ROOT_ID if parent is None else parent


def test_prefix_is_as_recent_as_its_latest_conversation():
    # Files may record only their own write time: the stale prefix is still the working set.
    tree = DiskPageTree()
    add_chain(tree, ["a0", "a1"], OLD)
    tree.add(pid("a2"), pid("a1"), PAGE, NOW - 60)
    recency = tree.subtree_recency()
    assert recency[pid("a0")] == recency[pid("a1")] == NOW - 60
    plan = plan_eviction(tree, budget_bytes=0, incoming_bytes=0, now=NOW)
    assert plan.thrash.num_protected_evicted == 3
    assert plan.thrash.working_set_bytes == 3 * PAGE


# --- the eviction order ------------------------------------------------------------------------


@pytest.mark.parametrize("incoming_pages, expected", [
    (0, []),
    (1, ["a3"]),
    (2, ["a3", "a2"]),
    (4, ["a3", "a2", "a1", "a0"]),  # all of A goes before any of B, newest or not
    (6, ["a3", "a2", "a1", "a0", "b3", "b2"]),
    (8, ["a3", "a2", "a1", "a0", "b3", "b2", "b1", "b0"]),  # only now is the prompt a leaf
    (9, ["a3", "a2", "a1", "a0", "b3", "b2", "b1", "b0", "s1"]),
])
def test_third_conversation_evicts_the_lru_tail_first(incoming_pages, expected):
    tree = two_conversations()
    budget = tree.total_bytes  # holds the prompt and two conversations exactly
    plan = plan_eviction(tree, budget, incoming_pages * PAGE, NOW)
    assert names(plan.page_ids, SYS, CONV_A, CONV_B) == expected
    assert plan.fits and plan.thrash is None and plan.freed_bytes == incoming_pages * PAGE
    apply(tree, plan)
    assert tree.total_bytes + incoming_pages * PAGE <= budget
    if incoming_pages <= 8:
        assert tree.contains(pid("s0")) and tree.contains(pid("s1"))


def test_newest_checkpoint_with_zero_hits_survives():
    tree = two_conversations()
    plan = plan_eviction(tree, tree.total_bytes, 4 * PAGE, NOW)
    assert not {pid(n) for n in CONV_B} & set(plan.page_ids)


@pytest.mark.parametrize("pinned, expected", [
    ([], ["a3", "a2", "a1"]),
    (["a3"], ["b3", "b2", "b1"]),  # pinning the leaf keeps its whole prefix
    (["a1"], ["a3", "a2", "b3"]),  # a pinned middle page keeps its prefix, not its tail
    (["a3", "b3"], []),
])
def test_pinned_pages_never_go(pinned, expected):
    tree = two_conversations()
    plan = plan_eviction(tree, tree.total_bytes, 3 * PAGE, NOW, pinned={pid(n) for n in pinned})
    assert names(plan.page_ids, SYS, CONV_A, CONV_B) == expected
    assert plan.fits == bool(expected)


def test_evict_first_goes_before_everything_even_protected():
    tree = two_conversations()
    tree.add(pid("snap"), pid("b3"), PAGE, NOW - 1)  # a superseded, recent state snapshot
    plan = plan_eviction(tree, tree.total_bytes, 2 * PAGE, NOW, evict_first={pid("snap")})
    assert names(plan.page_ids, CONV_A, ["snap"]) == ["snap", "a3"]
    assert plan.thrash is None


# --- protection and thrash --------------------------------------------------------------------


def protected_setup():
    """An old conversation O, and A and B active in the last hour, sharing a recent prompt."""
    tree = DiskPageTree()
    mib100 = 100 << 20
    add_chain(tree, ["o0", "o1"], OLD, nbytes=mib100)
    add_chain(tree, SYS, NOW - 3600, nbytes=mib100)
    add_chain(tree, CONV_A, NOW - 3600, parent=pid("s1"), nbytes=mib100)
    add_chain(tree, CONV_B, NOW - 60, parent=pid("s1"), nbytes=mib100)
    tree.touch([pid(n) for n in SYS], NOW - 60)
    return tree, mib100


def test_unprotected_pages_go_without_thrash():
    tree, size = protected_setup()
    plan = plan_eviction(tree, tree.total_bytes, 2 * size, NOW)
    assert names(plan.page_ids, ["o0", "o1"]) == ["o1", "o0"] and plan.thrash is None


def test_protected_pages_go_last_with_sizing_advice():
    tree, size = protected_setup()
    budget = tree.total_bytes
    plan = plan_eviction(tree, budget, 5 * size, NOW)
    assert names(plan.page_ids, ["o0", "o1"], CONV_A) == ["o1", "o0", "a3", "a2", "a1"]
    report = plan.thrash
    assert report.num_protected_evicted == 3
    assert report.working_set_bytes == 10 * size  # the prompt, A and B, not O
    assert report.budget_bytes == budget
    assert report.suggested_budget_bytes == 2 * GIB  # 15 x 100 MiB, rounded up to a GiB
    assert report.suggested_budget_bytes >= report.working_set_bytes + 5 * size
    assert plan_eviction(tree, budget, 5 * size, NOW, protect_window_s=60).thrash is None


# --- the budget -------------------------------------------------------------------------------


def test_incoming_larger_than_the_budget_evicts_nothing():
    tree = two_conversations()
    pinned = {pid(n) for n in SYS + CONV_B}
    plan = plan_eviction(tree, 20 * PAGE, 21 * PAGE, NOW, pinned=pinned)
    assert plan == EvictionPlan(fits=False)


def test_not_fitting_still_brings_the_disk_within_a_lowered_budget():
    tree = two_conversations()
    pinned = {pid(n) for n in SYS + CONV_B}
    plan = plan_eviction(tree, 8 * PAGE, 5 * PAGE, NOW, pinned=pinned)
    assert not plan.fits
    assert names(plan.page_ids, CONV_A) == ["a3", "a2"]
    assert not pinned & set(plan.page_ids)
    apply(tree, plan)
    assert tree.total_bytes <= 8 * PAGE


def test_pinned_alone_over_budget_evicts_all_else():
    tree = two_conversations()
    pinned = {pid(n) for n in SYS + CONV_B}
    plan = plan_eviction(tree, 2 * PAGE, 0, NOW, pinned=pinned)
    assert not plan.fits and set(plan.page_ids) == {pid(n) for n in CONV_A}


def random_forest(rng, num_pages, now):
    tree = DiskPageTree()
    ids = []
    for i in range(num_pages):
        r = rng.random()
        if not ids or r < 0.05:
            parent = ROOT_ID
        elif r < 0.08:
            parent = pid(f"missing-{i}")  # a gap: its parent was evicted
        elif r < 0.3:
            parent = rng.choice(ids)  # a branch off some prefix
        else:
            parent = ids[-1]  # extend the latest chain
        page_id = pid(f"page-{i}")
        tree.add(page_id, parent, rng.randint(1, 4) * PAGE, now - rng.uniform(0, 3 * DAY))
        ids.append(page_id)
    return tree, ids


@pytest.mark.parametrize("seed", range(20))
def test_budget_is_never_exceeded_and_only_leaves_go(seed):
    rng = random.Random(seed)
    tree, ids = random_forest(rng, 300, NOW)
    pinned = set(rng.sample(ids, 5))
    budget = rng.randint(0, tree.total_bytes)
    incoming = rng.randint(0, budget // 4 + 1)
    plan = plan_eviction(tree, budget, incoming, NOW, pinned=pinned)
    assert not pinned & set(plan.page_ids)
    assert len(set(plan.page_ids)) == len(plan.page_ids)
    before = tree.total_bytes
    apply(tree, plan)
    assert before - tree.total_bytes == plan.freed_bytes
    if plan.fits:
        assert tree.total_bytes + incoming <= budget
    elif tree.total_bytes > budget:  # only pinned pages and their prefixes are left
        assert all(p in pinned for p in tree.leaves())


@pytest.mark.parametrize("shape", ["forest", "one_chain"])
def test_ten_thousand_pages_plan_whole(shape):
    """Emptying a large tree takes every page, children before parents. (How long planning
    takes is a benchmark's question, not a test's: this machine is shared.)"""
    if shape == "forest":
        tree, _ = random_forest(random.Random(1), 10_000, NOW)
    else:
        tree = DiskPageTree()
        add_chain(tree, [f"p{i}" for i in range(10_000)], OLD)
    plan = plan_eviction(tree, budget_bytes=0, incoming_bytes=0, now=NOW)
    assert len(plan.page_ids) == 10_000 and plan.fits
    apply(tree, plan)
    assert tree.total_bytes == 0


def test_rejects_negative_sizes():
    with pytest.raises(ValueError):
        plan_eviction(DiskPageTree(), -1, 0, NOW)


# --- sizing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bpt, budget, tokens, conversations", [
    (100_000, 4 * 10**9, 40_000, 0.4),  # a 4 GB default holds less than one conversation
    (100_000, 100 * 10**9, 1_000_000, 10.0),
    (36_864, 64 * GIB, 1_864_135, 18.6),
])
def test_budget_report(bpt, budget, tokens, conversations):
    report = budget_report(bpt, budget)
    assert report["budget_tokens"] == tokens
    assert report["budget_conversations"] == conversations
    assert report["conversation_tokens"] == 100_000
    assert budget_report(bpt, budget, conversation_tokens=50_000)["budget_conversations"] \
        == round(tokens / 50_000, 1)


@pytest.mark.parametrize("bpt, conversations, tokens, overhead, expected", [
    (1000, 1, 256, 0, 256_000),
    (1000, 2, 512, 100, 2 * (512_000 + 200)),
    (1000, 1, 300, 100, 512_000 + 200),  # a partial page counts in full
    (1000, 0, 100_000, 100, 0),
])
def test_plan_budget(bpt, conversations, tokens, overhead, expected):
    assert plan_budget(bpt, conversations, tokens, overhead) == expected


def test_plan_budget_holds_what_the_report_promises():
    need = plan_budget(100_000, 10, 100_000, 4096)
    assert budget_report(100_000, need)["budget_conversations"] >= 10
