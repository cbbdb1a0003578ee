"""Tool calls in chat replies: DeepSeek's DSML blocks (V3.2 `function_calls`, V4 `tool_calls`) parsed back into
OpenAI `tool_calls`, checked against what DeepSeek's own encoders write for an assistant turn (the prompts recorded
in tests/data/chat_tools.json). The HTTP side (streaming, the `openai` client) is in tests/test_serve_api.py."""

import json
from pathlib import Path

import pytest

from dsconv.family.text import ASSISTANT, EOS, END_THINK, THINK
from dsconv.family.dsml import V4, V32
from dsconv.runner.entrypoints.openai.choice import split_reasoning
from dsconv.runner.entrypoints.openai.tool_calls import sendable, split_calls

TOOLS_DATA = json.loads((Path(__file__).parent / "data" / "chat_tools.json").read_text())
TOOL_CONVERSATIONS = {name: (c["tools"], c["messages"]) for name, c in TOOLS_DATA["conversations"].items()}
TOOL_EXPECTED, CALLS = TOOLS_DATA["expected"], TOOLS_DATA["calls"]


def calls_of(reply_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply_calls]


EXPECTED_CALLS = calls_of(CALLS)


def assistant_turn(prompt: str) -> str:
    """The first assistant turn of a recorded prompt, as the model would have generated it: after the reply's
    opening (`<｜Assistant｜>` and `<think>` / `</think>`), up to its end-of-sentence."""
    start = prompt.index(ASSISTANT) + len(ASSISTANT)
    for opening in (THINK, END_THINK):
        if prompt.startswith(opening, start):
            start += len(opening)
            break
    return prompt[start:prompt.index(EOS, start)]


@pytest.mark.parametrize("family,dialect,column", [("deepseek_v32", V32, 2), ("deepseek_v4", V4, 3)])
def test_calls_written_by_deepseeks_encoders_parse_back(family, dialect, column):
    for name, thinking, *prompts in TOOL_EXPECTED:
        if name not in ("tool_results", "tool_results_answered"):
            continue
        turn = assistant_turn(prompts[column - 2])
        opened_thinking = thinking and END_THINK in turn  # V4 keeps the turn's reasoning when tools are given
        reasoning, content = split_reasoning(turn, True, dialect.start) if opened_thinking else (None, turn)
        reply = split_calls(dialect, content)
        assert calls_of(reply.calls) == EXPECTED_CALLS, (name, thinking, turn)
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in reply.calls)
        message = TOOL_CONVERSATIONS[name][1][1 if name == "tool_results" else 2]
        assert reply.content == message["content"], (name, thinking)
        if opened_thinking:
            assert reasoning == message["reasoning_content"]
        assert dialect.start not in sendable(dialect, content)  # nothing of the block streams as text


@pytest.mark.parametrize("dialect", [V32, V4])
def test_malformed_or_partial_calls_are_text(dialect):
    good = dialect.render_calls(CALLS)
    for text in (good[:-5],  # unfinished
                 good.replace('string="false">3', 'string="false">three'),  # not JSON
                 good.replace("invoke name", "invoke nam"),  # not the format
                 good + "\nmore text",  # text after the block
                 f"\n\n{dialect.start}\n{dialect.end}"):  # no call
        assert split_calls(dialect, "Hi." + text).content == "Hi." + text
        assert split_calls(dialect, "Hi." + text).calls == []
    assert calls_of(split_calls(dialect, "Hi." + good + "\n").calls) == EXPECTED_CALLS


def test_v4_call_without_closing_thinking():
    """DeepSeek-V4 is reported to start a call without `</think>`: the reasoning ends where the block begins."""
    text = "I should look it up." + V4.render_calls(CALLS)
    reasoning, content = split_reasoning(text, True, V4.start)
    assert reasoning == "I should look it up."
    reply = split_calls(V4, content)
    assert reply.content == "" and calls_of(reply.calls) == EXPECTED_CALLS
    streaming, _ = split_reasoning(text[:len("I should look it up.") + 4], False, V4.start)
    assert streaming == "I should look it up."  # "\n\n<｜" may begin the block: held back
