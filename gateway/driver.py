"""Run one turn against the scheduler and answer in one API's format, as a JSON body or SSE.

Shared by every endpoint that generates: the API module takes its `RequestContext` from the
HTTP request (context.py), parses its body, plans the turn (`start_chat`) and hands `respond`
the turn, the `SubmitRequest` and an `Output` (how that API shows events, results and errors):
docs/design/requests.md "A request's way through the gateway".
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
                                          started, until_disconnect)
from switchyard.gateway.turn import ChatTurn, TurnPlan, TurnResult, TurnUpdate, plan_turn
from switchyard.gateway.vision.inputs import PromptImages
from switchyard.gateway.request.model import ChatRequest, TurnChoices
from switchyard.proto.gateway_scheduler import SubmitRequest

log = structlog.get_logger()

STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed request", for the log only


class Turn(Protocol):
    result: TurnResult | None
    side_call: bool  # the client forced the reply's shape (scheduler/residency.py)
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


async def plan_chat(ctx: RequestContext, chat: ChatRequest, *, param: str = "messages",
                    note_unseen: bool = False
                    ) -> tuple[TurnPlan, TurnChoices, PromptImages | None]:
    """Render and tokenize a chat (plan_turn) on a tokenizer lane chosen by its whole size,
    after the context decided what the turn needs (RequestContext.decide_chat: a chat that
    cannot fit the context is refused there), abandoned if its client leaves. The plan, the
    turn's choices and its images (the chat's images as markers in the plan's prompt)."""
    gw = ctx.gateway
    chat, images = await prepare_images(gw, chat)
    check_chat_template(gw.tokenizer)
    size, rendered_size = chat_chars(chat), chat_chars(chat, with_reasoning=False)
    abandoned = threading.Event()
    choices, options = ctx.decide_chat(chat, images, rendered_size, param=param,
                                       note_unseen=note_unseen, abandoned=abandoned)
    plan = await gw.run_tokenizer(plan_turn, gw.tokenizer, chat, options, gw.tool_syntax,
                                  gw.think, gw.script, size=size, receive=ctx.receive,
                                  abandoned=abandoned)
    return plan, choices, images


async def start_chat(ctx: RequestContext, chat: ChatRequest, *, rid: str,
                     id_prefix: str = "call_", param: str = "messages",
                     note_unseen: bool = False) -> tuple[ChatTurn, SubmitRequest]:
    """Render and plan a chat turn for any API; the caller answers with `respond`."""
    gw, record = ctx.gateway, ctx.record
    plan, choices, images = await plan_chat(ctx, chat, param=param, note_unseen=note_unseen)
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
    """Submit the turn and answer with its SSE stream or its one JSON body, both from one pass
    over its updates (`_updates`)."""
    gw, record = ctx.gateway, ctx.record
    record.start(submit, stream=stream)
    events = gw.client.submit(submit)
    if stream:
        frames = _sse_frames(_updates(events, turn, record, gw.keepalive_s), events, turn,
                             output)
        return EventStreamResponse(await started(frames), on_close=record.closed)
    try:
        body = await until_disconnect(ctx.receive, _body(_updates(events, turn, record), output))
    except ClientDisconnected:
        record.disconnected = True
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        events.close()
    return JSONResponse(body)


async def _updates(stream: RequestStream, turn: Turn, record: RequestRecord,
                   keepalive_s: float | None = None) -> AsyncIterator[TurnUpdate | None]:
    """The turn's update of each scheduler event, until its result or error, each with the
    bookkeeping it needs (the scheduler told of a cancel and of how the reply ended, the
    record's counts); None when `keepalive_s` passed without an event."""
    while True:
        event = await stream.get(timeout=keepalive_s)
        if event is None:
            yield None
            continue
        update = turn.on_event(event)
        if update.cancel:
            stream.cancel()
        if update.result is not None:
            record.reply_end = stream.reply_ended(turn.side_call, update.result.finish_reason)
        record.note(update, turn)
        yield update
        if update.error is not None or update.result is not None:
            return


async def _body(updates: AsyncIterator[TurnUpdate | None], output: Output) -> dict[str, Any]:
    """The turn's one JSON body (`updates` without keepalives)."""
    async for update in updates:
        if update is not None and update.error is not None:
            raise update.error
        if update is not None and update.result is not None:
            return output.body(update.result)
    raise RuntimeError("the turn's updates ended without a result")


async def _sse_frames(updates: AsyncIterator[TurnUpdate | None], stream: RequestStream,
                      turn: Turn, output: Output) -> AsyncIterator[bytes]:
    """The turn as SSE frames; its first update is awaited before the first frame, so a
    failure that comes at once (queue full, restart) is raised instead, with its own HTTP
    status (streaming.started). A keepalive fills each `keepalive_s` without an event."""
    try:
        update = await anext(updates)
        if update is not None and update.error is not None:
            raise update.error
        # b"" when there is nothing to say yet: the stream starts all the same (streaming.started)
        for frame in output.head() + output.frames(turn.start_events()) or [b""]:
            yield frame
        while True:
            if update is not None:
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
            update = await anext(updates)
            if update is None:
                yield getattr(output, "keepalive", SSE_KEEPALIVE)
    finally:
        stream.close()
