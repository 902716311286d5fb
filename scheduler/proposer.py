"""Draft proposals for speculative decoding, copied from text already seen
(docs/design/speculative-decoding.md "Speculative decoding"). Pure: no I/O, no MLX.

An agent's replies are largely copies: a file rewritten with one change, paths and identifiers
from the tool results above, the same JSON keys in every call, sub-agents repeating each
other's calls. So the proposer looks the last few tokens of a sequence up among recent text
and proposes what followed them there.

- **Where it looks**: the request's own context (the last `window` tokens of its prompt, and
  all it generated) and every other request's of the same cache salt (its tenant's, and its
  `cache_salt`: common/tenants.py), running or recently finished. Text of another salt is never
  copied: each n-gram is keyed with its sequence's salt, so a lookup finds only its own salt's
  entries (and a match is checked against the source's salt too). Each tenant (with several
  keys: SubmitRequest.tenant) has a table of its own with a hash key of its own
  (scheduler/ngram_table.py), so another tenant's text can neither displace its entries nor
  be found (docs/design/security.md "Tenants").
- **How**: a fixed-size hash table of n-grams per tenant (orders 8, 4 and 2): each entry names the
  sequence and position where that n-gram was last seen. Indexing a new token costs one hash
  per order; a prompt's window is indexed once, vectorized, when the request arrives. A lookup
  tries the longest order first and checks the tokens themselves (a hash collision is a miss),
  then extends the match backwards (at most MAX_MATCH tokens) to measure it. Per step the work
  is O(orders + draft), never O(context). Memory is bounded: the table, plus the windows of the
  most recent finished requests up to `keep_tokens`.
- **How much**: a step's verify pass has one width for all its rows (shorter rows are padded),
  chosen to maximize the tokens expected per unit of pass time: the sum over rows of
  E(k) = 1 + a + ... + a^k over 1 + c * rows * (width - 1), where a, the chance each next draft
  token is accepted, blends the match length (a longer match is likelier to go on) with the
  request's recent acceptance (their odds multiplied), and c, what a row's extra token costs
  relative to a plain pass, is measured from the steps themselves (a GPU verifies many rows
  for nearly the price of one; a CPU does not). A verify step also pays the round trip to the
  scheduler, which plain steps share over a decode burst: measured too, it counts against
  drafts where passes are short. Nothing is proposed where nothing matches or where no width
  pays (by `min_gain`): such a step costs what a plain decode costs.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from dataclasses import dataclass

import numpy as np

from switchyard.scheduler.ngram_table import DRAFT_PRIOR, NgramTable

ORDERS = (8, 4, 2)
MAX_MATCH = 32
_P = 1_000_003  # polynomial hash base (odd): tokens are small ints
_MASK = (1 << 64) - 1
_ORDER_SALT = 0x9E3779B97F4A7C15
_RELAX = 0.02  # per plain pass: how fast a row cost measured long ago returns to the prior
_EWMA = 0.15  # weight of each new draft-token outcome in a request's acceptance rate


@dataclass
class ProposerConfig:
    max_draft: int = 8
    table_bits: int = 20  # 1M entries of 16 bytes
    window: int = 8192  # prompt tokens indexed per request (its end)
    keep_tokens: int = 1 << 20  # tokens of finished requests kept to copy from
    # With several keys, each tenant's own table (4 MiB) and finished tokens kept.
    tenant_table_bits: int = 18
    tenant_keep_tokens: int = 1 << 18
    # One more token per row in a pass, relative to a plain decode pass: where measurements
    # start (`observe_cost` follows the machine: ~0.15 on a CPU, far less on a GPU).
    verify_cost: float = 0.1
    min_gain: float = 1.1  # expected tokens per pass cost a draft must reach
    # `--speculative suffix`: verify every whole proposal (up to max_draft), whatever a pass
    # costs and however often this request's drafts were rejected.
    always: bool = False
    # A draft model in the worker (WorkerReady.drafter; 0: none): what one of its batched
    # passes costs relative to a plain pass (a prior until measured: `observe_draft_cost`).
    draft_cost: float = 0.0
    # `--speculative draft`: every decoding row drafted by the draft model, max_draft tokens,
    # whatever it costs; copied drafts are not proposed.
    draft_only: bool = False


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]  # what followed the match, up to the limit asked
    acceptance: float  # the chance each next token is accepted


@dataclass
class _Source:
    tokens: list | array  # a running request's feed (grown in place) or a finished copy
    base: int = 0  # position of tokens[0] in the sequence
    acceptance: float = 0.6  # recent fraction of draft tokens accepted
    proposed: int = 0
    accepted: int = 0
    # The same for a draft model's drafts (its own kind of evidence); None: none yet, the
    # draft model's acceptance over all requests stands for it.
    draft_acceptance: float | None = None
    # Its cache salt's key (`salt_key`) and its table's hash key: it copies from, and to, that
    # salt only.
    salt: int = 0
    table: NgramTable | None = None  # its tenant's

    def get(self, pos: int) -> int | None:
        i = pos - self.base
        return self.tokens[i] if 0 <= i < len(self.tokens) else None


def salt_key(salt: bytes) -> int:
    """The 64-bit key an n-gram of a sequence of cache salt `salt` is hashed with (0:
    unsalted, the hashes of before)."""
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt, digest_size=8, person=b"sy-ngram-salt").digest(),
                          "little")


def _hash(tokens, order: int, salt: int = 0) -> int:
    h = 0
    for t in tokens:
        h = (h * _P + t + 1) & _MASK
    return h ^ ((order * _ORDER_SALT) & _MASK) ^ salt


def _hashes(tokens: np.ndarray, order: int, salt: int = 0) -> np.ndarray:
    """The hash of every n-gram of `order` in `tokens` (uint64), by n-gram end."""
    n = len(tokens) - order + 1
    h = np.zeros(n, dtype=np.uint64)
    for j in range(order):
        h = h * np.uint64(_P) + tokens[j:j + n].astype(np.uint64) + np.uint64(1)
    return h ^ np.uint64((order * _ORDER_SALT) & _MASK) ^ np.uint64(salt)


class Proposer:
    def __init__(self, config: ProposerConfig | None = None):
        self.config = config or ProposerConfig()
        self._tables: dict[str, NgramTable] = {}  # by tenant ("": one key, or none)
        self._sources: dict[int, _Source] = {}
        self._indexed: dict[int, int] = {}  # source id -> tokens whose n-grams are in
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self._pass_s: dict[int, float] = {}  # plain decode pass time, by batch size
        self._row_s: float | None = None  # what a row beyond the first costs a pass
        self._trip_s: float | None = None  # a step's round trip outside the worker
        # The draft model: a pass's cost relative to a plain pass of the same batch (its
        # drafts' acceptance, a new request's prior, is each tenant's: NgramTable).
        self._draft_cost = self.config.draft_cost

    def table(self, tenant: str = "") -> NgramTable:
        """The tenant's table, made at its first request: the single tenant's as it always
        was, another's smaller, with a random hash key."""
        table = self._tables.get(tenant)
        if table is None:
            cfg = self.config
            table = self._tables[tenant] = (
                NgramTable(cfg.table_bits, cfg.keep_tokens) if not tenant else
                NgramTable(cfg.tenant_table_bits, cfg.tenant_keep_tokens, secrets.randbits(64)))
        return table

    # --- sequences -------------------------------------------------------------------------

    def start(self, rid: str, feed: list[int], salt: bytes = b"", tenant: str = "") -> None:
        """A request arrives: index the end of its context. `feed` is its token list, which
        the caller grows in place; `extend` indexes what was added. `salt`: its cache salt
        (SubmitRequest.cache_salt): drafts are copied only between sequences of one salt;
        `tenant` (SubmitRequest.tenant): whose table its n-grams go in."""
        sid = self._next_id
        self._next_id += 1
        self._ids[rid] = sid
        start = max(0, len(feed) - self.config.window)
        table = self.table(tenant)
        self._sources[sid] = _Source(feed, 0, salt=salt_key(salt) ^ table.hash_key, table=table)
        self._indexed[sid] = start
        self._index_range(sid, feed, start, len(feed))

    def extend(self, rid: str) -> None:
        """Index the tokens the request's feed gained since the last call."""
        sid = self._ids.get(rid)
        if sid is None:
            return
        feed = self._sources[sid].tokens
        self._index_range(sid, feed, self._indexed[sid], len(feed))

    def finish(self, rid: str) -> None:
        """The request ended: keep its window to copy from (bounded by `keep_tokens`)."""
        sid = self._ids.pop(rid, None)
        if sid is None:
            return
        source = self._sources[sid]
        base = max(0, len(source.tokens) - self.config.window - 2 * MAX_MATCH)
        source.tokens = array("i", source.tokens[base:])
        source.base = base
        del self._indexed[sid]  # nothing more to index
        for old in source.table.keep(sid, len(source.tokens)):
            del self._sources[old]

    def _index_range(self, sid: int, tokens, begin: int, end: int) -> None:
        """Index the n-grams ending at positions p in [begin - 1, end - 2] (whose next token,
        what a proposal copies, exists), for n-grams starting at or after the window."""
        first = max(0, begin - 1)
        last = end - 2
        self._indexed[sid] = max(self._indexed[sid], end)
        salt = self._sources[sid].salt
        table = self._sources[sid].table
        if last < first:
            return
        if last - first > 64:  # a prompt: vectorized
            lo = max(0, first - ORDERS[0] + 1)
            chunk = np.asarray(tokens[lo:last + 1], dtype=np.int64)
            for order in ORDERS:
                if len(chunk) < order:
                    continue
                h = _hashes(chunk, order, salt)
                ends = np.arange(lo + order - 1, last + 1)
                keep = ends >= first
                table.put_many(h[keep], sid, ends[keep])
            return
        for p in range(first, last + 1):
            for order in ORDERS:
                if p - order + 1 < 0:
                    continue
                table.put(_hash(tokens[p - order + 1:p + 1], order, salt), sid, p)

    # --- proposals -------------------------------------------------------------------------

    def propose(self, rid: str, limit: int) -> Proposal | None:
        """What could follow the request's last token: at most `limit` tokens copied from
        where its last tokens were seen, and the chance that each is accepted; None when
        nothing matches. `width` then says how much of it the step verifies."""
        sid = self._ids.get(rid)
        limit = min(limit, self.config.max_draft)
        if sid is None or limit <= 0:
            return None
        me = self._sources[sid]
        feed = me.tokens
        n = len(feed)
        for order in ORDERS:
            if n < order:
                continue
            suffix = feed[n - order:]
            found = me.table.get(_hash(suffix, order, me.salt))
            if found is None:
                continue
            source, pos = self._sources.get(found[0]), found[1]
            if (source is None or source.table is not me.table or source.salt != me.salt
                    or any(source.get(pos - order + 1 + j) != suffix[j] for j in range(order))):
                continue  # evicted, or a hash collision
            matched = order
            while matched < MAX_MATCH and n - matched - 1 >= 0:
                t = source.get(pos - matched)
                if t is None or t != feed[n - matched - 1]:
                    break
                matched += 1
            tokens = []
            for j in range(1, limit + 1):
                t = source.get(pos + j)
                if t is None:
                    break
                tokens.append(t)
            if not tokens:
                return None
            return Proposal(tuple(tokens), self._acceptance(me, matched))
        return None

    @staticmethod
    def _acceptance(me: _Source, matched: int) -> float:
        """The chance each next draft token is accepted. Two pieces of evidence, their odds
        multiplied: a longer match is likelier to go on, and a request whose drafts were
        accepted lately is likelier to accept this one."""
        prior = matched / (matched + 3.0)
        recent = min(0.99, max(0.01, me.acceptance))
        odds = prior / (1 - prior) * recent / (1 - recent)
        return min(0.98, odds / (1 + odds))

    def width(self, proposals: list[Proposal | None], burst: int = 1) -> int:
        """How many tokens per row the step's verify pass takes (1: no drafts). Every row of a
        pass is as wide as its widest (shorter ones are padded), so the width is chosen for
        the whole step: the one that maximizes the tokens expected per unit of time,
        sum over rows of 1 + a + ... + a^k (k: the row's draft, cut to width - 1) over
        1 + row_cost * rows * (width - 1) + trip; 1 unless that beats plain steps by
        `min_gain`. `trip` is the round trip to the scheduler per step, relative to a plain
        pass; a verify step pays it whole, while plain steps would run `burst` passes in the
        worker per trip (nothing else waiting), paying a share of it per pass."""
        batch = len(proposals)
        longest = max((len(p.tokens) for p in proposals if p is not None), default=0)
        if not longest or self.config.always:
            return longest + 1
        row_cost = self.row_cost(batch)
        trip = self.trip_cost(batch)
        plain_gain = batch / (1.0 + trip / max(1, burst))
        best, best_gain = 1, plain_gain
        expected = [1.0] * batch  # tokens each row yields at the width tried
        for w in range(2, longest + 2):
            for r, p in enumerate(proposals):
                if p is not None and len(p.tokens) >= w - 1:
                    expected[r] += p.acceptance ** (w - 1)
            gain = sum(expected) / (1.0 + row_cost * batch * (w - 1) + trip)
            if gain > best_gain:
                best, best_gain = w, gain
        return best if best_gain >= self.config.min_gain * plain_gain else 1

    def draft_plan(self, rids: list[str], proposals: list[Proposal | None],
                   limits: list[int], burst: int = 1) -> tuple[int, list[int]]:
        """A step with a draft model: its width (1: no drafts) and how many tokens each row
        asks the draft model for (0: none; the row verifies its copied proposal, if any).
        A row may use the draft model where it has no copied proposal at least as likely
        accepted as the draft model's draft (the request's own draft-model acceptance);
        `limits`: the draft tokens each row may take (0: none, e.g. it opted out).
        Width w and draft length k <= w - 1 maximize the tokens expected per unit of time
        as `width` does, the step's cost adding k draft passes: the sum over rows of
        1 + a + ... + a^n (n: the row's copied draft cut to w - 1, or k for a draft-model
        row) over 1 + row_cost * rows * (w - 1) + trip + draft_cost * k."""
        batch = len(rids)
        if self.config.draft_only:
            width = 1 + min(self.config.max_draft, max(limits, default=0))
            return width, [min(lim, width - 1) for lim in limits]
        drafted, rates = [], []
        for rid, p, lim in zip(rids, proposals, limits):
            a = self.draft_acceptance(rid)
            drafted.append(lim > 0 and (p is None or p.acceptance < a))
            rates.append(a)
        if not any(drafted):
            self._relax_draft_acceptance(rids)
            return self.width(proposals, burst), [0] * batch
        row_cost, trip = self.row_cost(batch), self.trip_cost(batch)
        plain_gain = batch / (1.0 + trip / max(1, burst))
        longest = min(self.config.max_draft, max(
            [len(p.tokens) for p, d in zip(proposals, drafted) if p is not None and not d]
            + [lim for lim, d in zip(limits, drafted) if d]))
        best, best_k, best_gain = 1, 0, plain_gain
        copied = [1.0] * batch  # tokens each copied-draft row yields at the width tried
        for w in range(2, longest + 2):
            for r, p in enumerate(proposals):
                if not drafted[r] and p is not None and len(p.tokens) >= w - 1:
                    copied[r] += p.acceptance ** (w - 1)
            base = 1.0 + row_cost * batch * (w - 1) + trip
            drafts = [1.0 if d else 0.0 for d in drafted]  # draft-model rows at k tried
            for k in range(0, w):
                if k:
                    for r in range(batch):
                        if drafted[r] and limits[r] >= k:
                            drafts[r] += rates[r] ** k
                expected = sum(c if not d else x for c, d, x in zip(copied, drafted, drafts))
                gain = expected / (base + self._draft_cost * k)
                if gain > best_gain:
                    best, best_k, best_gain = w, k, gain
        if best_gain < self.config.min_gain * plain_gain:
            best, best_k = 1, 0
        if not best_k:
            self._relax_draft_acceptance(rids)
        return best, [min(best_k, lim) if d else 0 for d, lim in zip(drafted, limits)]

    def _relax_draft_acceptance(self, rids: list[str]) -> None:
        """A step that asked the draft model for nothing measured nothing: its acceptance
        estimates drift back toward the prior, so a few rejected drafts (or a phase of text it
        drafts badly) do not turn it off for good; it is tried again after some steps. Each
        tenant's estimate moves with its own requests only."""
        mine = [self._sources[sid] for sid in map(self._ids.get, rids) if sid is not None]
        for table in {id(me.table): me.table for me in mine}.values():
            table.draft_acceptance += _RELAX * (DRAFT_PRIOR - table.draft_acceptance)
        for me in mine:
            if me.draft_acceptance is not None:
                me.draft_acceptance += _RELAX * (me.table.draft_acceptance - me.draft_acceptance)

    def draft_acceptance(self, rid: str) -> float:
        """The chance each next token of a draft-model draft is accepted for the request."""
        sid = self._ids.get(rid)
        me = self._sources[sid] if sid is not None else None
        own = me.draft_acceptance if me is not None else None
        prior = me.table.draft_acceptance if me is not None else DRAFT_PRIOR
        return min(0.98, max(0.01, own if own is not None else prior))

    def observe_draft(self, rid: str, num_proposed: int, num_accepted: int) -> None:
        """A verify pass kept `num_accepted` of the draft model's `num_proposed` tokens."""
        tallied = self._tally(rid, num_proposed, num_accepted)
        if tallied is None:
            return
        me, outcomes = tallied
        if me.draft_acceptance is None:
            me.draft_acceptance = me.table.draft_acceptance
        for x in outcomes:
            me.draft_acceptance += _EWMA * (x - me.draft_acceptance)
            me.table.draft_acceptance += _EWMA / 4 * (x - me.table.draft_acceptance)

    def observe_draft_cost(self, batch: int, draft_pass_s: float) -> None:
        """A step's draft passes took `draft_pass_s` each, for `batch` rows (moving average
        of the ratio to a plain pass of that batch; bounded as in `observe_cost`)."""
        plain = self._pass_s.get(batch) or self._pass_s.get(1)
        if not plain or draft_pass_s <= 0:
            return
        ratio = draft_pass_s / plain
        prior = self._draft_cost or ratio
        ratio = min(max(ratio, prior / 2), 2 * prior)
        self._draft_cost += _EWMA * (ratio - self._draft_cost) if self._draft_cost else ratio

    @property
    def draft_cost(self) -> float:
        return self._draft_cost

    def use_draft_model(self, cost: float) -> None:
        """The worker has a draft model; `cost` is its prior (WorkerReady.draft_cost), kept
        until a draft pass is measured."""
        self.config.draft_cost = cost
        if not self._draft_cost:
            self._draft_cost = cost

    # --- what a pass costs -----------------------------------------------------------------

    def row_cost(self, batch: int) -> float:
        """One more token per row's share of a pass, relative to a plain pass of `batch`
        rows (measured: `observe_cost`; `verify_cost` until then)."""
        plain = self._pass_s.get(batch) or self._pass_s.get(1)
        if self._row_s is None or not plain:
            return self.config.verify_cost
        return min(1.0, max(0.002, self._row_s / plain))

    def trip_cost(self, batch: int) -> float:
        """A step's time outside the worker's forward passes (messages, planning, streaming),
        relative to a plain pass of `batch` rows (measured: `observe_trip`; 0 until then)."""
        plain = self._pass_s.get(batch) or self._pass_s.get(1)
        if self._trip_s is None or not plain:
            return 0.0
        return self._trip_s / plain

    def observe_trip(self, seconds: float) -> None:
        """One decode step's cycle minus the worker's time for it (moving average; a
        measurement counts at most twice the estimate, as in `observe_cost`)."""
        seconds = max(0.0, seconds)
        if self._trip_s is None:
            self._trip_s = seconds
            return
        seconds = min(seconds, 2 * self._trip_s + 1e-3)
        self._trip_s += _EWMA * (seconds - self._trip_s)

    def observe_cost(self, batch: int, pass_s: float, width: int) -> None:
        """A decode step's time per pass: a plain pass (width 1) or a verify pass of `width`
        tokens per row. Plain passes are averaged per batch size, and what each padded or
        draft row beyond the first costs, in seconds (moving averages). A measurement counts
        at most twice (or half) the current estimate: one step timed while the machine was
        busy moves the estimate by at most 15%, a lasting change in a few steps."""
        if pass_s <= 0:
            return
        plain = self._pass_s.get(batch)
        if width <= 1:
            if plain is not None:
                pass_s = min(max(pass_s, plain / 2), plain * 2)
            self._pass_s[batch] = pass_s if plain is None else plain + _EWMA * (pass_s - plain)
            if self._row_s is not None:
                # No verify pass measures the row cost while none is run: it relaxes toward
                # the prior, so one noisy measurement (a busy machine) cannot turn drafts off
                # for good.
                prior = self.config.verify_cost * self._pass_s[batch]
                self._row_s += _RELAX * (prior - self._row_s)
            return
        if plain is None:
            return
        row_s = max(0.0, pass_s - plain) / (batch * (width - 1))
        bound = 2 * (self._row_s if self._row_s is not None else self.config.verify_cost * plain)
        row_s = min(row_s, bound)
        self._row_s = row_s if self._row_s is None else self._row_s + _EWMA * (row_s - self._row_s)

    def observe(self, rid: str, num_proposed: int, num_accepted: int) -> None:
        """A verify pass kept `num_accepted` of the `num_proposed` draft tokens: each token
        tried is an outcome (accepted ones, then the one rejected)."""
        tallied = self._tally(rid, num_proposed, num_accepted)
        if tallied is None:
            return
        me, outcomes = tallied
        for x in outcomes:
            me.acceptance += _EWMA * (x - me.acceptance)

    def _tally(self, rid: str, num_proposed: int, num_accepted: int
               ) -> tuple[_Source, list[float]] | None:
        """Count a verify pass's draft tokens for the request (whoever drafted them), and
        its outcomes, one per token tried: the accepted ones, then the one rejected. None
        when the request is unknown or nothing was proposed."""
        sid = self._ids.get(rid)
        if sid is None or not num_proposed:
            return None
        me = self._sources[sid]
        me.proposed += num_proposed
        me.accepted += num_accepted
        return me, [1.0] * num_accepted + ([0.0] if num_accepted < num_proposed else [])

    def counts(self, rid: str) -> tuple[int, int]:
        """Draft tokens proposed to and accepted by the request so far."""
        sid = self._ids.get(rid)
        if sid is None:
            return 0, 0
        me = self._sources[sid]
        return me.proposed, me.accepted
