"""The worker process: loads the model, owns slot KV memory, executes step plans.

It chooses nothing. It answers the scheduler's `RunStep` with `StepDone`, says `Hello` and
`WorkerReady` (with what its slots hold) whenever it meets a scheduler incarnation it has not
greeted yet, and sends heartbeats while idle.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from proto.endpoints import Endpoints, ensure_runtime_dir
from proto.ids import new_boot_id
from proto.logs import configure_logging
from proto.messages import ROLE_WORKER, RunStep, SlotContents, WorkerReady
from proto.page_ids import kv_namespace as page_namespace
from proto.service_loop import SchedulerLink, StopFlag
from proto.settings import Settings, parse_size
from proto.shm import PageBufferPool, ShmError, record_segment, remove_stale_segments
from worker.cache_kinds import leaves, window_bytes
from worker.constraints import ConstraintEngine, llguidance_tokenizer
from worker.executor import StepExecutor
from worker.kv_layout import is_attention_kv, kv_quant
from worker.page_io import PageLayout, PageLayoutError
from worker.memory_plan import (
    MemoryPlanError,
    check_plan,
    device_memory_limit,
    make_plan,
    resident_bytes,
)
from worker.model_loading import LoadedModel, ModelLoadError, load_model
from worker.slots import SlotStore

# Bumped whenever the meaning of a page's bytes changes; part of every page namespace (F12).
KV_LAYOUT_VERSION = 1


def kv_namespace(loaded: LoadedModel, layout: PageLayout | None, page_size: int) -> bytes:
    """Pages are only ever matched within one namespace: same weights, layout, quantization
    and format."""
    dtype = layout.dtype_name if layout else "none"
    return page_namespace(loaded.fingerprint, loaded.model_type, dtype, KV_LAYOUT_VERSION,
                          page_size, loaded.kv_quant.tag if loaded.kv_quant else "")


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


def cache_kinds(loaded: LoadedModel) -> str:
    """Layer cache kinds and counts, e.g. "KVCache x2, RotatingKVCache x2"."""
    names = [type(c).__name__ for c in leaves(loaded.make_cache())]
    return ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names)))


def buffer_count(layout: PageLayout | None, settings: Settings) -> int:
    if layout is None:
        return 0
    return max(4, parse_size(settings.kv_buffer_memory) // layout.buffer_bytes)


def plan_memory(loaded: LoadedModel, settings: Settings, layout: PageLayout | None):
    cfg = loaded.config
    text_cfg = cfg.get("text_config", cfg)
    weights = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    # Recurrent states and sliding-window rings: fixed per slot, whatever --ctx is.
    recurrent = sum(window_bytes(c, settings.prefill_chunk) if type(c) is RotatingKVCache
                    else c.nbytes for c in leaves(probe_cache(loaded)) if not is_attention_kv(c))
    page_buffers = buffer_count(layout, settings) * (layout.buffer_bytes if layout else 0)
    per_token = loaded.kv_bytes_per_token + (0 if layout else unpaged_bytes_per_token(loaded))
    plan = make_plan(
        # Measured after the model ran once, so the weights are resident: count them once.
        runtime=max(0, resident_bytes() - weights), weights=weights, kv_bytes_per_token=per_token,
        recurrent_bytes_per_slot=recurrent, num_slots=settings.slots, ctx=settings.ctx,
        prefill_chunk=settings.prefill_chunk,
        num_heads=int(text_cfg.get("num_attention_heads", 1)),
        hidden=int(text_cfg.get("hidden_size", 0)),
        intermediate=int(text_cfg.get("intermediate_size", 0)),
        vocab=int(text_cfg.get("vocab_size", 0)), page_buffers=page_buffers,
        limit=device_memory_limit(), headroom=parse_size(settings.memory_headroom))
    return plan


def run(settings: Settings) -> None:
    boot_id = new_boot_id()
    log = configure_logging(ROLE_WORKER, boot_id, settings.log_level, settings.log_format,
                            settings.log_content)
    started = time.perf_counter()
    endpoints = Endpoints(ensure_runtime_dir(settings.runtime_path))
    try:
        loaded = load_model(settings.model, kv_quant(settings.kv_bits, settings.kv_group_size))
        check_kv_quant_runs(loaded, settings)
        layout, paging = page_layout(loaded, settings, log)
        plan = plan_memory(loaded, settings, layout)
        log.info("worker.memory_plan", kv_quant=kv_form(loaded),
                 kv_bytes_per_token=loaded.kv_bytes_per_token, **plan.as_fields())
        check_plan(plan, settings.slots, settings.ctx, settings.kv_bits)
        pool = None
        if layout is not None:
            stale = remove_stale_segments(endpoints.shm_prefix, endpoints.shm_record)
            if stale:
                log.warning("worker.stale_shm_removed", names=stale)
            pool = PageBufferPool.create(f"{endpoints.shm_prefix}w{boot_id[:8]}",
                                         buffer_count(layout, settings), layout.buffer_bytes)
            record_segment(endpoints.shm_record, pool.name)
    except (ModelLoadError, MemoryPlanError, ShmError) as exc:
        log.error("worker.refused_to_start", reason=str(exc))
        print(f"switchyard worker: {exc}", file=sys.stderr)
        sys.exit(2)
    store = SlotStore(loaded.model, loaded.make_cache, settings.slots, settings.ctx)
    constraints = ConstraintEngine(lambda: llguidance_tokenizer(str(loaded.path)))
    executor = StepExecutor(store, layout, pool, constraints)
    log.info("worker.started", model=str(loaded.path), model_type=loaded.model_type,
             slots=settings.slots, ctx=settings.ctx, load_s=round(time.perf_counter() - started, 3),
             kv_bytes_per_token=loaded.kv_bytes_per_token, trimmable=store.trimmable,
             kv_quant=kv_form(loaded), cache_kinds=cache_kinds(loaded), paging=paging)

    def ready() -> WorkerReady:
        return WorkerReady(
            boot_id=boot_id, namespace=kv_namespace(loaded, layout, settings.page_size),
            model_type=loaded.model_type, num_slots=settings.slots, ctx=settings.ctx,
            page_size=settings.page_size, kv_bytes_per_token=loaded.kv_bytes_per_token,
            trimmable=store.trimmable,
            slots=tuple(SlotContents(i, t) for i, t in enumerate(store.contents())),
            shm_name=pool.name if pool else "", num_buffers=pool.num_buffers if pool else 0,
            buffer_bytes=pool.buffer_bytes if pool else 0,
            state_bytes=layout.state_bytes if layout else 0)

    stop = StopFlag()
    link = SchedulerLink(settings, ROLE_WORKER, boot_id, log, greeting=lambda: [ready()])
    try:
        while not stop.requested:
            message = link.receive(settings.heartbeat_s)
            if isinstance(message, RunStep):
                cpu_started = time.process_time()  # all threads: the step's work on a busy machine
                done = executor.run(message)
                link.send(done)
                log.debug("step.done", step=message.step, num_decode=done.num_decode_tokens,
                          num_prefill=done.num_prefill_tokens,
                          num_loaded=sum(len(load.buffers) for load in message.loads),
                          load_ms=round(done.load_s * 1e3, 2),
                          step_ms=round(done.duration_s * 1e3, 2),
                          cpu_ms=round((time.process_time() - cpu_started) * 1e3, 2))
    finally:
        link.close()
        if pool is not None:
            pool.close()
            pool.unlink()
        log.info("worker.stopped")
