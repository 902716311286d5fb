"""OpenAI-compatible endpoints: chat completions, completions, models, health.

A handler validates and tokenizes, submits to the scheduler and turns the request's events into
one JSON body or an SSE stream. A streamed response keeps its status line back until the first
event (or the first keepalive), so failures that come at once (queue full, restart) still get
their own HTTP status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.context import Gateway, RequestRecord, gateway_of, record_of
from gateway.errors import model_not_found
from gateway.generation import Generation, Update
from gateway.prompts import build_submit, check_model, encode_prompt, render_chat
from gateway.responses import (ChatFormat, CompletionFormat, ResponseFormat, model_card,
                               models_body)
from gateway.scheduler_client import RequestStream
from gateway.streaming import (SSE_DONE, SSE_KEEPALIVE, ClientDisconnected,
                               EventStreamResponse, sse_data, until_disconnect)
from gateway.validation import (Options, header_priority, parse_chat_request,
                                parse_completion_request, parse_json)
from proto.ids import new_rid

STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed request", for the log only


async def chat_completions(request: Request) -> Response:
    gw = gateway_of(request)
    chat = parse_chat_request(parse_json(await gw.read_body(request)))
    check_model(chat.options.model, gw.model_id, gw.model_aliases)
    priority = header_priority(request.headers)
    prompt_ids = await gw.run_tokenizer(render_chat, gw.tokenizer, chat)
    fmt = ChatFormat(new_rid("chatcmpl"), gw.model_id, include_usage=chat.options.include_usage)
    return await generate(request, prompt_ids, chat.options, priority, fmt)


async def completions(request: Request) -> Response:
    gw = gateway_of(request)
    completion = parse_completion_request(parse_json(await gw.read_body(request)))
    check_model(completion.options.model, gw.model_id, gw.model_aliases)
    priority = header_priority(request.headers)
    prompt_ids = await gw.run_tokenizer(encode_prompt, gw.tokenizer, completion)
    fmt = CompletionFormat(new_rid("cmpl"), gw.model_id,
                           include_usage=completion.options.include_usage)
    return await generate(request, prompt_ids, completion.options, priority, fmt)


async def list_models(request: Request) -> Response:
    gw = gateway_of(request)
    return JSONResponse(models_body(gw.model_id, gw.created))


async def get_model(request: Request) -> Response:
    gw = gateway_of(request)
    model = request.path_params["model"]
    if model not in (gw.model_id, *gw.model_aliases):
        raise model_not_found(model)
    return JSONResponse(model_card(gw.model_id, gw.created))


async def health(request: Request) -> Response:
    gw = gateway_of(request)
    status = gw.client.status()
    if status.connected and status.worker_ready:
        word, code = "ok", 200
    elif status.connected or not status.ever_connected:
        word, code = "starting", 503
    else:
        word, code = "unavailable", 503
    return JSONResponse({
        "status": word, "model": gw.model_id, "scheduler_connected": status.connected,
        "worker_ready": status.worker_ready, "kvstore_ready": status.kvstore_ready,
        "num_waiting": status.num_waiting, "num_running": status.num_running,
    }, status_code=code)


# --- one generation, streamed or not ----------------------------------------------------------


async def generate(request: Request, prompt_ids: list[int], options: Options,
                   header_prio: str | None, fmt: ResponseFormat) -> Response:
    gw = gateway_of(request)
    record = record_of(request)
    submit = build_submit(fmt.rid, prompt_ids, options, ctx=gw.settings.ctx,
                          default_max_tokens=gw.settings.default_max_tokens,
                          stop_token_ids=gw.stop_token_ids, priority=header_prio)
    record.start(submit, stream=options.stream)
    generation = Generation(gw.tokenizer, prompt_ids=prompt_ids, stop=options.stop,
                            skip_ids=gw.stop_token_ids)
    stream = gw.client.submit(submit)
    if options.stream:
        return await start_stream(gw, record, stream, generation, fmt)
    try:
        body = await until_disconnect(request.receive, collect(record, stream, generation, fmt))
    except ClientDisconnected:
        record.disconnected = True
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        stream.close()
    return JSONResponse(body)


def apply(update: Update, stream: RequestStream, record: RequestRecord) -> None:
    """Bookkeeping every update needs, streamed or not."""
    if update.cancel:
        stream.cancel()
    if update.text:
        record.first_text()
    if update.finish is not None:
        record.finish(update.finish)
    if update.error is not None:
        record.fail(update.error)


async def collect(record: RequestRecord, stream: RequestStream, generation: Generation,
                  fmt: ResponseFormat) -> dict[str, Any]:
    parts = []
    while True:
        event = await stream.get()
        update = generation.on_event(event)
        apply(update, stream, record)
        parts.append(update.text)
        if update.error is not None:
            raise update.error
        if update.finish is not None:
            return fmt.final_body("".join(parts), update.finish.reason, update.finish.usage)


async def start_stream(gw: Gateway, record: RequestRecord, stream: RequestStream,
                       generation: Generation, fmt: ResponseFormat) -> Response:
    try:
        first = await stream.get(timeout=gw.keepalive_s)
    except BaseException:
        stream.close()
        raise
    updates = []
    if first is not None:
        update = generation.on_event(first)
        if update.error is not None:
            stream.close()
            record.fail(update.error)
            raise update.error
        updates.append(update)

    def on_close(disconnected: bool) -> None:
        record.disconnected = disconnected

    frames = sse_frames(gw, record, stream, generation, fmt, updates)
    return EventStreamResponse(frames, on_close=on_close)


async def sse_frames(gw: Gateway, record: RequestRecord, stream: RequestStream,
                     generation: Generation, fmt: ResponseFormat,
                     updates: list[Update]) -> AsyncIterator[bytes]:
    try:
        first_chunk = fmt.first_chunk()
        if first_chunk is not None:
            yield sse_data(first_chunk)
        while True:
            for update in updates:
                apply(update, stream, record)
                if update.text:
                    yield sse_data(fmt.text_chunk(update.text))
                if update.error is not None:
                    yield sse_data(update.error.body())
                    yield SSE_DONE
                    return
                if update.finish is not None:
                    yield sse_data(fmt.finish_chunk(update.finish.reason))
                    if fmt.include_usage:
                        yield sse_data(fmt.usage_chunk(update.finish.usage))
                    yield SSE_DONE
                    return
            event = await stream.get(timeout=gw.keepalive_s)
            if event is None:
                updates = []
                yield SSE_KEEPALIVE
            else:
                updates = [generation.on_event(event)]
    finally:
        stream.close()
