"""Tool calls in chat replies: DeepSeek's DSML blocks (V3.2 `function_calls`, V4 `tool_calls`) parsed back into
OpenAI `tool_calls`, checked against what DeepSeek's own encoders write for an assistant turn (tests/test_chat.py's
recorded prompts), and through the HTTP front end over a scripted fake model, streamed and whole, with the real
`openai` client."""

import json

import openai
import pytest

from dsconv.family.arch import families
from dsconv.family.chat import ASSISTANT, EOS, END_THINK, THINK
from dsconv.family.dsml import V4, V32
from dsconv.runner.entrypoints.openai.choice import split_reasoning
from dsconv.runner.entrypoints.openai.tool_calls import sendable, split_calls
from tests.test_chat import CALLS, TOOL_CONVERSATIONS, TOOL_EXPECTED, WEATHER
from tests.test_serve_api import MODEL, FakeEngine, events, ids_of, make_client


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


def chat_client_for(family, reply_text):
    engine = FakeEngine(script=ids_of(reply_text) + [1])  # ends with EOS
    engine.family = families()[family]
    return make_client(engine)


CASES = [("deepseek_v32", V32, False), ("deepseek_v32", V32, True), ("deepseek_v4", V4, False),
         ("deepseek_v4", V4, True)]


@pytest.mark.parametrize("family,dialect,thinking", CASES)
def test_tool_calls_through_the_api_streamed_and_whole(family, dialect, thinking):
    reply_text = ("Weighing it.</think>" if thinking else "") + "Let me check." + dialect.render_calls(CALLS)
    client, engine = chat_client_for(family, reply_text)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris, and the time?"}],
            "tools": [WEATHER, TOOL_CONVERSATIONS["tool_results"][0][1]], "max_tokens": 400,
            "chat_template_kwargs": {"thinking": thinking}}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check." and calls_of(message["tool_calls"]) == EXPECTED_CALLS
    assert message["reasoning_content"] == ("Weighing it." if thinking else None)
    prompt = engine.submitted[next(iter(engine.submitted))][0]
    assert "get_weather" in engine.tokenizer.decode(prompt)  # the tools are in the prompt

    chunks = [e for e in events(client.post("/v1/chat/completions", json={**body, "stream": True})) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Let me check." and "DSML" not in json.dumps([c["choices"][0]["delta"].get("content")
                                                                  for c in chunks])
    streamed = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert calls_of(streamed) == EXPECTED_CALLS and [c["index"] for c in streamed] == [0, 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_openai_client_reads_the_calls_and_a_tool_result_round():
    client, engine = chat_client_for("deepseek_v4", "On it." + V4.render_calls(CALLS))
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    tools = TOOL_CONVERSATIONS["tool_results"][0]
    messages = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
    # stream accumulation, as the SDK's helper does it
    with api.chat.completions.stream(model=MODEL, messages=messages, tools=tools) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls] == \
        EXPECTED_CALLS
    # the next turn: the calls and their results go back into the prompt as V4's encoder writes them
    followup = messages + [reply.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "clear"}]
    api.chat.completions.create(model=MODEL, messages=followup, tools=tools, max_tokens=1)
    prompt = engine.tokenizer.decode(engine.submitted[list(engine.submitted)[-1]][0], skip_special_tokens=False)
    assert prompt.endswith("<｜User｜><tool_result>clear</tool_result>\n\n<tool_result>12:00</tool_result>"
                           "<｜Assistant｜></think>")
    assert V4.render_calls([c.model_dump() for c in calls]) in prompt


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "names no function of tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both hold the reply"),
    ({"tools": None, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "cannot be compiled for constrained decoding"),
    ({"tools": None, "response_format": {"type": "json_schema", "json_schema": {}}}, "needs json_schema.schema"),
    ({"tools": None, "response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"tool_choice": "sometimes"}, "tool_choice must be"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls=false is not supported"),
    ({"tools": None, "tool_choice": "auto"}, "needs tools"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
])
def test_tool_request_errors(body, needle):
    client, _ = chat_client_for("deepseek_v32", "x")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body}
    response = client.post("/v1/chat/completions", json=request)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


def test_tool_choice_none_leaves_tools_out():
    client, engine = chat_client_for("deepseek_v32", "plain text")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "tool_choice": "none"}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "plain text" and "tool_calls" not in message
    assert "get_weather" not in engine.tokenizer.decode(engine.submitted[next(iter(engine.submitted))][0])
