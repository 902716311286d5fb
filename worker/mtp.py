"""Multi-token-prediction drafts (docs/design/speculative-decoding.md "Speculative decoding"): the MTP head a
checkpoint ships beside its main model (the `mtp.*` tensors of Qwen3.5 and Qwen3-Next, which
mlx-lm drops when it loads the main model), read by mlx-vlm's own MTP splitter and run by its
drafter class (mlx_vlm.speculative.drafters: qwen3_5_mtp).

The head predicts the token after next from a pair: the main model's final hidden state at a
position i and the embedding of the token at i + 1, (h_i, t_{i+1}) -> t_{i+2}, through an
attention layer of its own whose KV covers the pairs seen so far. Unlike a draft model's, its
state cannot be rebuilt from tokens: the slot store hands it the hidden states of every pass
of the main model (prefill chunks, decodes, the tokens a verify pass kept: `observe`), and a
slot can be drafted for once its state reaches the position before the input token. A draft
of k tokens is the input's pair, then k - 1 pairs chained on the head's own output (as
mlx-vlm's `draft_block` chains), each read greedily through the main model's lm_head; those
entries are taken back after the draft, so only pairs with the main model's own hidden
states stay in the head's KV. Drafts are a point mass, so the verifier stays exact
(common/speculation.py) for sampled requests too.

Nothing of it is paged: a slot restored from pages has pairs only from the restore point on
(the head attends to fewer positions, which costs acceptance, never exactness).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from switchyard.worker.drafters import DraftRow, draft_end
from switchyard.worker.errors import ModelLoadError

# Model types (mlx-lm's, of the main model) whose checkpoints may ship an MTP head that
# mlx-vlm's qwen3_5_mtp drafter class runs (its splitters for them build that class).
MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def mtp_tensor_names(path: Path) -> list[str]:
    """Names of the `mtp.*` tensors in a model directory's safetensors files (headers only)."""
    if not path.is_dir():
        return []
    names = []
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        names += [k for k in header if k.startswith("mtp.")]
    return names


def ships_mtp(path: Path, model_type: str) -> bool:
    """True when the checkpoint carries an MTP head this worker can run."""
    return model_type in MTP_MODEL_TYPES and bool(mtp_tensor_names(path))


def mtp_drafter_for(loaded, speculative: str, in_group: bool, log=None) -> MTPDrafter | None:
    """The MTP drafter `--speculative` allows: the checkpoint's head with `mtp`, refused in
    one line where it ships none or this worker cannot run it; with `auto`, the head where it
    ships one and the worker can run it (a line says why not otherwise); none for the rest."""
    if speculative not in ("mtp", "auto") or not ships_mtp(loaded.path, loaded.model_type):
        if speculative == "mtp":
            raise ModelLoadError(f"--speculative mtp: {loaded.path.name} ships no MTP heads; "
                                 f"serve it with --speculative auto, suffix or off")
        return None
    why = ""
    if loaded.processor is not None:
        why = ("it is served as a vision-language model, whose passes do not hand their "
               "hidden states to an MTP head yet")
    elif in_group:
        why = "MTP drafts run on a single worker, not in a worker group"
    if why and speculative == "mtp":
        raise ModelLoadError(f"--speculative mtp: {loaded.path.name}: {why}; serve it with "
                             f"--speculative auto, suffix or off")
    if why:
        if log is not None:
            log.info("speculation.mtp_unused", reason=why)
        return None
    return load_mtp_drafter(loaded.path, loaded.config, loaded.model)


def body_and_head(model: nn.Module):
    """The main model split at its final hidden state: (body(inputs, cache) -> normed hidden
    [B, L, H], head(hidden) -> logits), computing exactly what model(inputs, cache) does."""
    lm = getattr(model, "language_model", model)
    if getattr(lm, "sharding_group", None) is not None:
        raise ModelLoadError("--speculative mtp runs on one worker; serve it without --hostfile")
    head = lm.lm_head if hasattr(lm, "lm_head") else lm.model.embed_tokens.as_linear
    return lm.model, head


def load_mtp_drafter(path: Path, config: dict, model: nn.Module) -> MTPDrafter:
    """The checkpoint's MTP head, as mlx-vlm's splitter loads it in memory (its tensors
    selected, sanitized for the checkpoint's layout, quantized as the checkpoint says) into
    its drafter class, bound to the main model's embedding and lm_head (it has none of its
    own)."""
    try:
        from mlx_vlm.speculative.drafters.mtp_split import detect_mtp_splitter
    except ImportError as exc:
        from switchyard.worker.vision.model import INSTALL_HINT

        raise ModelLoadError(f"--speculative mtp runs the MTP head with mlx-vlm's class "
                             f"({exc.name} is missing): {INSTALL_HINT}") from None
    splitter = detect_mtp_splitter(path) if mtp_tensor_names(path) else None
    if splitter is None or splitter.output_model_type != "qwen3_5_mtp":
        raise ModelLoadError(f"{path} ships no MTP heads")
    try:
        head = splitter.load(path)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: its mtp.* tensors do not fit the MTP head: {exc}") from None
    if mx.default_device().type == mx.DeviceType.cpu:  # as worker/model_loading.py does
        head.set_dtype(mx.float32, lambda dtype: dtype in (mx.float16, mx.bfloat16))
    mx.eval(head.parameters())
    body, logits = body_and_head(model)
    return MTPDrafter(head, body.embed_tokens, logits)


@dataclass
class _Pairs:
    """One slot's MTP state: the head's KV over pairs with ids (the position of their hidden
    state) `ids`, and the hidden state of position `next_id` (None: not known)."""

    cache: list
    ids: list[int] = field(default_factory=list)
    next_id: int = -1
    pending: mx.array | None = None  # [1, 1, H]


class MTPDrafter:
    """worker/drafters.py's Drafter for an MTP head, fed by the slot store (`observe`)."""

    kind = "mtp"

    def __init__(self, head: nn.Module, embed: nn.Module, logits):
        self.head = head  # mlx-vlm's Qwen3_5MTPDraftModel
        self.embed = embed
        self.logits = logits  # the main model's lm_head
        self._slots: dict[int, _Pairs] = {}
        self._seconds = 0.0
        self._passes = 0

    @property
    def pass_bytes(self) -> int:
        """Bytes one draft pass reads: the head's weights and the model's lm_head."""
        head = getattr(self.logits, "__self__", self.logits)  # embed_tokens.as_linear
        return self.nbytes + sum(v.nbytes for _, v in tree_flatten(head.parameters()))

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.head.parameters()))

    def kv_bytes_per_token(self) -> int:
        """Bytes of the head's KV per pair (one per token of a slot)."""
        cache = self.head.make_cache()
        pairs = _Pairs(cache)
        hidden = mx.zeros((1, 1, self.head.fc.weight.shape[0]))
        self._forward(pairs, mx.array([[0]]), hidden, 0)
        mx.eval([c.state for c in cache])
        # per token of the keys and values (the cache allocates ahead in steps)
        return sum(a.nbytes // a.shape[2] for c in cache for a in (c.keys, c.values))

    # --- fed by the slot store ----------------------------------------------------------------

    def observe(self, slot: int, start: int, tokens: Sequence[int], hidden: mx.array) -> None:
        """The main model fed `tokens` at positions start.. and computed `hidden`
        [1, len(tokens), H] for them: feed the pairs that completes, keep the last hidden."""
        pairs = self._slots.get(slot)
        if pairs is None or pairs.next_id > start - 1:
            pairs = self._slots[slot] = _Pairs(self.head.make_cache())
        if pairs.pending is not None and pairs.next_id == start - 1:
            first = start - 1
            h = mx.concatenate([pairs.pending, hidden[:, :-1]], axis=1)
            toks = list(tokens)
        else:  # a gap (pages loaded, a cut): the pairs start here
            first = start
            h, toks = hidden[:, :-1], list(tokens[1:])
        if toks:
            self._forward(pairs, mx.array([toks]), h, first)
            pairs.ids += range(first, first + len(toks))
            mx.async_eval([c.state for c in pairs.cache])
        pairs.next_id = start + len(tokens) - 1
        pairs.pending = hidden[:, -1:]

    def _forward(self, pairs: _Pairs, tokens: mx.array, hidden: mx.array, first: int) -> mx.array:
        positions = mx.arange(first, first + tokens.shape[1], dtype=mx.int32)[None]
        # mlx-vlm's own forward of the block: norms of both inputs, fc, its layer(s), norm.
        return self.head._forward_hidden(self.embed(tokens), hidden, pairs.cache, positions)

    # --- the Drafter interface ----------------------------------------------------------------

    def ready(self, slot: int, num_tokens: int) -> bool:
        """The slot's state reaches the position before its input token (the last of its
        `num_tokens`), so it can be drafted for."""
        pairs = self._slots.get(slot)
        return pairs is not None and pairs.pending is not None and pairs.next_id == num_tokens - 2

    def catch_up(self, slot: int, tokens: Sequence[int]) -> bool:
        """An MTP head cannot catch up from tokens (it needs the main model's hidden states,
        which `observe` brings): cut what lies past them, say whether the row is drafted."""
        self.cut(slot, len(tokens) - 1)
        return self.ready(slot, len(tokens))

    def propose(self, rows: Sequence[DraftRow]) -> list[tuple[int, ...]]:
        """Each ready row's draft: its chain of head passes, built lazily for every row and
        evaluated together (the rows' head caches differ in length, so each row runs its own
        passes); the chained entries are taken back afterwards."""
        started = time.perf_counter()
        chains = []
        for row in rows:
            if row.max_tokens < 1 or not self.ready(row.slot, len(row.tokens)):
                chains.append(None)
                continue
            pairs = self._slots[row.slot]
            token, h, chain = mx.array([[row.tokens[-1]]]), pairs.pending, []
            for i in range(row.max_tokens):
                h = self._forward(pairs, token, h, pairs.next_id + i)
                token = mx.argmax(self.logits(h), axis=-1)
                chain.append(token)
            chains.append(mx.concatenate(chain, axis=1)[0])
        mx.eval([c for c in chains if c is not None])
        out = []
        for row, chain in zip(rows, chains):
            if chain is None:
                out.append(())
                continue
            for c in self._slots[row.slot].cache:  # only pairs of the model's own hidden
                c.trim(row.max_tokens)               # states stay
            draft = chain.tolist()
            out.append(tuple(draft[:draft_end(draft, row.stop_token_ids)]))
        # A "pass" drafts one token for every row (as a draft model's batched pass does):
        # the scheduler weighs a draft token's cost by it.
        self._passes += max((r.max_tokens for r, c in zip(rows, chains) if c is not None),
                            default=0)
        self._seconds += time.perf_counter() - started
        return out

    def cut(self, slot: int, length: int) -> None:
        """The slot holds only its first `length` tokens: drop pairs whose next token is
        past them (and the kept hidden state, if its position is)."""
        pairs = self._slots.get(slot)
        if pairs is None or pairs.next_id < length:
            return
        drop = sum(1 for i in pairs.ids if i >= length - 1)
        if drop == len(pairs.ids):
            del self._slots[slot]
            return
        for c in pairs.cache:
            c.trim(drop)
        del pairs.ids[len(pairs.ids) - drop:]
        pairs.next_id, pairs.pending = length - 1, None

    def cache_tokens(self, slot: int) -> int:
        """Pairs the slot's head KV holds."""
        pairs = self._slots.get(slot)
        return pairs.cache[0].offset if pairs is not None else 0

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def take_stats(self) -> tuple[float, int]:
        stats = (self._seconds, self._passes)
        self._seconds, self._passes = 0.0, 0
        return stats
