"""System messages between turns (gateway/prompting/system_turns.py): each family's template is
probed once for whether it writes one where it stands; where it does not, the text joins the
user side at the same place. Either way a session whose every turn adds a system message
re-renders each earlier turn as the same tokens, so only new tokens are prefilled."""

from __future__ import annotations

import pytest

from fixtures.chat_formats import FAMILIES, write_tokenizer
from switchyard.gateway.prompting.history import RenderOptions, TurnMemory, render_prompt
from switchyard.gateway.prompting.system_turns import (place_system_messages,
                                                       renders_system_in_place)
from switchyard.common.tokenizer_loading import load_tokenizer

IN_PLACE = {"chatml", "qwen3", "qwen3_coder", "glm", "llama3", "gemma3", "gemma4"}
# gpt-oss, MiniMax and Mistral drop a later system message; DeepSeek-V3.1 hoists it to the
# start, which would change the prefix of every later turn.
FOLDED = set(FAMILIES) - IN_PLACE


@pytest.fixture(scope="module")
def family_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load_tokenizer(str(write_tokenizer(root / family, family)))
        return loaded[family]
    return get


def test_every_family_is_probed():
    assert FOLDED == {"gpt_oss", "minimax_m2", "mistral", "mistral_args", "deepseek_v31"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_probe_finds_whether_the_template_writes_a_later_system_turn(family_tokenizer, family):
    assert renders_system_in_place(family_tokenizer(family)) == (family in IN_PLACE)


def user(text):
    return {"role": "user", "content": text}


def system(text):
    return {"role": "system", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_in_place_leaves_the_messages_alone():
    messages = [system("S"), user("U"), system("agents"), assistant("A"), user("V")]
    assert place_system_messages(messages, True) == (messages, [0, 1, 2, 3, 4])


def test_folded_joins_the_user_message_before_it():
    placed, origin = place_system_messages(
        [system("S"), system("D"), user("U"), system("agents"), assistant("A"), user("V")],
        False)
    assert placed == [system("S\n\nD"), user("U\n\nagents"), assistant("A"), user("V")]
    assert origin == [0, 2, 4, 5]


def test_folded_after_an_assistant_turn_goes_before_the_next_user_message():
    placed, origin = place_system_messages(
        [user("U"), assistant("A"), system("note"), user("V")], False)
    assert placed == [user("U"), assistant("A"), user("note\n\nV")]
    assert origin == [0, 1, 3]
    # Last in the prompt, or before a tool result: a user message of its own.
    placed, _ = place_system_messages([user("U"), assistant("A"), system("note")], False)
    assert placed == [user("U"), assistant("A"), user("note")]
    tool = {"role": "tool", "tool_call_id": "c", "content": "18C"}
    placed, origin = place_system_messages([user("U"), assistant("A"), system("n"), tool],
                                           False)
    assert placed == [user("U"), assistant("A"), user("n"), tool]
    assert origin == [0, 1, 2, 3]


def test_folded_into_a_message_with_image_parts():
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    placed, _ = place_system_messages([{"role": "user", "content": parts}, system("n")], False)
    assert placed == [{"role": "user", "content": parts + [{"type": "text", "text": "n"}]}]


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gpt_oss", "gemma3", "gemma4",
                                    "mistral", "deepseek_v31"])
def test_session_with_a_system_message_every_turn_stays_prefix_stable(family_tokenizer,
                                                                      family):
    """Every turn adds a user message and a system message after it (Claude Code's agent list
    after the first user turn, reminders later): each turn's prompt starts with the previous
    prompt and the reply generated after it."""
    tokenizer = family_tokenizer(family)
    memory = TurnMemory()
    options = RenderOptions(memory=memory, system_in_place=renders_system_in_place(tokenizer))
    messages = [system("You are a coding agent."), user("List the files.")]
    previous = None
    for turn in range(4):
        messages.append(system(f"Agent types available now: explore, plan, review-{turn}."))
        rendered = render_prompt(tokenizer, messages, None, {}, options)
        text = tokenizer.decode(rendered.ids)
        assert f"review-{turn}" in text  # never dropped
        if previous is not None:
            held = previous.ids + body
            assert rendered.ids[:len(held)] == held, f"turn {turn} re-reads its history"
        reply = assistant(f"Reply number {turn}: the files are a.py and b.py.")
        # As a model writes it after the generation prompt (Mistral: a space first).
        body = list(tokenizer.encode(" " + reply["content"], add_special_tokens=False))
        memory.remember(reply, body, rendered.opening, False, rendered.prefix)
        messages += [reply, user(f"And then step {turn}?")]
        previous = rendered
