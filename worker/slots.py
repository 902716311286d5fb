"""Slot KV memory: one mlx-lm prompt cache per slot, batched for decode on demand.

A slot's KV lives either in its own cache list ("parked") or, while several slots decode
together, as a row of one merged batch cache (attention KV: worker/batch_kv.py, whose rows each
have their own length, so a verify pass can keep a different number of tokens per row;
recurrent states and rings: mlx-lm's ArraysCache / BatchRotatingKVCache merge).
The batch is kept while its membership is unchanged and split back into parked caches when
it changes, so the copy cost is paid per join/leave, not per step. A lone decoding slot runs
on its parked cache directly: the same code path as mlx_lm.generate, hence the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache

from switchyard.proto.scheduler_worker import PrefillChunk
from switchyard.worker.batch_kv import BatchKV, BatchQuantizedKV
from switchyard.worker.cache_kinds import (
    before_verify,
    drops_last_token,
    leaves,
    packable,
    rewindable,
    undo_verify,
    verifiable,
)
from switchyard.worker.kv_layout import is_attention_kv, kv_bytes_per_token
from switchyard.worker import state_marks
from switchyard.worker.page_io import copy_prefix, write_back_row
from switchyard.worker.shared_pages import PagePool, SlotCaches, Shelved


# Junk columns a row of the decode batch may carry (rows that kept fewer verified tokens than
# the longest) before the batch is split and merged again.
_MAX_LAG = 256


class SlotError(RuntimeError):
    """A command inconsistent with the slot's contents: a scheduler bug, not bad input."""


class SlotStore:
    # Whether idle slots may hold their KV as pages shared between slots (a vision store's
    # images are not among its tokens, which key the pages: worker/shared_pages.py).
    shelves_pages = True

    def __init__(self, model: nn.Module, make_cache: Callable[[], list], num_slots: int,
                 ctx: int):
        self.model = model
        self._make_cache = make_cache
        self.ctx = ctx
        # A slot's own cache list, or its shared pages while shelved (`shelve`).
        self._parked = SlotCaches({i: make_cache() for i in range(num_slots)}, None)
        self._batch_slots: tuple[int, ...] = ()
        self._batch: list | None = None
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]
        # Recurrent states and sliding-window rings exist only at the slot's end: such a slot
        # is never cut back (mlx-lm's is_trimmable() is True for a ring that has not wrapped).
        self.trimmable = rewindable(self._parked[0])
        # Such a slot keeps its state where its last prefill or restore ended (its mark:
        # position, state layers), so it can be cut back, copied and staged there too
        # (worker/state_marks.py).
        self.keeps_marks = state_marks.markable(self._parked[0])
        self._marks: dict[int, tuple[int, list]] = {}
        self.drops_last_token = drops_last_token(self._parked[0])
        # Speculative decoding: "batched", "alone" (only a lone decoding sequence) or ""
        # (worker/cache_kinds.py `verifiable`).
        self.verifiable = verifiable(self._parked[0])
        self._before_verify: list | None = None
        # Multi-token prediction (worker/mtp.py): the model runs as body and head, and every
        # pass's final hidden states are handed to the drafter.
        self.mtp = None
        self._body = self._head = None
        self.last_hidden: mx.array | None = None
        self._verify_hidden: mx.array | None = None
        # Whether several slots' prefill chunks may run as rows of one forward pass
        # (`prefill_packed`; worker/cache_kinds.py `packable`).
        self.packs_prefill = packable(self._parked[0])
        # Forward passes of the model and the tokens they computed (padding not counted),
        # since the last `take_pass_stats`: the step log's passes and tokens per weight read.
        self._passes = 0
        self._pass_tokens = 0

    def share_pages(self, page_size: int) -> bool:
        """Let idle slots be shelved as shared pages of `page_size` tokens (`shelve`): their
        attention KV, where every other layer is a recurrent state or a ring (which stay as
        they are), and there are slots to share between.
        Returns whether it does (WorkerReady.shared_pages)."""
        layers = leaves(self._parked[0])
        if self.shelves_pages and self.num_slots > 1 and (self.trimmable or self.keeps_marks) \
                and any(is_attention_kv(c) for c in layers):
            self._parked.pool = PagePool(page_size)
        return self._parked.pool is not None

    def shelve(self, slot: int) -> None:
        """Hold the idle slot's KV as shared pages until it is used again; a read (a stage, a
        copy from it) leaves it shelved (docs/design/kv-pages.md "Shared pages in memory")."""
        if self._parked.pool is not None:
            self._unbatch_slot(slot)
            self._parked.shelve(slot, self.tokens[slot])

    def stage_source(self, slot: int):
        """What a stage reads the slot's pages from: its cache list, or its shelved pages."""
        self._unbatch_slot(slot)
        return self._parked.peek(slot)

    def attach_mtp(self, drafter) -> None:
        from switchyard.worker.mtp import body_and_head

        self.mtp = drafter
        self._body, self._head = body_and_head(self.model)

    def forward(self, inputs: mx.array, cache: list, num_tokens: int | None = None,
                **model_inputs) -> mx.array:
        """The model's logits for `inputs`; with an MTP drafter also its final hidden states
        (`last_hidden`), computed once for both. `num_tokens`: the real tokens among padded
        rows (all of `inputs` when None)."""
        self._passes += 1
        self._pass_tokens += inputs.size if num_tokens is None else num_tokens
        if self.mtp is None:
            return self.model(inputs, cache=cache, **model_inputs)
        self.last_hidden = self._body(inputs, cache=cache, **model_inputs)
        return self._head(self.last_hidden)

    def kv_bytes_per_token(self) -> int | None:
        """Bytes one token takes in a slot's attention layers; None until a parked slot has
        its attention arrays (they are sized by the model only once a token went in)."""
        for cache in self._parked.values():
            if isinstance(cache, Shelved):
                continue
            layers = [c for c in leaves(cache) if is_attention_kv(c)]
            if layers and all(c.keys is not None for c in layers):
                return kv_bytes_per_token(layers)
        return None

    def take_pass_stats(self) -> tuple[int, int]:
        """Forward passes and the tokens they computed since the last call."""
        stats = self._passes, self._pass_tokens
        self._passes = self._pass_tokens = 0
        return stats

    @property
    def num_slots(self) -> int:
        return len(self.tokens)

    # --- contents --------------------------------------------------------------------------

    def truncate(self, slot: int, length: int, state_follows: bool = False) -> None:
        """Make the slot hold exactly its first `length` tokens. `state_follows`: a load
        that brings the state comes next, so a hybrid slot may be cut anywhere (its
        attention KV only)."""
        held = len(self.tokens[slot])
        if length > held:
            raise SlotError(f"slot {slot} holds {held} tokens; cannot start at {length}")
        if length == held:
            return
        self._unbatch_slot(slot)
        mark = self._marks.get(slot)
        at_mark = mark is not None and mark[0] == length
        if length and not self.trimmable and not (at_mark or state_follows):
            raise SlotError(f"slot {slot}: recurrent state or window cannot be rewound to {length}")
        if self.mtp is not None:
            self.mtp.cut(slot, length)
        shelved = self._parked.is_shelved(slot)
        self._forget_mark_past(slot, length)
        if length == 0:
            self._parked[slot] = (self._make_cache() if shelved else
                                  _emptied(self._parked[slot], self._make_cache()))
        elif shelved:  # made whole holding only what stays
            cache = self._parked.whole(slot, length)
            if at_mark and not self.trimmable:
                state_marks.put(mark[1], cache)
        elif self.trimmable:
            for c in self._parked[slot]:
                c.trim(held - length)
        else:  # back to the mark, or to where the load that follows brings the state
            for c in leaves(self._parked[slot]):
                if is_attention_kv(c):
                    c.trim(held - length)
            if at_mark:
                state_marks.put(mark[1], self._parked[slot])
        del self.tokens[slot][length:]

    def _forget_mark_past(self, slot: int, length: int) -> None:
        """The slot's mark goes once its tokens are cut back below it."""
        if length < self._marks.get(slot, (0,))[0]:
            self._marks.pop(slot)

    def mark(self, slot: int) -> None:
        """Keep the slot's state at its end as its mark (after a prefill or a restore that
        loaded the state), replacing the one before."""
        if self.keeps_marks:
            self._marks[slot] = (len(self.tokens[slot]), state_marks.take(self.parked(slot)))

    def state_at(self, slot: int, end: int):
        """The slot's layers with the state they had after its first `end` tokens: its own
        at its end, the marked ones at its mark (a page staged after the slot moved on)."""
        self._unbatch_slot(slot)
        cache = self._parked.peek(slot)  # a shelved slot is read where it lies
        if end == len(self.tokens[slot]):
            return cache
        mark = self._marks.get(slot)
        if mark is None or mark[0] != end:
            raise SlotError(f"slot {slot} holds no state at token {end}")
        if isinstance(cache, Shelved):
            return dataclasses.replace(cache, shell=state_marks.with_state(cache.shell, mark[1]))
        return state_marks.with_state(cache, mark[1])

    def release(self, slot: int, keep: int = 0) -> None:
        """Drop the slot's KV and its memory (`truncate` to 0 keeps attention buffers for its
        next one) but its first `keep` tokens, shelved (RunStep.cuts; a state store's state
        is void there until a restore's last page brings it)."""
        self._unbatch_slot(slot)
        if keep and self._parked.pool is None:
            raise SlotError(f"slot {slot} cannot be cut to {keep} tokens here")
        if self.mtp is not None:
            self.mtp.cut(slot, keep)  # to 0: all of it
        if keep:
            self._parked.cut(slot, self.tokens[slot][:keep])
            del self.tokens[slot][keep:]
            self._forget_mark_past(slot, keep)
            return
        self._parked[slot] = self._make_cache()
        self._marks.pop(slot, None)
        self.tokens[slot] = []

    def cut_back(self, slot: int, length: int) -> None:
        """`truncate` for a slot that may be a row of the decode batch: where every layer of
        the batch cuts rows (attention KV), the row is cut there and the batch kept (a draft
        model's rejected tokens, every step); otherwise the slot is truncated."""
        held = len(self.tokens[slot])
        if length >= held:
            return
        batch = self._batch if slot in self._batch_slots else None
        if batch is None or not self.trimmable or \
                not all(hasattr(c, "trim_rows") for c in leaves(batch)):
            self.truncate(slot, length)
            return
        self._cut(batch, [held - length if s == slot else 0 for s in self._batch_slots])
        del self.tokens[slot][length:]
        if max(c.lag for c in leaves(batch)) > _MAX_LAG:
            self._unbatch()

    def prefill_chunk(self, chunk: PrefillChunk) -> None:
        """A step's prefill chunk (a vision store adds its images: worker/vision/slots.py)."""
        self.prefill(chunk.slot, chunk.start, list(chunk.token_ids))

    def prefill(self, slot: int, start: int, token_ids: list[int], **model_inputs) -> None:
        """`model_inputs`: more keyword inputs of the model (input embeddings, positions)."""
        self.truncate(slot, start)
        self._check_room(slot, len(token_ids))
        self._unbatch_slot(slot)
        cache = self._parked[slot]
        self.forward(mx.array(token_ids)[None], cache, **model_inputs)
        if self.mtp is not None:
            self.mtp.observe(slot, start, token_ids, self.last_hidden)
        # Evaluate the cache only: the chunk's logits are never needed, so the lazy graph
        # skips the lm_head for prefill.
        mx.eval([c.state for c in cache])
        self.tokens[slot].extend(token_ids)
        self.mark(slot)

    def prefill_packed(self, chunks: list[PrefillChunk]) -> None:
        """Several slots' chunks as rows of one forward pass: the weights are read once for
        all of them (docs/design/scheduling.md "Packed prefill"). The rows are right-padded to the
        longest; each row writes its tokens at its own end of a batch cache (worker/batch_kv.py:
        rows left-aligned, each with its own length), the padding is cut off every row, and
        only each row's new tokens (and a recurrent row's new state) go back into its slot's
        own cache (page_io.py `write_back_row`), so no padded position enters a slot's cache and the
        contexts are copied once, into the batch. A row's KV is its chunk's KV prefilled
        alone, to float rounding. The decode batch is left as it is unless it holds one of
        these slots."""
        slots = [c.slot for c in chunks]
        if len(set(slots)) != len(slots) or not self.packs_prefill:
            raise SlotError(f"slots {slots} cannot be prefilled as one pass")
        rows = [list(c.token_ids) for c in chunks]
        for chunk, row in zip(chunks, rows):
            self.truncate(chunk.slot, chunk.start)
            self._check_room(chunk.slot, len(row))
        batch = [_merged(list(layer)) for layer in zip(*(self.parked(s) for s in slots))]
        width = max(len(r) for r in rows)
        lengths = [len(r) for r in rows]
        self._forward(batch, [r + [r[-1]] * (width - len(r)) for r in rows], lengths)
        self._cut(batch, [width - n for n in lengths])
        for i, (chunk, row) in enumerate(zip(chunks, rows)):
            for own, merged in zip(leaves(self._parked[chunk.slot]), leaves(batch)):
                write_back_row(own, merged, i, chunk.start)
            if self.mtp is not None:
                self.mtp.observe(chunk.slot, chunk.start, row, self.last_hidden[i:i + 1, :len(row)])
            self.tokens[chunk.slot].extend(row)
        # The caches only: a prefill's logits are never needed (as in `prefill`).
        mx.eval([c.state for s in slots for c in leaves(self._parked[s])])
        for s in slots:
            self.mark(s)

    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> mx.array:
        """Append one token per slot and return the next-token logits, [len(slots), vocab]."""
        for slot, pos in zip(slots, positions):
            self.truncate(slot, pos)
            self._check_room(slot, 1)
        cache = self._cache_for(tuple(slots))
        logits = self.forward(mx.array(token_ids)[:, None], cache)[:, -1, :]
        for row, (slot, pos, tok) in enumerate(zip(slots, positions, token_ids)):
            self.tokens[slot].append(tok)
            if self.mtp is not None:
                self.mtp.observe(slot, pos, [tok], self.last_hidden[row:row + 1])
        return logits

    def decode_greedy(self, slots: list[int], first: mx.array, steps: int) -> mx.array:
        """`steps` batched single-token passes at the slots' ends, the first feeding `first`
        (one token per slot, possibly not computed yet) and each next one the previous pass's
        argmax, all queued before any token is read back (a draft model's drafts). Returns
        the argmaxes, [len(slots), steps]; the slots then hold `first` and all but the last."""
        for slot in slots:
            self._check_room(slot, steps)
        cache = self._cache_for(tuple(slots))
        y, out = first, []
        for _ in range(steps):
            y = mx.argmax(self.forward(y[:, None], cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
            out.append(y)
        drafted = mx.stack(out, axis=1)
        fed = mx.concatenate([first[:, None], drafted[:, :-1]], axis=1).tolist()
        for slot, tokens in zip(slots, fed):
            self.tokens[slot].extend(tokens)
        return drafted

    def verify(self, slots: list[int], positions: list[int], rows: list[list[int]]) -> mx.array:
        """Feed each slot its row (the input token, then its draft) at its position, all in
        one forward pass, and return the logits of every position, [len(slots), longest row,
        vocab]; shorter rows are padded (their padding's logits are junk). `keep` must follow,
        saying how much of each row the slots keep (docs/design/speculative-decoding.md "Speculative decoding")."""
        for slot, pos, row in zip(slots, positions, rows):
            self.truncate(slot, pos)
            self._check_room(slot, len(row))
        if len(slots) > 1 and self.verifiable != "batched":
            raise SlotError("this model's caches are verified one sequence at a time")
        cache = self._cache_for(tuple(slots))
        self._before_verify = before_verify(cache)
        width = max(len(r) for r in rows)
        padded = [list(r) + [r[-1]] * (width - len(r)) for r in rows]
        logits = self._forward(cache, padded, [len(r) for r in rows])
        self._verify_hidden = self.last_hidden
        return logits

    def _forward(self, cache: list, rows: list[list[int]], lengths: list[int]) -> mx.array:
        """A forward pass of right-padded rows. Recurrent layers of a batch are told each
        row's length (mlx-lm's ArraysCache `lengths`), so padding never enters a state."""
        states = [c for c in leaves(cache) if type(c) is ArraysCache] if len(rows) > 1 else []
        for c in states:
            c.lengths = mx.array(lengths)
        try:
            return self.forward(mx.array(rows), cache, sum(lengths))
        finally:
            for c in states:
                c.lengths = None

    def keep(self, slots: list[int], rows: list[list[int]], kept: list[int]) -> None:
        """After `verify`: slot i keeps the first kept[i] tokens of its row (its input and the
        accepted draft); the rest of the row, and the padding, are cut from its cache.
        Recurrent states and rings cannot be cut at a token: a row that rejected tokens gets
        them back as they were before the pass, and its kept tokens are fed again (their
        logits are not needed)."""
        width = max(len(r) for r in rows)
        cache = self._parked[slots[0]] if len(slots) == 1 else self._batch
        redo = [k < len(r) for k, r in zip(kept, rows)]
        saved, self._before_verify = self._before_verify, None
        if saved is not None and any(redo):
            undo_verify(cache, saved, redo,
                        [width if r else width - k for k, r in zip(kept, redo)])
            again = max(k for k, r in zip(kept, redo) if r)
            rows_again = [row[:k] + [row[0]] * (again - k) if r else [row[0]] * again
                          for row, k, r in zip(rows, kept, redo)]
            self._forward(cache, rows_again, [k if r else 0 for k, r in zip(kept, redo)])
            mx.eval([c.state for c in leaves(cache)])
            self._cut(cache, [again - k if r else again for k, r in zip(kept, redo)])
        else:
            self._cut(cache, [width - k for k in kept])
        hidden, self._verify_hidden = self._verify_hidden, None
        for r, (slot, row, k) in enumerate(zip(slots, rows, kept)):
            if self.mtp is not None:  # the kept tokens' hidden states, from the verify pass
                self.mtp.observe(slot, len(self.tokens[slot]), row[:k], hidden[r:r + 1, :k])
            self.tokens[slot].extend(row[:k])
        if len(slots) > 1 and max(getattr(c, "lag", 0) for c in leaves(self._batch)) > _MAX_LAG:
            # Rows that kept fewer tokens than others carry junk columns up to the longest
            # row; splitting the batch drops them (it is merged again at the next step).
            self._unbatch()

    @staticmethod
    def _cut(cache: list, counts: list[int]) -> None:
        """Cut each row's attention KV back by counts[row]."""
        for c in leaves(cache):
            if not is_attention_kv(c) and not hasattr(c, "trim_rows"):
                continue
            if hasattr(c, "trim_rows"):
                c.trim_rows(counts)
            elif counts[0]:
                c.trim(counts[0])

    def record(self, slot: int, token_ids: list[int], hidden: mx.array | None = None) -> None:
        """Note tokens a caller fed into the slot's parked cache itself (`forward`), with
        their final hidden states [1, len(token_ids), H] when there is an MTP drafter."""
        if self.mtp is not None and hidden is not None:
            self.mtp.observe(slot, len(self.tokens[slot]), token_ids, hidden)
        self.tokens[slot].extend(token_ids)

    def parked(self, slot: int) -> list:
        """The slot's own cache list (taken out of the decode batch if it is in it)."""
        self._unbatch_slot(slot)
        return self._parked[slot]

    def copy_prefix(self, src: int, dst: int, num_tokens: int,
                    state_follows: bool = False) -> None:
        """`dst` holds the first `num_tokens` of `src`; `state_follows`: CopyPrefix's."""
        if num_tokens > len(self.tokens[src]):
            raise SlotError(f"slot {src} holds {len(self.tokens[src])} tokens, not {num_tokens}")
        mark = self._marks.get(src)
        at_mark = mark is not None and mark[0] == num_tokens != len(self.tokens[src])
        if not (self.trimmable or state_follows or at_mark) \
                and num_tokens != len(self.tokens[src]):
            raise SlotError("recurrent state exists only at the end of a slot and at its mark")
        # A sibling decoding in the batch stays there: its row is copied out alone.
        source = (self._row_copy(self._batch_slots.index(src)) if src in self._batch_slots
                  else self._parked.peek(src))
        self._unbatch_slot(dst)
        if self.mtp is not None:  # the head's pairs of the source are not copied
            self.mtp.release(dst)
        self._parked[dst] = (source.copy(num_tokens, self._make_cache())
                             if isinstance(source, Shelved)  # it stays shelved
                             else copy_prefix(source, num_tokens, self._make_cache()))
        if at_mark:
            state_marks.put(mark[1], self._parked[dst])
        if mark is not None and mark[0] <= num_tokens:
            self._marks[dst] = mark  # never written into: shared
        else:
            self._marks.pop(dst, None)
        self.tokens[dst] = self.tokens[src][:num_tokens]

    def loaded(self, slot: int, start: int, token_ids: list[int], images=()) -> list:
        """Truncate to `start` (anywhere: a restore's last page brings the state, LoadPages)
        and return the cache to load pages into; records the tokens (and, in a vision store,
        the `images` among them)."""
        self.truncate(slot, start, state_follows=True)
        self._check_room(slot, len(token_ids))
        self.tokens[slot].extend(token_ids)
        return self.parked(slot)

    # --- batching --------------------------------------------------------------------------

    def _cache_for(self, slots: tuple[int, ...]) -> list:
        if len(slots) == 1:
            self._unbatch_slot(slots[0])
            return self._parked[slots[0]]
        if slots != self._batch_slots:
            if self._regroupable(slots):
                self._regroup(slots)
            else:
                self._unbatch()
                caches = [self._parked.pop(s) for s in slots]
                [self._batch] = _layer_by_layer(
                    len(caches[0]), lambda i: [_merged([c[i] for c in caches])], caches)
                self._batch_slots = slots
        return self._batch

    def _regroupable(self, slots: tuple[int, ...]) -> bool:
        """Whether the batch can become `slots` row by row (`BatchKV.regroup`): it shares
        rows with them and every layer is attention KV."""
        return (self._batch is not None and len(slots) > 1
                and not set(slots).isdisjoint(self._batch_slots)
                and all(isinstance(layer, BatchKV) for layer in self._batch))

    def _regroup(self, slots: tuple[int, ...]) -> None:
        """The batch of `slots`, in that order: rows leaving are taken out alone, rows joining
        come from their slots, and the rows that stay are not split and merged again."""
        old, batch = self._batch_slots, self._batch
        leaving = [row for row, slot in enumerate(old) if slot not in slots]
        joining = {s: self._parked.pop(s) for s in slots if s not in old}

        def layer(i: int) -> list:
            picks = [old.index(s) if s in old else joining[s][i] for s in slots]
            return [batch[i].regroup(picks)] + [batch[i].extract(row) for row in leaving]

        new, *left = _layer_by_layer(len(batch), layer, [batch, *joining.values()])
        for row, cache in zip(leaving, left):
            self._parked[old[row]] = cache
        self._batch, self._batch_slots = new, slots

    def _unbatch_slot(self, slot: int) -> None:
        """Take the slot out of the decode batch; the other rows stay batched."""
        if slot not in self._batch_slots:
            return
        rest = tuple(s for s in self._batch_slots if s != slot)
        if self._regroupable(rest):
            self._regroup(rest)
        else:
            self._unbatch()

    def _unbatch(self) -> None:
        if self._batch is None:
            return
        batch, slots = self._batch, self._batch_slots
        self._batch, self._batch_slots = None, ()
        caches = _layer_by_layer(len(batch), lambda i: [batch[i].extract(row)
                                                        for row in range(len(slots))], [batch])
        for slot, cache in zip(slots, caches):
            self._parked[slot] = cache

    def _row_copy(self, row: int) -> list:
        """A slot's own cache list holding a copy of the batch's row `row` (the batch stays)."""
        return [layer.extract(row) for layer in self._batch]

    def _check_room(self, slot: int, num_new: int) -> None:
        if len(self.tokens[slot]) + num_new > self.ctx:
            raise SlotError(f"slot {slot} would exceed the context of {self.ctx} tokens")

    def contents(self) -> list[tuple[int, ...]]:
        return [tuple(t) for t in self.tokens]

    def slot_images(self, slot: int) -> tuple:
        """The images among the slot's tokens (ImageSpan; a text model has none)."""
        return ()

    def take_encode_stats(self) -> tuple[float, int]:
        """Seconds the vision encoder ran and tokens it encoded since the last call."""
        return 0.0, 0


def _emptied(old: list, fresh: list) -> list:
    """A cache list holding no tokens. Attention KV layers keep their buffers: the slot's next
    conversation, or a restore, writes into memory the slot already has instead of faulting
    in new memory (docs/design/kv-pages.md "Restores"); every other kind starts fresh."""
    for c in old:
        if is_attention_kv(c):
            c.offset = 0
    return [o if is_attention_kv(o) else f for o, f in zip(old, fresh)]


def _layer_by_layer(num_layers: int, build: Callable[[int], list], olds: list[list]) -> list[list]:
    """Cache lists built layer by layer: `build(i)` gives layer i of each new list; it is
    evaluated and layer i of the `olds` (the cache lists it was made of) is dropped before
    the next, so that both forms of only one layer exist at a time. Built lazily all at once,
    mlx would hold every layer's old and new arrays together while it evaluates them, and a
    row taken out lazily kept the whole old batch alive until it was next used (the memory
    plan still counts both forms: docs/design/kv-pages.md "Memory plan")."""
    out: list[list] = []
    for i in range(num_layers):
        new = build(i)
        mx.eval([a for layer in new for a in _arrays(layer)])
        for old in olds:
            old[i] = None  # its arrays are freed here unless something else holds them
        out = out or [[] for _ in new]
        for cache, layer in zip(out, new):
            cache.append(layer)
    return out


def _arrays(layer) -> list[mx.array]:
    """The arrays a cache layer holds (of every member of a CacheList)."""
    return [a for c in leaves([layer]) for _, a in tree_flatten(vars(c))
            if isinstance(a, mx.array)]


def _merged(caches: list):
    """One batch cache of the slots' caches of one layer."""
    first = caches[0]
    if type(first) is KVCache:
        return BatchKV.merge(caches)
    if isinstance(first, QuantizedKVCache):
        return BatchQuantizedKV.merge(caches)
    if type(first) is CacheList:
        return CacheList(*(_merged([c.caches[i] for c in caches])
                           for i in range(len(first.caches))))
    if hasattr(first, "merge"):
        return type(first).merge(caches)
    return _not_batchable(first)


def batchable(cache: list) -> bool:
    """Whether several slots of this cache form can decode as one batch (`_merged`)."""
    return all(type(c) is KVCache or isinstance(c, QuantizedKVCache) or hasattr(c, "merge")
               for c in leaves(cache))


def _not_batchable(cache) -> None:
    raise SlotError(f"{type(cache).__name__} cannot be batched; run with --slots 1")
