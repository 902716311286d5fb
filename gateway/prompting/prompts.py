"""From a validated request to prompt token ids and a `SubmitRequest`.

Chat messages are rendered with the tokenizer's own chat template as text, then encoded without
adding special tokens again (the template already wrote BOS and role markers), as mlx-lm's
`TokenizerWrapper.apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from switchyard.gateway.errors import context_length_exceeded, invalid, model_not_found
from switchyard.gateway.request.model import ChatRequest, CompletionRequest, Options, TurnChoices
from switchyard.proto.values import SamplingParams
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.proto.tokens import TokenIds

DEFAULT_MODEL_ID = "switchyard-tiny"


def served_model_id(model_ref: str) -> str:
    """The id clients use: a local path's basename (without .gguf), else the repo id."""
    if not model_ref:
        return DEFAULT_MODEL_ID
    path = Path(model_ref).expanduser()
    if path.exists() or model_ref.startswith(("/", ".", "~")) or model_ref.endswith(".gguf"):
        name = path.resolve().name if path.exists() else path.name
        return name[:-len(".gguf")] if name.endswith(".gguf") else name
    return model_ref.rstrip("/")


def check_model(requested: str | None, model_id: str, aliases: tuple[str, ...] = ()) -> None:
    if requested is not None and requested not in (model_id, *aliases):
        raise model_not_found(requested)


def check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None) and not getattr(
            tokenizer, "has_chat_template", False):
        raise invalid("This model has no chat template; use /v1/completions",
                      code="no_chat_template")


def render_chat(tokenizer: Any, chat: ChatRequest) -> list[int]:
    """The chat's prompt token ids as the template alone renders them (no prefix-stable
    splicing; see history.render_prompt); a template that rejects the conversation is a 400."""
    check_chat_template(tokenizer)
    try:
        text = tokenizer.apply_chat_template(
            chat.messages, tools=chat.tools, add_generation_prompt=True, tokenize=False,
            **chat.template_kwargs)
    except Exception as exc:  # request boundary: jinja raises anything the template does
        raise invalid(f"The chat template rejected the messages: {type(exc).__name__}: {exc}",
                      param="messages", code="invalid_messages") from None
    if not isinstance(text, str):
        raise invalid("The chat template did not produce text", param="messages",
                      code="invalid_messages")
    return list(tokenizer.encode(text, add_special_tokens=False))


def fewest_tokens_per_message(tokenizer: Any) -> int:
    """The fewest tokens one more message adds to a prompt under this chat template: an empty
    user, assistant or tool message, each measured after the one its role follows (1 when the
    template renders none of them, or has none). A request's message list can be refused
    at the context over this before it is parsed whole (gateway/api/json_body.py)."""
    def num_tokens(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                             tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    user, assistant = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
    tool = {"role": "tool", "tool_call_id": "0", "content": ""}
    costs = []
    for before, message in (([user], assistant), ([user, assistant], user),
                            ([user, assistant], tool)):
        try:
            costs.append(num_tokens(before + [message]) - num_tokens(before))
        except Exception:  # a template that refuses this role or order: it costs nothing here
            continue
    return max(1, min(costs, default=1))


def encode_prompt(tokenizer: Any, request: CompletionRequest) -> list[int]:
    """A completion prompt: text is encoded as the tokenizer does by default (BOS included)."""
    if isinstance(request.prompt, str):
        return list(tokenizer.encode(request.prompt))
    vocab_size = len(tokenizer)
    for i, token in enumerate(request.prompt):
        if not 0 <= token < vocab_size:
            raise invalid(f"'prompt[{i}]' is not a token id of this model (0..{vocab_size - 1})",
                          param="prompt", code="invalid_value")
    return list(request.prompt)


# What a template writes around each message (role markers, separators), at least: counts
# for the lane choice, so a million empty messages are a large prompt.
MESSAGE_MARKER_CHARS = 8


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON value (keys included)."""
    stack, total = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def chat_chars(chat: ChatRequest, *, with_reasoning: bool = True) -> int:
    """Characters a chat's rendering may hold, judged on everything the template may render
    and the tokenizer read: every message of every role with its tool
    calls, names and (`with_reasoning`) reasoning, the tool definitions and the template's
    variables, and a few per message. Without reasoning (which templates often drop) and the
    per-message allowance it is what the context check refuses on."""
    total = text_chars(chat.tools) + text_chars(chat.template_kwargs)
    for message in chat.messages:
        fields = message if with_reasoning else {
            k: v for k, v in message.items() if k not in ("reasoning_content", "thinking")}
        total += text_chars(fields)
    if with_reasoning:
        total += MESSAGE_MARKER_CHARS * len(chat.messages)
    return total


def build_submit(rid: str, prompt_ids: list[int], options: Options, *, ctx: int,
                 default_max_tokens: int, stop_token_ids: tuple[int, ...],
                 choices: TurnChoices, param: str = "messages", grammar: str = "",
                 grammar_trigger: tuple[int, ...] = (),
                 vocab_size: int | None = None, images: tuple = (),
                 image_data: tuple = ()) -> SubmitRequest:
    """Check the context, clamp max_tokens to what is left of it, draw a seed if none given."""
    if vocab_size is not None:
        for token, _ in options.logit_bias:
            if token >= vocab_size:
                raise invalid(f"'logit_bias' names token {token}, not a token id of this "
                              f"model (0..{vocab_size - 1})", param="logit_bias",
                              code="invalid_value")
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise invalid("The prompt is empty after tokenization", param="prompt",
                      code="invalid_value")
    if num_prompt + 1 > ctx:
        raise context_length_exceeded(num_prompt, ctx, param)
    requested = options.max_tokens if options.max_tokens is not None else default_max_tokens
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    sampling = SamplingParams(temperature=options.temperature, top_p=options.top_p,
                              top_k=options.top_k, min_p=options.min_p, seed=seed,
                              grammar=grammar, grammar_trigger=grammar_trigger,
                              logit_bias=options.logit_bias)
    return SubmitRequest(
        rid=rid, prompt_token_ids=TokenIds(prompt_ids),
        max_tokens=max(1, min(requested, ctx - num_prompt)), sampling=sampling,
        stop_token_ids=stop_token_ids,
        priority=choices.priority, images=images, image_data=image_data,
        speculative=options.speculative, cache_salt=choices.salt, tenant=choices.tenant,
        tenant_weight=choices.tenant_weight)
