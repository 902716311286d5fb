"""The worker process: loads the model, owns slot KV memory, executes step plans.

It chooses nothing. It answers the scheduler's `RunStep` with `StepDone`, says `Hello` and
`WorkerReady` (with what its slots hold) whenever it meets a scheduler incarnation it has not
greeted yet, and sends heartbeats while idle.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.common.hostfile import Hostfile, HostfileError, layout_tag, read_hostfile
from switchyard.proto.ids import new_boot_id
from switchyard.common.logs import configure_logging
from switchyard.proto.base import ROLE_WORKER
from switchyard.proto.scheduler_worker import (
    GrammarPrepared,
    PrepareGrammar,
    RankInfo,
    ReleaseGrammar,
    RunStep,
    SlotContents,
    WorkerMayStop,
    WorkerReady,
    WorkerStopping,
)
from switchyard.common.page_ids import kv_namespace as page_namespace
from switchyard.proto.service_loop import SchedulerLink, StopFlag
from switchyard.common.settings import Settings, parse_size
from switchyard.proto.shm import PageBufferPool, ShmError, record_segment, remove_stale_segments
from switchyard.worker.cache_kinds import leaves, verifiable, window_bytes
from switchyard.worker.constraints import ConstraintEngine, llguidance_tokenizer
from switchyard.worker.cpu_attention import use_cpu_attention
from switchyard.worker.cpu_weights import add_float_copies, copy_bytes, weight_bytes_read
from switchyard.worker.cpu_weights import wanted as float_copies_wanted
from switchyard.worker.executor import StepExecutor
from switchyard.worker.group import GroupError, GroupMismatch, RankGroup, resolve_backend
from switchyard.worker.group_loop import GroupLead, follow, gather_ranks, log_comm_probe, start_watchdog
from switchyard.worker.kv_layout import is_attention_kv, kv_quant
from switchyard.worker.page_io import PageLayout, PageLayoutError
from switchyard.worker.prefill_packing import context_per_weight_read
from switchyard.worker.memory_plan import (
    MemoryPlanError,
    check_plan,
    device_memory_limit,
    make_plan,
    resident_bytes,
    widest_running,
)
from switchyard.worker.draft_model import load_drafter
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.model_loading import LoadedModel, load_model
from switchyard.worker.mtp import MTPDrafter, mtp_drafter_for
from switchyard.worker.sharding import check_splittable, split
from switchyard.worker import state_marks
from switchyard.worker.slots import SlotStore, batchable
from switchyard.worker.vision.memory import vision_bytes

# Bumped whenever the meaning of a page's bytes changes; part of every page namespace.
KV_LAYOUT_VERSION = 1


def kv_namespace(loaded: LoadedModel, layout: PageLayout | None, page_size: int,
                 share: str = "") -> bytes:
    """Pages are only ever matched within one namespace: same weights, layout, quantization
    and format, and for a worker group's rank its share (`share`, e.g. "tp2r1")."""
    dtype = layout.dtype_name if layout else "none"
    return page_namespace(loaded.fingerprint, loaded.model_type, dtype, KV_LAYOUT_VERSION,
                          page_size, loaded.kv_quant.tag if loaded.kv_quant else "", share)


def kv_form(loaded: LoadedModel) -> str:
    """How slots hold attention KV, for logs: "none" (the model's dtype) or e.g. "q8g64"."""
    return loaded.kv_quant.tag if loaded.kv_quant else "none"


def probe_cache(loaded: LoadedModel) -> list:
    """A cache that has seen one token, so every layer's arrays exist and can be measured."""
    cache = loaded.make_cache()
    loaded.model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def check_kv_quant_runs(loaded: LoadedModel, settings: Settings) -> None:
    """Refuse --kv-bits for a model whose attention mlx-lm cannot run on quantized KV (gpt-oss:
    its attention sinks), with one clear line instead of a crash on the first request."""
    if not settings.kv_bits:
        return
    try:
        probe_cache(loaded)
    except ValueError as exc:
        raise ModelLoadError(f"--kv-bits {settings.kv_bits} cannot be used with this model "
                             f"({loaded.model_type}): {exc} Serve it without --kv-bits.") from exc


def page_layout(loaded: LoadedModel, settings: Settings, log) -> tuple[PageLayout | None, str]:
    """The page layout and the start-up line's word on paging ("on", or what is off and why:
    without pages a slot still reuses and copies its resident prefix)."""
    try:
        return PageLayout(probe_cache(loaded), settings.page_size), "on"
    except PageLayoutError as exc:
        log.warning("kv.paging_unsupported", reason=str(exc))
        return None, f"off: {exc}; resident prefixes are still reused"


def unpaged_bytes_per_token(loaded: LoadedModel, num_tokens: int = 256) -> int:
    """How much the cache kinds paging does not know grow per token (DeepSeek-V4.1's compressed
    groups, for one), measured between a 1-token and a (1 + num_tokens)-token forward pass."""
    sizes = []
    for n in (1, 1 + num_tokens):
        cache = loaded.make_cache()
        loaded.model(mx.array([[0] * n]), cache=cache)
        mx.eval([c.state for c in leaves(cache)])
        sizes.append(sum(getattr(c, "nbytes", 0) for c in leaves(cache) if not (
            is_attention_kv(c) or type(c) in (RotatingKVCache, ArraysCache))))
    return max(0, -(-(sizes[1] - sizes[0]) // num_tokens))


def speculation_mode(settings: Settings, verifiable: str, kinds: str, log) -> str:
    """What speculative decoding this worker does (docs/design/speculative-decoding.md "Speculative decoding"):
    "batched", "alone" or "" (off), with one line saying why when it is less than batched.
    `--speculative suffix`, `draft` or `mtp` on a model that cannot take rejected tokens back
    is refused.
    (A vision-language model verifies as its caches allow: a verify pass positions each row
    after its slot's images as a plain decode does, worker/vision/slots.py.)"""
    if settings.speculative == "off":
        return ""
    reason = (f"this model's layer caches ({kinds}) cannot take back rejected draft tokens "
              f"exactly")
    if not verifiable:
        if settings.speculative in ("suffix", "draft", "mtp"):
            raise ModelLoadError(f"--speculative {settings.speculative}: {reason}; serve it "
                                 f"with --speculative auto or off")
        log.warning("speculation.off", reason=reason)
    elif verifiable == "alone":
        log.info("speculation.alone", reason=f"sliding-window rings ({kinds}) are taken back "
                 f"for a lone decoding sequence only: steps that decode several sequences "
                 f"verify no drafts")
    return verifiable


def draft_cost(loaded: LoadedModel, draft: LoadedModel | None, drafter=None) -> float:
    """A draft pass's cost relative to a plain pass of the model, before any is measured: the
    share of the weights it reads (a decode pass reads every weight once; an MTP head's pass
    reads its own and the model's lm_head)."""
    weights = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    if isinstance(drafter, MTPDrafter):
        return min(1.0, drafter.pass_bytes / max(1, weights))
    if draft is None:
        return 0.0
    draft_weights = sum(v.nbytes for _, v in tree_flatten(draft.model.parameters()))
    return min(1.0, draft_weights / max(1, weights))


def draft_fields(draft: LoadedModel | None, drafter) -> dict:
    """The start-up line's word on the draft model (or the MTP head)."""
    if isinstance(drafter, MTPDrafter):
        return {"draft_model": "", "mtp_head_bytes": drafter.nbytes,
                "mtp_kv_bytes_per_token": drafter.kv_bytes_per_token()}
    if draft is None:
        return {"draft_model": ""}
    return {"draft_model": str(draft.path), "draft_model_type": draft.model_type,
            "draft_kv_bytes_per_token": draft.kv_bytes_per_token,
            "draft_catch_up_tokens": drafter.catch_up_tokens}


def cache_kinds(loaded: LoadedModel) -> str:
    """Layer cache kinds and counts, e.g. "KVCache x2, RotatingKVCache x2"."""
    names = [type(c).__name__ for c in leaves(loaded.make_cache())]
    return ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names)))


def buffer_count(layout: PageLayout | None, settings: Settings,
                 largest_buffer_bytes: int = 0) -> int:
    """Page buffers in the pool. A worker group's ranks all take the count of the rank with the
    largest buffers (`largest_buffer_bytes`), so one buffer index means the same page on all."""
    if layout is None:
        return 0
    return max(4, parse_size(settings.kv_buffer_memory)
               // max(layout.buffer_bytes, largest_buffer_bytes))


def plan_memory(loaded: LoadedModel, settings: Settings, layout: PageLayout | None,
                num_buffers: int | None = None, float_copies: int = 0,
                draft: LoadedModel | None = None, draft_copies: int = 0,
                mtp: MTPDrafter | None = None):
    """`float_copies`: bytes of the CPU's float32 copies of quantized matrices
    (worker/cpu_weights.py), counted with the weights; `draft`: a draft model (its weights,
    with `draft_copies`, and its KV per slot); `mtp`: an MTP head (its weights and its KV
    per slot)."""
    return make_plan(**plan_inputs(loaded, settings, layout, num_buffers, float_copies, draft,
                                   draft_copies, mtp), num_slots=settings.worker_slots)


def plan_inputs(loaded: LoadedModel, settings: Settings, layout: PageLayout | None,
                num_buffers: int | None = None, float_copies: int = 0,
                draft: LoadedModel | None = None, draft_copies: int = 0,
                mtp: MTPDrafter | None = None) -> dict:
    """What `make_plan` needs but the number of slots, measured once (it runs the model on a
    token to measure the per-slot state): `plan_memory`'s arguments."""
    cfg = loaded.config
    text_cfg = cfg.get("text_config", cfg)
    weights = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    # Recurrent states and sliding-window rings: fixed per slot, whatever --ctx is; twice
    # where a slot keeps them at its mark too (worker/state_marks.py: a ring as a prefill
    # chunk left it).
    probe = probe_cache(loaded)
    recurrent = sum(window_bytes(c, settings.prefill_chunk) if type(c) is RotatingKVCache
                    else c.nbytes for c in leaves(probe) if not is_attention_kv(c))
    recurrent *= 2 if state_marks.markable(probe) else 1
    if num_buffers is None:
        num_buffers = buffer_count(layout, settings)
    page_buffers = num_buffers * (layout.buffer_bytes if layout else 0)
    per_token = loaded.kv_bytes_per_token + (0 if layout else unpaged_bytes_per_token(loaded))
    return {
        "vision": vision_bytes(loaded, settings),
        # Measured after the model ran once, so the weights are resident: count them once.
        "runtime": max(0, resident_bytes() - weights), "weights": weights + float_copies,
        "kv_bytes_per_token": per_token,
        "recurrent_bytes_per_slot": recurrent, "ctx": settings.ctx,
        "prefill_chunk": settings.prefill_chunk,
        "num_heads": int(text_cfg.get("num_attention_heads", 1)),
        "hidden": int(text_cfg.get("hidden_size", 0)),
        "intermediate": int(text_cfg.get("intermediate_size", 0)),
        "vocab": int(text_cfg.get("vocab_size", 0)), "page_buffers": page_buffers,
        "limit": device_memory_limit(), "headroom": parse_size(settings.memory_headroom),
        "draft_weights": (sum(v.nbytes for _, v in tree_flatten(draft.model.parameters()))
                          + draft_copies) if draft is not None else mtp.nbytes if mtp else 0,
        "draft_kv_bytes_per_token": draft.kv_bytes_per_token if draft is not None
                                    else mtp.kv_bytes_per_token() if mtp else 0,
        "draft_batched": mtp is None,
        "kv_memory": parse_size(settings.kv_memory) if settings.kv_memory else 0}


def group_kv_budget(tokens: int, group: RankGroup | None) -> int:
    """The KV budget the scheduler keeps to, in tokens (0: not counted): a worker group's
    ranks each hold their share of every token, so the rank with the fewest tokens' room
    bounds the group."""
    if group is None:
        return tokens
    # all_max of the negated budgets is the smallest; a rank that does not count (0)
    # bounds nothing.
    smallest = -group.all_max(-(tokens or 2**62))
    return 0 if smallest >= 2**62 else smallest


def make_store(loaded: LoadedModel, settings: Settings, log) -> SlotStore:
    """The slots; a vision-language model's also hold their images (worker/vision/slots.py)."""
    if loaded.processor is None:
        return SlotStore(loaded.model, loaded.make_cache, settings.worker_slots, settings.ctx)
    from switchyard.worker.vision.encoder import ImageEncoder
    from switchyard.worker.vision.slots import VisionSlotStore

    encoder = ImageEncoder(loaded.model.family, loaded.processor,
                           parse_size(settings.vision_cache), log)
    return VisionSlotStore(loaded.model, loaded.make_cache, settings.worker_slots, settings.ctx,
                           encoder)


def _join(settings: Settings, hostfile: Hostfile, endpoints: Endpoints, log, joined: list):
    """The `prepare` hook of load_model for a rank: refuse a model mlx-lm cannot split (before
    joining, so every rank refuses alike), join the group, keep this rank's share."""
    def prepare(model, config) -> None:
        check_splittable(model, config, settings.parallel, hostfile.size)
        backend = resolve_backend(settings.backend, hostfile)
        log.info("worker.group_joining", rank=settings.rank, size=hostfile.size,
                 backend=backend, parallel=settings.parallel)
        group = RankGroup.join(hostfile, settings.rank, backend, settings.parallel,
                               settings.dist_port, endpoints.runtime_dir)
        split(model, group.group, settings.parallel)
        joined.append(group)
    return prepare


def _shm_names(endpoints: Endpoints, group: RankGroup | None) -> tuple[str, Path]:
    """The pool's name prefix and record file: a group's ranks share one runtime dir on one
    machine, so each rank's names carry its rank and it only removes its own stale segments."""
    if group is None:
        return f"{endpoints.shm_prefix}w", endpoints.shm_record
    record = endpoints.shm_record
    if group.rank:
        record = record.with_name(f"worker.{group.rank}.shm")
    return f"{endpoints.shm_prefix}r{group.rank}w", record


def run(settings: Settings) -> None:
    boot_id = new_boot_id()
    log = configure_logging(ROLE_WORKER, boot_id, settings.log_level, settings.log_format,
                            settings.log_content)
    started = time.perf_counter()
    endpoints = Endpoints(ensure_runtime_dir(settings.runtime_path))
    joined: list[RankGroup] = []
    try:
        hostfile = read_hostfile(settings.hostfile) if settings.hostfile else None
        if hostfile is not None:
            log = log.bind(rank=settings.rank)
        prepare = _join(settings, hostfile, endpoints, log, joined) if hostfile else None
        loaded = load_model(settings.model, kv_quant(settings.kv_bits, settings.kv_group_size),
                            prepare=prepare)
        group = joined[0] if joined else None
        if group is not None:  # every rank must hold the same slots, or steps would diverge
            group.check_same({"model": loaded.fingerprint, "--parallel": settings.parallel,
                              "--slots": settings.worker_slots, "--ctx": settings.ctx,
                              "--page-size": settings.page_size, "--kv-bits": settings.kv_bits,
                              "--kv-group-size": settings.kv_group_size})
        check_kv_quant_runs(loaded, settings)
        speculation = speculation_mode(settings, verifiable(loaded.make_cache()),
                                       cache_kinds(loaded), log)
        drafter, draft = (load_drafter(settings, loaded)
                          if settings.draft_model and speculation else (None, None))
        mtp = mtp_drafter_for(loaded, settings.speculative, group is not None, log) \
            if speculation and drafter is None else None
        drafter = drafter or mtp
        layout, paging = page_layout(loaded, settings, log)
        largest = group.all_max(layout.buffer_bytes if layout else 0) if group else 0
        num_buffers = buffer_count(layout, settings, largest)
        copies = copy_bytes(loaded.model) if float_copies_wanted() else 0
        draft_copies = copy_bytes(draft.model) if draft is not None and copies else 0
        plan = plan_memory(loaded, settings, layout, num_buffers, copies, draft, draft_copies,
                           mtp)
        if copies and not plan.fits:
            log.warning("worker.float_copies_skipped", bytes=copies,
                        reason="float32 copies of the quantized weights (CPU backend: its "
                               "quantized matmul is slow for more than one row) do not fit "
                               "the memory plan; forward passes use the quantized kernels")
            copies = draft_copies = 0
            plan = plan_memory(loaded, settings, layout, num_buffers, draft=draft, mtp=mtp)
        if settings.max_running == 0 and group is None and drafter is None and \
                batchable(loaded.make_cache()):
            # As many running requests as the KV budget holds at a planned size
            # (docs/design/scheduling.md "Running past the resident slots"); a drafter's slots and a
            # group's ranks keep --slots.
            inputs = plan_inputs(loaded, settings, layout, num_buffers, copies)
            widest = widest_running(lambda n: make_plan(**inputs, num_slots=n),
                                    settings.slots, settings.auto_running)
            settings = replace(settings, max_running=widest)
            plan = make_plan(**inputs, num_slots=widest)
        if copies:
            add_float_copies(loaded.model)
        if draft_copies:
            add_float_copies(draft.model)
        log.info("worker.memory_plan", kv_quant=kv_form(loaded), running=settings.worker_slots,
                 kv_bytes_per_token=plan.kv_bytes_per_token, ctx=settings.ctx,
                 **plan.as_fields())
        check_plan(plan, settings.slots, settings.ctx, settings.kv_bits, settings.max_running)
        pool = None
        if layout is not None:
            prefix, record = _shm_names(endpoints, group)
            stale = remove_stale_segments(prefix, record)
            if stale:
                log.warning("worker.stale_shm_removed", names=stale)
            pool = PageBufferPool.create(f"{prefix}{boot_id[:8]}", num_buffers,
                                         layout.buffer_bytes)
            record_segment(record, pool.name)
    except (ModelLoadError, MemoryPlanError, ShmError, HostfileError, GroupMismatch) as exc:
        log.error("worker.refused_to_start", reason=str(exc))
        print(f"switchyard worker: {exc}", file=sys.stderr)
        sys.exit(2)
    except GroupError as exc:  # a peer left while the group formed: the supervisor restarts
        log.error("worker.group_lost", reason=str(exc))
        sys.exit(1)
    store = make_store(loaded, settings, log)
    shared_pages = store.share_pages(settings.page_size)
    if mtp is not None:  # the store hands it every pass's final hidden states
        store.attach_mtp(mtp)
    constraints = ConstraintEngine(lambda: llguidance_tokenizer(str(loaded.path)))
    layout_tag_ = layout_tag(group.parallel, group.size, group.rank) if group else ""
    namespace = kv_namespace(loaded, layout, settings.page_size, layout_tag_)
    # A group's ranks already share the cores between them; one worker spreads its long
    # passes' attention over all of them (CPU backend only).
    attention_streams = use_cpu_attention(None if group is None else 1)
    log.info("worker.started", model=str(loaded.path), model_type=loaded.model_type,
             vision=loaded.processor is not None,
             slots=settings.worker_slots, ctx=settings.ctx, load_s=round(time.perf_counter() - started, 3),
             kv_bytes_per_token=loaded.kv_bytes_per_token, trimmable=store.trimmable,
             kv_quant=kv_form(loaded), cache_kinds=cache_kinds(loaded), paging=paging,
             shared_pages=shared_pages,
             speculation=speculation or "off", cpu_float_copies_bytes=copies,
             cpu_attention_streams=attention_streams, **draft_fields(draft, drafter))
    if group is None:
        executor = StepExecutor(store, layout, pool, constraints, drafter=drafter,
                                packed_prefill=settings.packed_prefill)
        ranks: tuple[RankInfo, ...] = ()
    else:
        # Constraints and logit_bias act on rank 0's logits alone: it samples for all. The
        # ranks must pack the same chunks (their passes meet in collectives): one figure for
        # the copy bound, the largest of theirs (docs/design/scheduling.md "Packed prefill").
        context = group.all_max(context_per_weight_read(weight_bytes_read(loaded.model),
                                                        loaded.kv_bytes_per_token))
        executor = StepExecutor(store, layout, pool, constraints if group.rank == 0 else None,
                                share_tokens=group.share_tokens,
                                packed_prefill=settings.packed_prefill, context_per_read=context)
        watch = start_watchdog(group, settings.group_timeout_s, log,
                               before_exit=pool.unlink if pool is not None else lambda: None)
        ranks = gather_ranks(group, namespace, pool, loaded, layout, watch)
        log_comm_probe(group, loaded, log, watch)
    kv_budget_tokens = group_kv_budget(plan.kv_budget_tokens, group)

    def ready() -> WorkerReady:
        return WorkerReady(
            boot_id=boot_id, namespace=namespace,
            model_type=loaded.model_type, num_slots=settings.worker_slots, ctx=settings.ctx,
            page_size=settings.page_size, kv_bytes_per_token=loaded.kv_bytes_per_token,
            trimmable=store.trimmable, state_marks=store.keeps_marks, shared_pages=shared_pages,
            speculation=speculation,
            drafter=drafter.kind if drafter is not None else "",
            draft_cost=draft_cost(loaded, draft, drafter),
            slots=tuple(SlotContents(i, t, store.slot_images(i))
                        for i, t in enumerate(store.contents())),
            shm_name=pool.name if pool else "", num_buffers=pool.num_buffers if pool else 0,
            buffer_bytes=pool.buffer_bytes if pool else 0,
            state_bytes=layout.state_bytes if layout else 0,
            ranks=ranks, parallel=group.parallel if group else "",
            kv_budget_tokens=kv_budget_tokens)

    stop = StopFlag()
    if group is not None:  # `kill -USR1` prints where a rank waits (a hung collective)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if group is not None and group.rank > 0:
            follow(group, executor, stop, log, watch)
        else:
            lead = GroupLead(group, executor, watch) if group is not None else None
            _serve(settings, boot_id, log, ready, executor, stop, lead)
    except RuntimeError as exc:
        if group is None:
            raise
        # A collective failed: a peer was lost. The supervisor restarts the whole group
        # (docs/design/worker-groups.md "Worker groups").
        log.error("worker.group_lost", reason=str(exc))
        sys.exit(1)
    finally:
        if pool is not None:
            pool.close()
            pool.unlink()
        log.info("worker.stopped")


GRAMMAR_POLL_S = 0.005  # how often the loop looks for a finished grammar while one compiles
# Written back (--kv-write-back), how long a stopping worker runs steps for its slots' pages
# to be written: within the supervisor's 10 s before SIGKILL (deploy/supervisor.py).
STOP_WRITE_S = 8.0


def _serve(settings: Settings, boot_id: str, log, ready, executor: StepExecutor,
           stop: StopFlag, lead: GroupLead | None) -> None:
    """The worker's loop, the one that talks to the scheduler: a single worker's, or rank 0's
    of a group, whose share of each step `lead` does (worker/group_loop.py)."""
    link = SchedulerLink(settings, ROLE_WORKER, boot_id, log, greeting=lambda: [ready()],
                         stop=stop)
    constraints = executor.constraints
    tick_s = lead.tick_s if lead is not None else settings.heartbeat_s
    next_tick = time.monotonic() + tick_s
    stop_by = None  # asked to stop, written back: when to go even if not all is written
    try:
        while True:
            if stop.requested and stop_by is None:
                if not settings.kv_write_back or link.scheduler_boot is None:
                    break
                # What only this memory holds is written first (the scheduler plans stages
                # alone, then says WorkerMayStop).
                link.send(WorkerStopping())
                link.ignore_stop()
                stop_by = time.monotonic() + STOP_WRITE_S
            if stop_by is not None and time.monotonic() >= stop_by:
                log.warning("worker.stopped_unwritten", waited_s=STOP_WRITE_S)
                break
            # While a grammar compiles (on its own thread), look for it often.
            busy = constraints is not None and constraints.busy
            message = link.receive(GRAMMAR_POLL_S if busy else tick_s)
            if isinstance(message, WorkerMayStop):
                break
            if constraints is not None:
                for rid, error, seconds in constraints.prepared():
                    link.send(GrammarPrepared(rid, error, seconds))
            if isinstance(message, PrepareGrammar) and constraints is not None:
                constraints.prepare(message.rid, message.grammar)
            elif isinstance(message, ReleaseGrammar) and constraints is not None:
                constraints.release(message.rid)
            elif isinstance(message, RunStep):
                cpu_started = time.process_time()  # all threads: the step's work on a busy machine
                done = lead.run(message) if lead is not None else executor.run(message)
                link.send(done)
                log.debug("step.done", step=message.step, num_decode=done.num_decode_tokens,
                          num_prefill=done.num_prefill_tokens,
                          num_chunks=len(message.prefills),
                          forward_passes=done.num_forward_passes,
                          prefill_passes=done.num_prefill_passes,
                          tokens_per_pass=done.tokens_per_pass,
                          num_loaded=sum(len(load.buffers) for load in message.loads),
                          load_ms=round(done.load_s * 1e3, 2),
                          step_ms=round(done.duration_s * 1e3, 2),
                          cpu_ms=round((time.process_time() - cpu_started) * 1e3, 2),
                          **(lead.step_fields() if lead is not None else {}))
            elif message is None and lead is not None and time.monotonic() >= next_tick:
                lead.idle()  # the idle tick; it also finds a lost rank while idle
                next_tick = time.monotonic() + tick_s
    finally:
        if constraints is not None:
            constraints.close()
        link.close()
        if lead is not None:
            lead.stop()
