"""Run one turn against the scheduler and answer in one API's format, as a JSON body or SSE.

Shared by every endpoint that generates: the API module takes its `RequestContext` from the
HTTP request (context.py), parses its body, plans the turn (turn.py) and hands `respond` the
turn, the `SubmitRequest` and an `Output` (how that API shows events, results and errors). A streamed response keeps its status line back until the first
scheduler event (or the first keepalive), so failures that come at once (queue full, restart)
still get their own HTTP status.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog
from starlette.responses import JSONResponse, Response

from switchyard.gateway.context import Gateway, RequestContext, RequestRecord
from switchyard.gateway.errors import APIError
from switchyard.gateway.output.parser import Event
from switchyard.gateway.prompting.prompts import build_submit, chat_chars, check_chat_template
from switchyard.gateway.scheduler_client import RequestStream
from switchyard.gateway.streaming import (SSE_KEEPALIVE, ClientDisconnected, EventStreamResponse,
                               until_disconnect)
from switchyard.gateway.turn import ChatTurn, TurnPlan, TurnResult, TurnUpdate, plan_turn
from switchyard.gateway.vision.inputs import PromptImages
from switchyard.gateway.request.model import ChatRequest, TurnChoices
from switchyard.common.logs import content_allowed
from switchyard.proto.gateway_scheduler import SubmitRequest

log = structlog.get_logger()

STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed request", for the log only


class Turn(Protocol):
    result: TurnResult | None
    num_malformed: int
    num_repaired: int
    malformed_texts: list[str]

    def start_events(self) -> list[Event]: ...

    def on_event(self, event: Any) -> TurnUpdate: ...


class Output(Protocol):
    """How one API shows a turn."""

    keepalive: bytes

    def head(self) -> list[bytes]: ...

    def frames(self, events: list[Event]) -> list[bytes]: ...

    def tail(self, result: TurnResult) -> list[bytes]: ...

    def error_frames(self, error: APIError) -> list[bytes]: ...

    def body(self, result: TurnResult) -> dict[str, Any]: ...


async def prepare_images(gw: Gateway, chat: ChatRequest):
    """The request as its template takes it (each image a marker) and its images, decoded
    (gateway/vision/)."""
    if gw.images is None:
        return chat, None
    return await gw.images.prepare(chat)


async def plan_chat(ctx: RequestContext, chat: ChatRequest, choices: TurnChoices, *,
                    param: str = "messages", note_unseen: bool = False,
                    images: PromptImages | None = None) -> TurnPlan:
    """Render and tokenize a chat (plan_turn) on a tokenizer lane chosen by its whole size,
    after refusing one that cannot fit the context, abandoned if its client leaves. `chat` is
    as prepare_images leaves it (images as markers, expanded with `images` when rendered).
    `note_unseen`: find the messages whose reasoning the template did not render."""
    gw = ctx.gateway
    check_chat_template(gw.tokenizer)
    size, rendered_size = chat_chars(chat), chat_chars(chat, with_reasoning=False)
    gw.check_chat_fits(len(chat.messages), rendered_size, param)
    abandoned = threading.Event()
    options = ctx.render_options(choices.salt, images, note_unseen, abandoned)
    return await gw.run_tokenizer(plan_turn, gw.tokenizer, chat, options, gw.tool_syntax,
                                  gw.think, gw.script, size=size, receive=ctx.receive,
                                  abandoned=abandoned)


async def start_chat(ctx: RequestContext, chat: ChatRequest, *, rid: str,
                     id_prefix: str = "call_", param: str = "messages",
                     note_unseen: bool = False) -> tuple[ChatTurn, SubmitRequest]:
    """Render and plan a chat turn for any API; the caller answers with `respond`."""
    gw, record = ctx.gateway, ctx.record
    choices = ctx.decide(chat.options)
    chat, images = await prepare_images(gw, chat)
    plan = await plan_chat(ctx, chat, choices, param=param, note_unseen=note_unseen,
                           images=images)
    await gw.check_grammar(plan.constraint, ctx.receive)
    record.script_rule = plan.script_rule
    record.num_spliced_turns = plan.rendered.num_spliced or None
    record.num_spliced_tokens = plan.rendered.num_spliced_tokens or None
    spans, files = images.attach(plan.prompt_ids) if images is not None else ((), ())
    submit = build_submit(rid, plan.prompt_ids, chat.options, ctx=gw.settings.ctx,
                          default_max_tokens=gw.settings.default_max_tokens,
                          stop_token_ids=tuple(dict.fromkeys(gw.stop_token_ids
                                                             + plan.extra_stop_ids)),
                          choices=choices, param=param,
                          grammar=plan.constraint.grammar if plan.constraint else "",
                          grammar_trigger=plan.trigger_ids, vocab_size=len(gw.tokenizer),
                          images=spans, image_data=files)
    turn = ChatTurn(gw.tokenizer, plan, chat, skip_ids=gw.stop_token_ids + (gw.hidden_ids or ()),
                    show_special=gw.hidden_ids is not None, think=gw.think,
                    memory=gw.memory, id_prefix=id_prefix)
    return turn, submit


async def respond(ctx: RequestContext, turn: Turn, submit: SubmitRequest, output: Output, *,
                  stream: bool) -> Response:
    gw, record = ctx.gateway, ctx.record
    record.start(submit, stream=stream)
    events = gw.client.submit(submit)
    if stream:
        return await _start_stream(gw, record, events, turn, output)
    try:
        body = await until_disconnect(ctx.receive, _collect(record, events, turn, output))
    except ClientDisconnected:
        record.disconnected = True
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        events.close()
    return JSONResponse(body)


def _apply(update: TurnUpdate, turn: Turn, stream: RequestStream, record: RequestRecord) -> None:
    """Bookkeeping every update needs, streamed or not."""
    if update.cancel:
        stream.cancel()
    if update.has_text:
        record.first_text()
    if update.result is not None:
        record.finish(update.result.finish_reason, update.result.usage)
        record.num_tool_calls = len(update.result.tool_calls) or None
        if turn.num_malformed:
            record.num_malformed_tool_calls = turn.num_malformed
            content = {"texts": turn.malformed_texts} if content_allowed() else {}
            log.warning("tool_call.malformed", rid=stream.rid, num_malformed=turn.num_malformed,
                        **content)
        if turn.num_repaired:
            record.num_repaired_tool_calls = turn.num_repaired
            log.info("tool_call.repaired", rid=stream.rid, num_repaired=turn.num_repaired)
    if update.error is not None:
        record.fail(update.error)


async def _collect(record: RequestRecord, stream: RequestStream, turn: Turn,
                   output: Output) -> dict[str, Any]:
    while True:
        event = await stream.get()
        update = turn.on_event(event)
        _apply(update, turn, stream, record)
        if update.error is not None:
            raise update.error
        if update.result is not None:
            return output.body(update.result)


async def _start_stream(gw: Gateway, record: RequestRecord, stream: RequestStream, turn: Turn,
                        output: Output) -> Response:
    try:
        first = await stream.get(timeout=gw.keepalive_s)
    except BaseException:
        stream.close()
        raise
    updates = []
    if first is not None:
        update = turn.on_event(first)
        if update.error is not None:
            stream.close()
            record.fail(update.error)
            raise update.error
        updates.append(update)

    def on_close(disconnected: bool) -> None:
        record.disconnected = disconnected

    frames = _sse_frames(gw, record, stream, turn, output, updates)
    return EventStreamResponse(frames, on_close=on_close)


async def _sse_frames(gw: Gateway, record: RequestRecord, stream: RequestStream, turn: Turn,
                      output: Output, updates: list[TurnUpdate]) -> AsyncIterator[bytes]:
    try:
        for frame in output.head() + output.frames(turn.start_events()):
            yield frame
        while True:
            for update in updates:
                _apply(update, turn, stream, record)
                for frame in output.frames(update.events):
                    yield frame
                if update.error is not None:
                    for frame in output.error_frames(update.error):
                        yield frame
                    return
                if update.result is not None:
                    for frame in output.tail(update.result):
                        yield frame
                    return
            event = await stream.get(timeout=gw.keepalive_s)
            if event is None:
                updates = []
                yield getattr(output, "keepalive", SSE_KEEPALIVE)
            else:
                updates = [turn.on_event(event)]
    finally:
        stream.close()
