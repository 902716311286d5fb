"""OpenAI-compatible endpoints: chat completions, completions, models, health.

A handler validates, renders and tokenizes (chat turns through the shared turn planning of
driver.start_chat: tools, reasoning, prefix-stable history), then `driver.respond` submits to
the scheduler and answers with one JSON body or an SSE stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from switchyard.gateway.context import RequestContext, gateway_of
from switchyard.gateway.driver import respond, start_chat
from switchyard.gateway.errors import model_not_found
from switchyard.gateway.prompting.prompts import build_submit, check_model, encode_prompt
from switchyard.gateway.api.responses import ChatFormat, CompletionFormat, model_card, models_body
from switchyard.gateway.turn import TextTurn
from switchyard.gateway.api.json_body import message_limits, per_token, read_json
from switchyard.gateway.api.openai_request import parse_chat_request, parse_completion_request
from switchyard.gateway.output.tools import ToolSyntax
from switchyard.gateway.request.model import CompletionRequest
from switchyard.gateway.request.scripted import forced_reply, reply_text
from switchyard.gateway.request.structured import Constraint
from switchyard.common.script import Script
from switchyard.proto.ids import new_rid


async def chat_completions(request: Request) -> Response:
    ctx = RequestContext.of(request)
    gw = ctx.gateway
    limits = message_limits(gw)
    body = await read_json(ctx, limits)
    chat = parse_chat_request(body)
    check_model(chat.options.model, gw.model_id, gw.model_aliases)
    rid = new_rid("chatcmpl")
    turn, submit = await start_chat(ctx, chat, rid=rid)
    fmt = ChatFormat(rid, gw.model_id, include_usage=chat.options.include_usage)
    return await respond(ctx, turn, submit, fmt, stream=chat.options.stream)


async def completions(request: Request) -> Response:
    ctx = RequestContext.of(request)
    gw = ctx.gateway
    limits = {"prompt": per_token(gw.settings.ctx)}
    body = await read_json(ctx, limits)
    completion = parse_completion_request(body)
    check_model(completion.options.model, gw.model_id, gw.model_aliases)
    choices = ctx.decide(completion.options)
    if isinstance(completion.prompt, str):
        gw.check_prompt_chars(len(completion.prompt), "prompt")
    prompt_ids, scripted, rule = await gw.run_tokenizer(
        _encode_completion, gw.tokenizer, completion, gw.script, gw.tool_syntax,
        size=len(completion.prompt), receive=ctx.receive)
    if scripted is not None:
        ctx.record.script_rule = rule
        completion = dataclasses.replace(completion, constraint=scripted)
    await gw.check_grammar(completion.constraint, ctx.receive)
    rid = new_rid("cmpl")
    submit = build_submit(rid, prompt_ids, completion.options, ctx=gw.settings.ctx,
                          default_max_tokens=gw.settings.default_max_tokens,
                          stop_token_ids=gw.stop_token_ids, choices=choices, param="prompt",
                          grammar=completion.constraint.grammar if completion.constraint else "",
                          vocab_size=len(gw.tokenizer))
    turn = TextTurn(gw.tokenizer, prompt_ids, completion.options.stop,
                    gw.stop_token_ids + (gw.hidden_ids or ()), gw.hidden_ids is not None)
    fmt = CompletionFormat(rid, gw.model_id, include_usage=completion.options.include_usage)
    return await respond(ctx, turn, submit, fmt, stream=completion.options.stream)


def _encode_completion(tokenizer: Any, completion: CompletionRequest, script: Script | None,
                       syntax: ToolSyntax) -> tuple[list[int], Constraint | None, int | None]:
    """The prompt's tokens and, with a script whose rule holds for the prompt's text (all of
    it is the last turn; there is no system prompt and no tool), that rule's forced reply and
    number."""
    ids = encode_prompt(tokenizer, completion)
    if script is None:
        return ids, None, None
    text = completion.prompt if isinstance(completion.prompt, str) else tokenizer.decode(ids)
    rule = script.reply("", text, ())
    if rule is None:
        return ids, None, None
    return ids, forced_reply(tokenizer, reply_text(rule, syntax)), rule.number


async def list_models(request: Request) -> Response:
    gw = gateway_of(request)
    listed = (gw.model_id, *gw.model_aliases) if gw.settings.served_model_name else (gw.model_id,)
    return JSONResponse(models_body(listed, gw.created, gw.settings.ctx))


async def get_model(request: Request) -> Response:
    gw = gateway_of(request)
    model = request.path_params["model"]
    if model not in (gw.model_id, *gw.model_aliases):
        raise model_not_found(model)
    named = model if gw.settings.served_model_name else gw.model_id
    return JSONResponse(model_card(named, gw.created, gw.settings.ctx))


async def health(request: Request) -> Response:
    gw = gateway_of(request)
    status = gw.client.status()
    # "ok" only once the worker and the page index are both ready: a turn placed before the
    # index is known would re-read its whole conversation (docs/design.md "Processes").
    if status.connected and status.worker_ready and status.kvstore_ready:
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
