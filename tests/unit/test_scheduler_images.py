"""The scheduler core with images: page ids chain the images they cover, matches end where a
differing image starts, commands carry what the worker needs, the encoder's cost is budgeted.
No sockets, no MLX: the scripted worker and kvstore of test_scheduler_pages."""

from switchyard.proto.values import ImageData, ImageSpan, SamplingParams
from switchyard.proto.scheduler_worker import SlotContents
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.proto.scheduler_kvstore import WritePages
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, page_id, page_image_ids
from switchyard.scheduler.prefill_plan import cut_before_images
from switchyard.scheduler.requests import Request, Slot, images_agree
from switchyard.scheduler.step_budget import PrefillBudget
from tests.unit.test_scheduler_pages import EOS, NS, P, Group, conv, worker_ready

X, Y = b"x" * 16, b"y" * 16
PLACEHOLDER = 4000


def with_image(tokens: list[int], start: int, num: int, image_id: bytes):
    """`tokens` with an image's placeholders at [start, start + num), and its span."""
    out = list(tokens)
    out[start:start + num] = [PLACEHOLDER] * num
    return out, ImageSpan(image_id, start, num, (1, 2, num // 2 * 2 // 2))


def submit(g: Group, rid: str, prompt: list[int], images=(), max_tokens=4):
    data = tuple(ImageData(im.image_id, b"file-" + im.image_id) for im in images)
    g.do(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,), "interactive",
                       tuple(images), data))


def test_page_ids_chain_the_images_they_cover():
    prompt, span = with_image(conv(1, 5 * P), P + 4, 8, X)  # in page 1
    plain = chain_page_ids(NS, prompt, P)
    ids = chain_page_ids(NS, prompt, P, images=(span,))
    assert ids[0] == plain[0]  # before the image: the id it always had
    assert all(a != b for a, b in zip(ids[1:], plain[1:]))  # the image's page and all after
    assert ids[1] == page_id(NS, ids[0], prompt[P:2 * P], X)
    other = chain_page_ids(NS, prompt, P, images=(ImageSpan(Y, P + 4, 8),))
    assert other[0] == ids[0] and other[1] != ids[1]
    # A chain computed from its middle (as pages fill) is the same chain.
    assert chain_page_ids(NS, prompt[2 * P:], P, ids[1], (span,), 2 * P) == ids[2:]
    assert page_image_ids((span,), 0, P) == b"" and page_image_ids((span,), P, 2 * P) == X


def test_written_pages_carry_their_image_ids():
    g = Group()
    prompt, span = with_image(conv(1, 4 * P + 3), P + 10, 12, X)  # pages 1 and 2
    submit(g, "a", prompt, (span,))
    g.run()
    writes = [w for m in g.msgs if isinstance(m, WritePages) for w in m.writes]
    by_parent = {w.parent_id: w for w in writes if len(w.token_ids) == P}
    ids = chain_page_ids(NS, prompt, P, images=(span,))
    for k, pid in enumerate(ids):
        write = by_parent[ids[k - 1] if k else ROOT_ID]
        assert write.page_id == pid
        assert write.image_ids == page_image_ids((span,), k * P, (k + 1) * P)
        assert page_id(NS, write.parent_id, write.token_ids, write.image_ids) == pid


def test_the_same_tokens_with_another_image_share_nothing_from_where_it_starts():
    prompt, span_x = with_image(conv(1, 6 * P), 2 * P + 5, 8, X)
    span_y = ImageSpan(Y, span_x.start, span_x.num_tokens, span_x.grid)
    # In the slot: the match ends where the images part.
    g = Group(num_slots=1)
    submit(g, "x", prompt, (span_x,))
    g.run()
    submit(g, "y", prompt, (span_y,))
    g.run()
    assert g.finished("y").num_cached_tokens == span_x.start
    # From disk (another conversation took the slot): the full pages before the image only.
    g = Group(num_slots=1)
    submit(g, "x", prompt, (span_x,))
    g.run()
    submit(g, "b", conv(9, 3 * P))
    g.run()
    submit(g, "y", prompt, (span_y,))
    g.run()
    assert g.finished("y").num_cached_tokens == 2 * P
    # The same image comes back: all but the prompt's last token, from the tail stored
    # where its context ended (docs/design/kv-pages.md "Exact repeats and state marks").
    submit(g, "b2", conv(9, 3 * P))
    g.run()
    submit(g, "x2", prompt, (span_x,))
    g.run()
    assert g.finished("x2").num_cached_tokens == len(prompt) - 1


def test_chunks_and_loads_carry_the_images_and_files_they_need():
    g = Group(num_slots=1, prefill_chunk=P)
    prompt, span = with_image(conv(2, 4 * P + 3), P + 4, 20, X)  # longer than a chunk
    submit(g, "a", prompt, (span,))
    g.run()
    chunks = [c for s in g.steps for c in s.prefills]
    for c in chunks:
        end = c.start + len(c.token_ids)
        assert c.images == ((span,) if span.start < end else ())
        covers = span.start < end and span.end > c.start
        assert [d.image_id for d in c.image_data] == ([X] if covers else [])
    # The chunk before the image ends where it starts (its encoding did not fit the step),
    # and the image's placeholders take the next two chunks.
    assert span.start in [c.start for c in chunks]
    assert sum(bool(c.image_data) for c in chunks) == 2
    submit(g, "b", conv(9, 3 * P))
    g.run()
    since = len(g.steps)
    submit(g, "a2", prompt + g.reply("a")[:-1] + conv(3, 5))
    g.core.requests["a2"].images = (span,)  # as the gateway would send them
    g.run()
    loads = [ld for s in g.steps[since:] for ld in s.loads]
    assert loads and all(ld.images == (span,) for ld in loads)


def test_a_slot_the_worker_reports_keeps_its_images():
    """A scheduler that meets a worker with filled slots (its own restart) gets the images
    with the tokens, so the slot's page ids are the ones its pages were written under."""
    g = Group(num_slots=1)
    prompt, span = with_image(conv(4, 3 * P), 4, 8, X)
    g.do(worker_ready(g.core, slots=(SlotContents(0, tuple(prompt), (span,)),)))
    slot = g.core.slots[0]
    g.core.pages.sync_slot(slot)
    assert slot.images == (span,)
    assert slot.page_ids == chain_page_ids(NS, prompt, P, images=(span,))


def test_shared_prefix_ends_where_the_images_part():
    tokens, span_x = with_image(conv(5, 3 * P), P + 3, 6, X)
    span_y = ImageSpan(Y, span_x.start, span_x.num_tokens)
    slot = Slot(0, list(tokens), page_ids=chain_page_ids(NS, tokens, P, images=(span_x,)),
                images=(span_x,))
    chain_y = chain_page_ids(NS, tokens, P, images=(span_y,))
    assert slot.shared_prefix(chain_y, tokens, len(tokens), P, (span_y,)) == span_x.start
    chain_x = chain_page_ids(NS, tokens, P, images=(span_x,))
    assert slot.shared_prefix(chain_x, tokens, len(tokens), P, (span_x,)) == len(tokens)
    assert images_agree((span_x,), (span_x,), 0, 100) == 100
    assert images_agree((span_x,), (), 0, 100) == span_x.start
    assert images_agree((span_x,), (span_y,), span_x.start + 2, 100) == span_x.start + 2


def test_an_image_that_does_not_fit_the_step_waits_for_the_next():
    budget = PrefillBudget(64, 0.5)
    budget.observe(1, 0.01, 100, 0.1)
    budget.observe(0, 0.0, 0, 0.0, num_encoded=10, encode_s=0.02)  # 2 ms/token vs 1 ms
    assert budget.encode_tokens(10) == 20
    req = Request("r", tuple(range(200)), 4, SamplingParams(), frozenset(), "interactive", 0.0,
                  images=(ImageSpan(X, 50, 10),))
    assert cut_before_images(req, 0, 64, 64, budget) == (50, 0)  # 50 + 20 > 64: later
    assert cut_before_images(req, 0, 64, 80, budget) == (64, 20)  # fits: counted
    assert cut_before_images(req, 50, 64, 8, budget) == (64, 20)  # starts the chunk: now
    budget.credit = 8.0
    budget.spend(14 + 20)
    assert budget.credit < 0  # a debt the next steps pay before prefilling again
    assert budget.grant(1) == 0


def test_an_encoding_dearer_than_a_step_waits_until_the_budget_has_saved_it():
    """While a stream decodes, an image that costs more than a step's chunk is encoded only
    once decode-only steps have saved its cost: the neighbour's stall comes after its share of
    the time, never before it (a window ending right after an encoding stays at pace)."""
    budget = PrefillBudget(64, 0.5)
    budget.observe(1, 0.01, 100, 0.1)  # allowance: 0.85 * 10 ms of 1 ms tokens, 8.5 a step
    budget.observe(0, 0.0, 0, 0.0, num_encoded=100, encode_s=0.2)  # 2 ms/token: 200 tokens
    req = Request("r", tuple(range(300)), 4, SamplingParams(), frozenset(), "interactive", 0.0,
                  images=(ImageSpan(X, 0, 100),))
    steps = 0
    while True:
        steps += 1
        room = budget.grant(1)
        end, cost = cut_before_images(req, 0, 64, room, budget)
        if end > 0:
            break
        assert room <= 64  # a saving bucket never grants a chunk beyond the step's
        assert steps < 100
    assert cost == 200 and steps == 32  # (200 + 64) / 8.5 steps of saving, then the chunk
    budget.spend(64 + cost)
    assert budget.credit >= 0  # nothing owed after it: the stall was paid for before
    # With nothing decoding there is nothing to protect: at once, and the bucket takes it.
    fresh = PrefillBudget(64, 0.5)
    fresh.observe(1, 0.01, 100, 0.1)
    fresh.observe(0, 0.0, 0, 0.0, num_encoded=100, encode_s=0.2)
    assert cut_before_images(req, 0, 64, fresh.grant(0), fresh) == (64, 200)


class RefusingWorker(Group):
    """A worker whose image processor refuses every image: chunks that carry files fail."""

    def _worker(self, plan):
        from switchyard.proto.scheduler_worker import SlotFailure, StepDone

        bad = [c for c in plan.prefills if c.image_data]
        if not bad:
            return super()._worker(plan)
        kept = plan.__class__(plan.step, tuple(c for c in plan.prefills if not c.image_data),
                              plan.decodes, plan.stages, plan.copies, plan.loads,
                              plan.num_decode_steps)
        done = super()._worker(kept)
        return StepDone(done.step, done.sampled, 0, done.num_decode_tokens, 0.0,
                        failed=tuple(SlotFailure(c.slot, "invalid_image", "refused")
                                     for c in bad))


def test_an_image_the_worker_refuses_fails_its_request_only():
    from switchyard.proto.gateway_scheduler import RequestFailed

    g = RefusingWorker(num_slots=2)
    prompt, span = with_image(conv(6, 3 * P), 5, 8, X)
    submit(g, "img", prompt, (span,))
    submit(g, "text", conv(7, 2 * P))
    g.run()
    failed = [m for m in g.msgs if isinstance(m, RequestFailed)]
    assert [(m.rid, m.code) for m in failed] == [("img", "invalid_image")]
    assert "img" not in g.core.requests
    assert g.finished("text").finish_reason == "length"
    # The failed chunk left its slot as it was: the next request there is served normally.
    submit(g, "after", conv(8, 2 * P))
    g.run()
    assert g.finished("after").finish_reason == "length"
