"""Grammar-constrained sampling (structured outputs): one llguidance matcher per constrained slot.

A request's constraint travels in its `SamplingParams` (`grammar`, an llguidance grammar the
gateway built and checked under a time bound; `grammar_trigger`, token ids after which it
applies). Compiling one is never a step's work: the scheduler sends `PrepareGrammar` when the
request arrives, the grammar is compiled here on a thread of its own (llguidance releases the
GIL while it compiles) and `GrammarPrepared` lets the scheduler place the request; the compiled
grammar is kept while a request of it lives (`ReleaseGrammar`), and a few more for reuse. A
step finds it compiled (a step that does not is logged, and compiles it then).

The worker keeps a matcher per slot and computes each row's allowed-token mask on the CPU while the
forward pass runs on MLX's stream, then masks the logits before sampling (docs/design/requests.md
"Structured outputs"). Nothing about a matcher is stored: it is rebuilt from the tokens the slot's
request generated so far, so constraints survive preemption, restores and worker restarts.

With a trigger (a tool-call marker, or the end of a reasoning block) the output is free until
the trigger's tokens appear; from the token after it the grammar is in force to the end. Once
the grammar is complete the matcher allows only end-of-sequence tokens, so the turn ends.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import structlog

from switchyard.common.grammar_limits import parser_limits
from switchyard.proto.values import SamplingParams

log = structlog.get_logger()

MAX_UNUSED_GRAMMARS = 64  # compiled grammars no live request holds, kept for reuse (LRU)


@dataclass
class SlotConstraint:
    grammar: str
    trigger: tuple[int, ...]
    generated: list[int] = field(default_factory=list)  # every token the request generated
    matcher: object | None = None  # None while waiting for the trigger


class ConstraintEngine:
    """Matchers for the constrained rows of a decode step. `tokenizer_loader` returns the
    llguidance tokenizer; it is called once, on the first constrained request."""

    def __init__(self, tokenizer_loader: Callable[[], tuple[object, list[int]]]):
        self._load_tokenizer = tokenizer_loader
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._eos: list[int] = []
        self._slots: dict[int, SlotConstraint] = {}
        # Compiled grammars (key -> fresh matcher): those of live requests, and the unused.
        self._compiled: dict[bytes, object] = {}
        self._holders: dict[bytes, set[str]] = {}  # key -> requests that hold it
        self._unused: OrderedDict[bytes, None] = OrderedDict()
        self._rids: dict[str, bytes] = {}  # request -> the key of its grammar
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling: dict[bytes, Future] = {}
        self._waiting: dict[str, bytes] = {}  # requests whose GrammarPrepared is not sent
        self._failed: dict[bytes, str] = {}  # key -> why it did not compile (while held)
        self._seconds: dict[bytes, float] = {}  # key -> compile time, until reported
        self.num_errors = 0
        self.num_compiled_in_step = 0

    # --- compiling, off the step loop ------------------------------------------------------

    def prepare(self, rid: str, grammar: str) -> None:
        """Hold `grammar` for request `rid`, compiling it on the grammar thread if it is new;
        `prepared()` says when it is done."""
        key = grammar_key(grammar)
        if self._rids.get(rid) == key:
            self._waiting[rid] = key  # asked again (a restarted scheduler): answer again
            return
        self.release(rid)
        self._rids[rid] = key
        self._holders.setdefault(key, set()).add(rid)
        self._unused.pop(key, None)
        self._waiting[rid] = key
        if key not in self._compiled and key not in self._compiling:
            self._compiling[key] = self._compiler.submit(self._compile, grammar)

    def release(self, rid: str) -> None:
        key = self._rids.pop(rid, None)
        self._waiting.pop(rid, None)
        if key is None:
            return
        holders = self._holders.get(key, set())
        holders.discard(rid)
        if not holders:
            self._holders.pop(key, None)
            self._failed.pop(key, None)
            if key in self._compiled:
                self._keep_unused(key)

    @property
    def busy(self) -> bool:
        """Whether a GrammarPrepared is still to come (the loop then polls `prepared` often)."""
        return bool(self._waiting)

    def prepared(self) -> list[tuple[str, str, float]]:
        """(rid, error, compile seconds) of the requests whose grammar is now compiled (error
        empty) or failed to compile."""
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
                template, error, seconds = future.result()
                self._seconds[key] = seconds
                if template is None:
                    self._failed[key] = error
                else:
                    self._compiled[key] = template
                    if key not in self._holders:
                        self._keep_unused(key)
        done = []
        for rid, key in list(self._waiting.items()):
            if key in self._compiling:
                continue
            error = "" if key in self._compiled else self._failed.get(key, "not compiled")
            done.append((rid, error, self._seconds.pop(key, 0.0)))
            del self._waiting[rid]
        return done

    def _keep_unused(self, key: bytes) -> None:
        self._unused[key] = None
        self._unused.move_to_end(key)
        while len(self._unused) > MAX_UNUSED_GRAMMARS:
            self._compiled.pop(self._unused.popitem(last=False)[0], None)

    def _compile(self, grammar: str) -> tuple[object | None, str, float]:
        started = time.perf_counter()
        try:
            template = self._build(grammar)
        except Exception as exc:  # the thread's boundary: report, never lose the request
            return None, f"{type(exc).__name__}: {exc}", time.perf_counter() - started
        if template.is_error():
            return None, template.get_error(), time.perf_counter() - started
        return template, "", time.perf_counter() - started

    def _build(self, grammar: str):
        import llguidance

        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer, self._eos = self._load_tokenizer()
        return llguidance.LLMatcher(self._tokenizer, grammar, limits=parser_limits(),
                                    log_level=0)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # --- state -----------------------------------------------------------------------------

    def sync(self, slot: int, params: SamplingParams, num_generated: int, last_token: int,
             history: Callable[[], list[int]]) -> bool:
        """Bring the slot's matcher to the request's generated tokens: `num_generated` of them,
        the last being `last_token`; `history()` lists them all (called only when the matcher
        must be rebuilt: a new request, a preemption, a restore or a worker restart).
        Returns whether the row is constrained at all."""
        if not params.grammar:
            self._slots.pop(slot, None)
            return False
        state = self._slots.get(slot)
        current = (state is not None and state.grammar == params.grammar
                   and state.trigger == params.grammar_trigger
                   and len(state.generated) == num_generated
                   and (num_generated == 0 or state.generated[-1] == last_token))
        if not current:
            state = SlotConstraint(params.grammar, params.grammar_trigger)
            if not state.trigger:
                state.matcher = self._new_matcher(state.grammar)
            self._slots[slot] = state
            for token in history():
                self._advance(state, token)
        return True

    def accept(self, slot: int, token: int) -> None:
        state = self._slots.get(slot)
        if state is not None:
            self._advance(state, token)

    def _advance(self, state: SlotConstraint, token: int) -> None:
        state.generated.append(token)
        if state.matcher is not None:
            if not state.matcher.consume_token(token):
                self.num_errors += 1
            return
        trigger = state.trigger
        if state.generated[-len(trigger):] == list(trigger):
            state.matcher = self._new_matcher(state.grammar)

    def _new_matcher(self, grammar: str):
        key = grammar_key(grammar)
        template = self._compiled.get(key)
        if template is None:  # never prepared (a scheduler of an older protocol?): compile
            self.num_compiled_in_step += 1
            log.warning("constraints.compiled_in_step", grammar_bytes=len(grammar))
            template = self._build(grammar)
            self._compiled[key] = template
            self._keep_unused(key)
        elif key in self._unused:
            self._unused.move_to_end(key)
        return template.deep_copy()

    # --- masks -----------------------------------------------------------------------------

    def draft_prefix(self, slot: int, draft: list[int]) -> int:
        """How many of `draft`'s tokens the grammar accepts in turn
        (docs/design/speculative-decoding.md "Speculative decoding": a draft is cut before the first
        one it rejects). Walked on a copy: the slot's matcher moves only with the tokens a step
        emits (`accept`)."""
        walk = self._walk(slot)
        if walk is None:
            return len(draft)
        for i, token in enumerate(draft):
            if walk.matcher is not None and walk.matcher.validate_tokens([token]) != 1:
                return i
            self._advance(walk, token)
        return len(draft)

    def draft_masks(self, slot: int, draft: list[int], vocab_size: int
                    ) -> list[np.ndarray | None]:
        """The row's mask at each of the len(draft) + 1 verify positions (the input token's,
        then each draft token's); None where it is unconstrained (before a trigger). The
        draft is normally one `draft_prefix` accepts whole."""
        walk = self._walk(slot)
        if walk is None:
            return [None] * (len(draft) + 1)
        masks: list[np.ndarray | None] = []
        for i in range(len(draft) + 1):
            mask = self._allowed(walk.matcher, vocab_size) if walk.matcher is not None else None
            masks.append(mask)
            if i == len(draft):
                break
            if mask is not None and not mask[draft[i]]:
                # Not cut (a worker group's rows): the mask rejects d_i, so nothing after it
                # is kept, whatever the positions past it are sampled under.
                return masks + [None] * (len(draft) - i)
            self._advance(walk, draft[i])
        return masks

    def _walk(self, slot: int) -> SlotConstraint | None:
        state = self._slots.get(slot)
        if state is None:
            return None
        return SlotConstraint(state.grammar, state.trigger, list(state.generated),
                              state.matcher.deep_copy() if state.matcher is not None else None)

    def masks(self, slots: list[int], vocab_size: int) -> np.ndarray | None:
        """[len(slots), vocab_size] booleans: True where a token is allowed; None when no
        row is constrained right now (the logits are used as they are)."""
        rows = []
        any_constrained = False
        for slot in slots:
            state = self._slots.get(slot)
            matcher = state.matcher if state is not None else None
            if matcher is None:
                rows.append(None)
                continue
            any_constrained = True
            rows.append(self._allowed(matcher, vocab_size))
        if not any_constrained:
            return None
        out = np.ones((len(slots), vocab_size), dtype=bool)
        for i, row in enumerate(rows):
            if row is not None:
                out[i] = row
        return out

    def _allowed(self, matcher, vocab_size: int) -> np.ndarray:
        if matcher.is_error():
            self.num_errors += 1
            allowed = np.zeros(vocab_size, dtype=bool)
            allowed[self._eos] = True  # a matcher in error ends the turn rather than run free
            return allowed
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if allowed.size >= vocab_size:
            return allowed[:vocab_size]
        # The model's embedding may be padded past the tokenizer's vocabulary: never allowed.
        return np.concatenate([allowed, np.zeros(vocab_size - allowed.size, dtype=bool)])


def grammar_key(grammar: str) -> bytes:
    return hashlib.blake2b(grammar.encode(), digest_size=16).digest()


def llguidance_tokenizer(model_ref: str) -> tuple[object, list[int]]:
    """The llguidance vocabulary of the model's tokenizer and its end-of-sequence ids (about a
    second; done once, on the first constrained request)."""
    import llguidance.hf

    from switchyard.common.tokenizer_loading import load_tokenizer

    wrapper = load_tokenizer(model_ref)
    eos = sorted(getattr(wrapper, "eos_token_ids", None) or [wrapper.eos_token_id])
    return llguidance.hf.from_tokenizer(wrapper._tokenizer, eos_token=eos), eos

