"""`dsrun serve` as the client libraries users run meet it, each in its default configuration: langchain-openai,
instructor, pydantic-ai and the OpenAI Agents SDK (test dependencies only), against live servers on tiny random-weight
V3.2 and V4 models with the real vocabulary at world 1.

No request sets max_tokens, as none of these libraries does by default: the servers run with default flags but a
small KV cache (--cache-tokens), so max_model_len is what one DP rank's cache holds and a reply without max_tokens
gets what is left after its prompt. Random weights write noise; where a library needs a tool call or JSON, it asks
for one (tool_choice, response_format, a structured output), constrained decoding makes the model write it, and the
schemas are bounded (enums, integer ranges, short strings) so that a reply ends well inside the cache. Free text
would run to max_model_len (an end-of-sentence is one token in 129,280): the models' lm_head row of the
end-of-sentence token is scaled up (EOS_SCALE) so that free text ends within a few tokens, as a real model's short
answer does, while constrained text is held to its grammar, which allows end-of-sentence only once it is complete."""

import json
import shutil
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file

from tests.helpers import Server

pytestmark = pytest.mark.slow

FAMILIES = ("deepseek_v32", "deepseek_v4")
CACHE_TOKENS = 1024  # the default max_model_len then: one DP rank's cache
# lm_head rows have norm 1 (std 1/sqrt(hidden)); 30 times that puts end-of-sentence's logit far above the rest on
# about half of the steps, far below on the others
EOS_SCALE = 30.0
PROMPT = "What should I do today?"


class Answer(BaseModel):
    verdict: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)


class Weather(BaseModel):
    """The weather of a city."""
    city: Literal["Paris", "Lima"]


def get_weather(city: Literal["Paris", "Lima"]) -> str:
    """The weather of a city."""
    return f"sunny in {city}"


def terse(source: Path, out: Path) -> Path:
    """A copy of `source` whose output head favours end-of-sentence (EOS_SCALE)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    (name,) = [n for n in weight_map if n in ("lm_head.weight", "head.weight")]  # V3.2's, V4's
    tensors = load_file(out / weight_map[name])
    tensors[name][config["eos_token_id"]] *= EOS_SCALE
    save_file(tensors, out / weight_map[name], metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, tiny_source, tmp_path_factory):
    """`dsconv shard SRC OUT --ep 1 --tp 1` (a world of one: --world-size defaults to the largest size asked
    for), served with default flags but the cache size."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp(request.param)
    shards = root / request.param
    source = terse(tiny_source(request.param, "fp8", real_vocab=True), root / "src")
    done = subprocess.run([sys.executable, "-m", "dsconv.cli", "shard", str(source), str(shards), "--ep", "1", "--tp",
                           "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "world size 1: attention DP 1 x attention TP 1, EP 1, lm_head TP 1" in done.stdout, done.stdout
    assert json.loads((shards / "manifest.json").read_text())["layout"]["world_size"] == 1
    running = Server(shards, shards.parent / "server.log", "--dtype", "float32", "--cache-tokens", CACHE_TOKENS)
    running.model = request.param
    assert "(1 ranks, DP 1 x attention TP 1, EP 1)" in running.log()
    yield running
    assert running.stop() == 0, running.log()


def test_max_model_len_defaults_to_what_the_cache_holds(server):
    (model,) = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert model["max_model_len"] == CACHE_TOKENS
    assert f"max_model_len {CACHE_TOKENS}" in server.log()
    # a request without max_tokens: the rest of max_model_len; one that asks for more is a 400 naming both
    reply = server.openai().chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}])
    assert reply.choices[0].finish_reason == "stop", reply
    import openai

    with pytest.raises(openai.BadRequestError, match=f"exceed the model's context of {CACHE_TOKENS} tokens"):
        server.openai().chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=CACHE_TOKENS)


def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.model, base_url=f"{server.url}/v1", api_key="unused")


def test_langchain(server):
    llm = chat_model(server)
    assert isinstance(llm.invoke(PROMPT).content, str)
    chunks = list(llm.stream(PROMPT))
    assert len(chunks) > 1
    called = llm.bind_tools([Weather], tool_choice="required").invoke("Weather in Paris?")
    assert [call["name"] for call in called.tool_calls] == ["Weather"]
    Weather(**called.tool_calls[0]["args"])
    # the default method (json_schema), and function calling, which always sends parallel_tool_calls=false
    assert isinstance(llm.with_structured_output(Answer).invoke(PROMPT), Answer)
    assert isinstance(llm.with_structured_output(Answer, method="function_calling").invoke(PROMPT), Answer)
    called = llm.bind_tools([Weather], tool_choice="required", parallel_tool_calls=False).invoke("Weather?")
    assert len(called.tool_calls) == 1


def test_instructor(server):
    import instructor
    import openai

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused"), mode=mode)
        answer = client.chat.completions.create(model=server.model, response_model=Answer,
                                                messages=[{"role": "user", "content": PROMPT}])
        assert isinstance(answer, Answer), mode


def test_pydantic_ai(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))
    assert isinstance(Agent(model, output_type=Answer).run_sync(PROMPT).output, Answer)
    # with a tool too: each turn calls get_weather or gives the answer (a structured output allows no text reply,
    # which these models would leave empty)
    result = Agent(model, tools=[get_weather], output_type=Answer).run_sync("Weather in Lima?")
    assert isinstance(result.output, Answer)


def test_openai_agents(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent to OpenAI's servers
    model = OpenAIChatCompletionsModel(model=server.model,
                                       openai_client=AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused"))
    agent = Agent(name="assistant", instructions="Answer briefly.", tools=[function_tool(get_weather)], model=model,
                  model_settings=ModelSettings(tool_choice="required", store=True, parallel_tool_calls=False))
    result = Runner.run_sync(agent, "Weather in Paris?")
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert calls and outputs and outputs[0].output.startswith("sunny in ")
    assert isinstance(result.final_output, str)


def test_streamed_required_call_arrives_incrementally(server):
    """Per choice (n=2): the name in a chunk before the last, the arguments in fragments that join to the
    non-streamed ones (the same seed)."""
    request = dict(model=server.model, messages=[{"role": "user", "content": "Weather?"}], seed=5, temperature=1.0,
                   n=2, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
                       "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"]}}}], tool_choice="required")
    api = server.openai()
    whole = api.chat.completions.create(**request).choices
    chunks = list(api.chat.completions.create(**request, stream=True))
    for index in range(2):
        deltas = [(at, call) for at, chunk in enumerate(chunks) for choice in chunk.choices if choice.index == index
                  for call in choice.delta.tool_calls or ()]
        (call,) = whole[index].message.tool_calls
        assert deltas[0][1].function.name == "get_weather" and deltas[0][0] < len(chunks) - 1
        fragments = [delta.function.arguments for _, delta in deltas if delta.function.arguments]
        assert len(fragments) >= 2 and "".join(fragments) == call.function.arguments
        assert json.loads(call.function.arguments).keys() == {"city"}
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.index == index]
        assert finish[-1] == "tool_calls" and not any(finish[:-1])


IMPOSSIBLE = -9999.0  # the logprob a masked token reads (JSON has no -inf)


def first_token(server, route: str, bias: dict | None = None, **request) -> tuple[int, list[int]]:
    """The greedy first token of a one-token reply and those of the top-5 tokens it was chosen from that are possible
    (after bias and grammar: a masked token's logprob reads -9999), as ids."""
    api = server.openai()
    if route == "completions":
        reply = api.completions.create(model=server.model, prompt=[0, 5, 6, 7], max_tokens=1, temperature=0,
                                       logprobs=5, logit_bias=bias or {}, extra_body={"return_tokens_as_token_ids": True})
        tokens = reply.choices[0].logprobs.tokens
        top = reply.choices[0].logprobs.top_logprobs[0]
        ranked = sorted((t for t in top if top[t] > IMPOSSIBLE), key=lambda t: -top[t])
    else:
        reply = api.chat.completions.create(model=server.model, max_tokens=1, temperature=0, logprobs=True,
                                            top_logprobs=5, logit_bias=bias or {},
                                            extra_body={"return_tokens_as_token_ids": True}, **request)
        content = reply.choices[0].logprobs.content
        tokens = [entry.token for entry in content]
        ranked = [entry.token for entry in sorted(content[0].top_logprobs, key=lambda e: -e.logprob)
                  if entry.logprob > IMPOSSIBLE]
    as_id = lambda token: int(token.removeprefix("token_id:"))  # noqa: E731
    return as_id(tokens[0]), [as_id(token) for token in ranked]


def test_logit_bias_removes_and_forces_tokens(server):
    """-100 on the greedy token removes it, +100 on another forces it: free, and held to a JSON schema (where the
    forced token must be one the grammar allows, and a token it does not allow stays out whatever its bias)."""
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": Answer.model_json_schema()}}
    for route, request in (("completions", {}),
                           ("chat", {"messages": [{"role": "user", "content": PROMPT}], "response_format": schema})):
        greedy, ranked = first_token(server, route, **request)
        assert greedy == ranked[0]
        removed, _ = first_token(server, route, {str(greedy): -100}, **request)
        assert removed != greedy
        assert len(ranked) > 1, ranked
        forced = ranked[-1]
        assert first_token(server, route, {str(forced): 100}, **request)[0] == forced
        if route == "chat":  # the reply must open the JSON object: a letter is never allowed first
            outside = server_token_id(server, "x")
            assert first_token(server, route, {str(outside): 100}, **request)[0] == greedy


def server_token_id(server, text: str) -> int:
    (token,) = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token
