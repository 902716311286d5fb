"""A request's page chain and slot matching by page ids: the same answers as the token-by-token
definitions, at O(pages) cost (docs/design/scheduling.md "Scheduling")."""

import random

from switchyard.proto.values import SamplingParams
from switchyard.common.page_ids import chain_page_ids
from switchyard.scheduler.requests import Request, Slot, common_prefix_len

NS = b"n" * 16
P = 8


def request(prompt):
    return Request("r", tuple(prompt), 100, SamplingParams(), frozenset(), "interactive", 0.0)


def test_context_chain_grows_with_generated_tokens_and_equals_a_full_recompute():
    req = request(range(1, 20))
    assert req.context_chain(NS, P) == chain_page_ids(NS, list(range(1, 19)), P)
    first = list(req.page_ids)
    for t in range(100, 130):
        req.add_token(t)
        assert req.feed == [*range(1, 20), *range(100, t + 1)]
        chain = req.context_chain(NS, P)
        assert chain == chain_page_ids(NS, req.feed[:-1], P)
        assert chain[:len(first)] == first  # extended, never rebuilt
    other = b"o" * 16
    assert req.context_chain(other, P) == chain_page_ids(other, req.feed[:-1], P)


def test_shared_prefix_by_page_ids_equals_the_token_by_token_prefix():
    rng = random.Random(0)
    base = [rng.randrange(1, 50) for _ in range(120)]
    for _ in range(300):
        # A slot and a context that share a random prefix, then diverge (or one ends).
        cut = rng.randrange(0, 121)
        a = base[:cut] + [rng.randrange(50, 60) for _ in range(rng.randrange(0, 30))]
        b = base[:rng.randrange(cut, 121)] + [rng.randrange(60, 70)
                                              for _ in range(rng.randrange(0, 30))]
        slot = Slot(0, list(a), page_ids=chain_page_ids(NS, a, P))
        n = max(0, len(b) - rng.randrange(0, 3))  # the context may stop short of the feed
        got = slot.shared_prefix(chain_page_ids(NS, b[:n], P), b, n, P)
        assert got == common_prefix_len(a, b[:n])
