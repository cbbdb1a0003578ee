"""`dsrun serve` as its clients meet it: live servers on the tiny fixtures at world 1 and world 16 (DP16, EP16,
lm_head TP16), float32, driven by the real `openai` client and httpx, against transformers' model of the same
weights. Prompts are token ids (the fixtures' vocabulary is tiny); a step budget of 24 tokens makes the longest
prompt prefill in chunks."""

import json
import re
import subprocess
import threading
import time

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.family.layout import Layout
from dsconv.shard.shard import ExpertRequest
from tests.helpers import Server, shard

pytestmark = pytest.mark.slow

CASES = {"v32-w1": ("deepseek_v32", Layout(1, 1, 1, 1)), "v4-w1": ("deepseek_v4", Layout(1, 1, 1, 1)),
         "v32-w16": ("deepseek_v32", Layout(16, 16, 16, 1)), "v4-w16": ("deepseek_v4", Layout(16, 16, 16, 1))}
FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "24", "--cache-tokens", "1024")
# The world-16 servers run with 16 redundant experts placed round-robin and EPLB rebalancing every 16 steps: every
# test of theirs then crosses rebalances, experts moving between ranks with requests in flight
EPLB_FLAGS = ("--enable-eplb", "--eplb-config", json.dumps({"window_size": 16, "step_interval": 16,
                                                            "num_redundant_experts": 16, "log_balancedness": True}))
LENGTHS = (5, 23, 40, 9, 17, 31)  # six prompts; 40 > the step budget of 24
NEW_TOKENS = 8
KILL_DEADLINE_S = 60
TOKEN_ID = re.compile(r"token_id:(\d+)")


@pytest.fixture(scope="module")
def servers(tiny_source, tmp_path_factory):
    """servers(case) -> a running Server, started on first use and stopped (SIGTERM, exit 0) at the end."""
    running: dict[str, Server] = {}

    def get(case: str) -> Server:
        if case not in running:
            family, layout = CASES[case]
            shards = tmp_path_factory.mktemp(case) / case
            eplb = layout.world_size == 16
            shard(tiny_source(family, "fp8"), shards, layout, ExpertRequest(16) if eplb else ExpertRequest())
            running[case] = Server(shards, shards.parent / "server.log", *FLAGS, *(EPLB_FLAGS if eplb else ()))
        return running[case]

    get.running = running
    yield get
    codes = {}
    for case, server in running.items():  # every server is stopped before any failure is reported
        try:  # world 16 as a service manager stops it (issue 71: its fork server died and the job exited 1)
            codes[case] = server.stop(group=CASES[case][1].world_size == 16)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            codes[case] = "no exit within the deadline"
    for case, code in codes.items():
        assert code == 0 and "dsrun serve: stopped" in running[case].log(), \
            f"{case} exited with {code} on SIGTERM:\n{running[case].log()}"


@pytest.fixture(scope="module")
def reference(tiny_source):
    models = {}

    def get(family):
        if family not in models:
            models[family] = AutoModelForCausalLM.from_pretrained(tiny_source(family, "bf16"),
                                                                  dtype=torch.float32).eval()
        return models[family]

    return get


def prompts(family, tiny_source):
    vocab = json.loads((tiny_source(family, "fp8") / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(len(family))
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def expected_tokens(model, ids, n=NEW_TOKENS, **generate):
    """transformers' greedy tokens, each from a whole forward of the sequence so far (use_cache=False); generate:
    further generation arguments (e.g. repetition_penalty)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, use_cache=False, **generate)
    return out[0, len(ids):].tolist()


def ids_of(choice) -> list[int]:
    """The generated token ids of a completion choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(TOKEN_ID.fullmatch(token).group(1)) for token in choice.logprobs.tokens]


def complete(server, prompt, max_tokens=NEW_TOKENS, **extra):
    """Greedy token ids of one prompt (or, for a list of prompts, of each, in order)."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **extra.pop("extra_body", {})}
    response = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=extra.pop("temperature", 0.0), logprobs=0,
                                                  extra_body=body, **extra)
    return [ids_of(c) for c in sorted(response.choices, key=lambda c: c.index)]


@pytest.fixture(params=list(CASES))
def case(request, servers, tiny_source):
    family, _ = CASES[request.param]
    server = servers(request.param)
    server.model = server.openai().models.list().data[0].id
    return request.param, family, server, prompts(family, tiny_source)


def test_greedy_completions_equal_transformers_generate(case, reference):
    _, family, server, ps = case
    got = complete(server, ps[:3])  # one request, three prompts: choices by index
    assert got == [expected_tokens(reference(family), p) for p in ps[:3]]


def test_repetition_penalty_equals_transformers_generate(case, reference):
    """vLLM's repetition_penalty against transformers' generate with the same penalty (its
    RepetitionPenaltyLogitsProcessor over the prompt and the output so far), greedy: the same tokens, which differ
    from the unpenalized ones. A penalty below 1 favours the tokens seen: on these random-weight models a penalty
    above 1 rarely moves a greedy token (none of V3.2's top tokens was in its prompt), one below 1 makes both
    families repeat prompt and output tokens."""
    _, family, server, ps = case
    penalty = 0.5
    got = complete(server, ps[:2], extra_body={"repetition_penalty": penalty})
    want = [expected_tokens(reference(family), p, repetition_penalty=penalty) for p in ps[:2]]
    assert got == want and want != [expected_tokens(reference(family), p) for p in ps[:2]]


def world_1_twin(servers, case_name: str) -> Server:
    """The family's world-1 server, for a world-16 test's requests served alone: sharded results equal unsharded ones
    in float32 (tests/test_runner_dist.py holds every layout to it, and test_greedy_completions_equal_transformers_
    generate both worlds to transformers), so the reference costs world 1's steps, a fraction of 16 ranks' on 2
    cores, and the world-16 server serves only the requests under test."""
    twin = servers(case_name.replace("-w16", "-w1"))
    twin.model = twin.openai().models.list().data[0].id
    return twin


def test_staggered_requests_each_give_their_tokens_alone(case, servers):
    name, _, server, ps = case
    twin = world_1_twin(servers, name)
    alone = [complete(twin, p)[0] for p in ps]
    got: dict[int, list[int]] = {}

    def run(i):
        time.sleep(0.15 * i)  # arrivals while the earlier ones prefill and decode
        got[i] = complete(server, ps[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [got[i] for i in range(len(ps))] == alone


def test_streamed_text_equals_non_streamed(case):
    _, _, server, ps = case
    client = server.openai()
    whole = client.completions.create(model=server.model, prompt=ps[2], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=server.model, prompt=ps[2], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(ps[2]) == whole.usage.prompt_tokens


def test_echo_prompt_logprobs_equal_transformers(case, reference):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0."""
    _, family, server, ps = case
    ids = ps[2]
    response = server.openai().completions.create(model=server.model, prompt=ids, max_tokens=1, temperature=0,
                                                  echo=True, logprobs=1,
                                                  extra_body={"return_tokens_as_token_ids": True})
    logprobs = response.choices[0].logprobs
    assert ids_of(response.choices[0])[:len(ids)] == ids and logprobs.token_logprobs[0] is None
    with torch.no_grad():
        theirs = torch.log_softmax(reference(family)(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = theirs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(logprobs.token_logprobs[1:len(ids)])
    assert torch.allclose(got, want, atol=1e-3, rtol=0), (got - want).abs().max()
    for token, token_logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        # the most likely token, and the token itself when it is not that one (as OpenAI's and vLLM's)
        assert top[token] == token_logprob and len(top) <= 2 and max(top.values()) >= token_logprob


SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "extra_body": {"top_k": 40}}


def test_seeded_sampling_repeats_whatever_shares_the_batch(case, servers):
    """A seeded request alone, then again while other requests share the steps: the same tokens; another seed other
    tokens; n samples of one prefill draw as requests with seed + j. The requests served alone run on the family's
    world-1 server (world_1_twin); the server under test serves the rest side by side, each beside the others."""
    name, _, server, ps = case
    alone = world_1_twin(servers, name)
    first = complete(alone, ps[1], max_tokens=12, **SAMPLED)
    singles = [complete(alone, ps[1], max_tokens=12, **{**SAMPLED, "seed": 1234 + j})[0] for j in (1, 2)]
    runs = {"again": (ps[1], 12, SAMPLED), "other seed": (ps[1], 12, {**SAMPLED, "seed": 4321}),
            "samples": (ps[1], 12, {**SAMPLED, "n": 3}), **{i: (p, 20, {}) for i, p in enumerate(ps[3:])}}
    got = {}

    def run(key):
        prompt, max_tokens, extra = runs[key]
        got[key] = complete(server, prompt, max_tokens=max_tokens, **extra)

    threads = [threading.Thread(target=run, args=(key,)) for key in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got["again"] == first and got["other seed"] != first
    assert got["samples"] == first + singles  # sample j draws as a request with seed + j would, in one response


@pytest.mark.parametrize("case_name", ["v32-w1", "v4-w1"])
def test_prefix_cache_usage_and_metrics(case_name, servers, tiny_source):
    """The same prompt twice through the openai client: the second's usage reports the prompt's full blocks (16
    tokens each, the last token always computed) as cached, in the response and in the streamed final usage chunk,
    with the same tokens; /metrics counts the lookups and hits. Both families (DeepSeek-V4 restores its slot from
    the state blocks)."""
    family, _ = CASES[case_name]
    server = servers(case_name)
    model = server.openai().models.list().data[0].id
    vocab = json.loads((tiny_source(family, "fp8") / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(2, vocab, (53,), generator=torch.Generator().manual_seed(53)).tolist()

    def metric(name):
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return float(re.search(rf"^dsrun:{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE).group(1))

    hits_before = metric("prefix_cache_hits")
    first, second = (server.openai().completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
                     for _ in range(2))
    streamed = list(server.openai().completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    want = 48
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == want
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == want
    assert second.choices[0].text == first.choices[0].text
    assert metric("prefix_cache_hits") - hits_before == 2 * want
    assert metric("prefix_cache_queries") >= 3 * len(prompt)


@pytest.mark.parametrize("case_name", ["v32-w16", "v4-w16"])
def test_eplb_rebalances_and_exports_its_figures(case_name, servers, tiny_source):
    """The world-16 servers rebalance while serving (EPLB_FLAGS): /metrics counts the rebalances and holds each one's
    balancedness, overall and per layer, measured and planned; the log says it."""
    family, _ = CASES[case_name]
    server = servers(case_name)
    model = server.openai().models.list().data[0].id
    prompt = prompts(family, tiny_source)[1]

    def rebalances():
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return float(re.search(r"^dsrun:eplb_rebalances_total{[^}]*} (\S+)$", text, re.M).group(1)), text

    for _ in range(4):  # 16 steps each at most; earlier tests have usually run them already
        if rebalances()[0] >= 1:
            break
        server.openai().completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    count, text = rebalances()
    assert count >= 1
    figures = {}
    for labels, value in re.findall(r"^dsrun:eplb_balancedness{([^}]*)} (\S+)$", text, re.M):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        figures[named["layer"], named["stage"]] = float(value)
    assert {stage for _, stage in figures} == {"measured", "planned"} and ("all", "planned") in figures
    assert all(0 < value <= 1 for value in figures.values()), figures
    assert "dsrun: eplb rebalance 1 after 16 steps" in server.log()


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_seeded_sampling_same_at_world_1_and_16(family, servers, tiny_source):
    ps = prompts(family, tiny_source)
    tag = "v32" if family == "deepseek_v32" else "v4"
    runs = []
    for world in ("w1", "w16"):
        server = servers(f"{tag}-{world}")
        server.model = server.openai().models.list().data[0].id
        runs.append(complete(server, ps[4], max_tokens=12, **SAMPLED))
    assert runs[0] == runs[1]


ONE_OF_PROMPT = "prompt must be one of: str, list[int], list[str], list[list[int]]"


def malformed(vocab: int, model: str, max_model_len: int, cache_tokens: int
              ) -> list[tuple[str, bytes | dict, int, str]]:
    """(path, body, status, message): bodies no server may accept, each with the error it must answer (the routes of
    runner/entrypoints/openai/ and the checks they call: protocol.parse_body and describe for the body's shape, then
    SamplingParams, the chat checks and EngineClient.submit)."""
    good = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4}
    not_json = "the request body is not valid JSON: "
    cases: list[tuple[str, bytes | dict, int, str]] = [
        ("/v1/completions", b"{not json", 400,
         not_json + "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("/v1/completions", b"", 400, not_json + "Expecting value: line 1 column 1 (char 0)"),
        ("/v1/completions", b"[]", 400, "the request body must be a JSON object, got list"),
        ("/v1/completions", b"\xff\xfe\x00bad utf-8", 400,
         "the request body is not valid UTF-8 (invalid start byte at byte 0)"),
        ("/v1/completions", b'{"prompt": "\xc3\x28"}', 400,
         "the request body is not valid UTF-8 (invalid continuation byte at byte 12)"),
        ("/v1/completions", b"null", 400, "the request body must be a JSON object, got NoneType"),
        ("/v1/completions", b"42", 400, "the request body must be a JSON object, got int"),
        ("/v1/completions", b'"a string"', 400, "the request body must be a JSON object, got str"),
        ("/v1/chat/completions", b"{not json", 400,
         not_json + "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("/v1/chat/completions", b"\xff\xfe", 400,
         "the request body is not valid UTF-8 (invalid start byte at byte 0)"),
        ("/tokenize", b"{oops", 400,
         not_json + "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("/detokenize", b"[1, 2", 400, not_json + "Expecting ',' delimiter: line 1 column 6 (char 5)"),
    ]

    def outside(where: str, token_id: int) -> str:
        return f"{where} holds token id {token_id}, outside the vocabulary [0, {vocab})"

    def too_long(prompt_len: int, max_tokens: int) -> str:
        return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the model's context of "
                f"{max_model_len} tokens")

    integer, number = "Input should be a valid integer", "Input should be a valid number"
    boolean, a_list = "Input should be a valid boolean", "Input should be a valid list"
    at_least_1 = "max_tokens must be at least 1 (0 only when scoring the prompt), got "
    logprobs = "logprobs must be between 0 and 20, got "  # requests.MAX_TOP_LOGPROBS
    wrong_values = {  # field -> (value, message) with the rest of `good`; all 400s but the unknown model's 404
        "prompt": [(None, ONE_OF_PROMPT), (5, ONE_OF_PROMPT), (5.5, ONE_OF_PROMPT), (True, ONE_OF_PROMPT),
                   ({}, ONE_OF_PROMPT), ([], "prompt is empty"), ([[]], "prompt is empty"), ("", "prompt is empty"),
                   ([""], "prompt is empty"), ([1.5], ONE_OF_PROMPT), ([-1], outside("prompt", -1)),
                   ([vocab], outside("prompt", vocab)), ([vocab + 10**6], outside("prompt", vocab + 10**6)),
                   ([[1], "a"], ONE_OF_PROMPT), ([[1, -2]], outside("prompt", -2)),
                   ([[vocab]], outside("prompt", vocab)), ({"a": 1}, ONE_OF_PROMPT), ([None], ONE_OF_PROMPT)],
        "max_tokens": [(-1, f"{at_least_1}-1"), (-100, f"{at_least_1}-100"),
                       ("4", f"max_tokens: {integer}"), (4.5, f"max_tokens: {integer}"),
                       ([], f"max_tokens: {integer}"), ({}, f"max_tokens: {integer}"),
                       (10**9, too_long(3, 10**9)), (2**63, too_long(3, 2**63)), (True, f"max_tokens: {integer}")],
        "temperature": [(-0.5, "temperature must be in [0, 100], got -0.5"), ("hot", f"temperature: {number}"),
                        ([], f"temperature: {number}"), (1e9, "temperature must be in [0, 100], got 1000000000.0")],
        "top_p": [(0, "top_p must be in (0, 1], got 0.0"), (-0.1, "top_p must be in (0, 1], got -0.1"),
                  (1.5, "top_p must be in (0, 1], got 1.5"), ("x", f"top_p: {number}")],
        "top_k": [(-5, "top_k must be -1 or 0 (off) or positive, got -5"), (1.5, f"top_k: {integer}"),
                  ("k", f"top_k: {integer}")],
        "n": [(129, "n must be between 1 and 128, got 129"), (0, "n must be between 1 and 128, got 0"),
              (-1, "n must be between 1 and 128, got -1"), ("2", f"n: {integer}")],
        "logprobs": [(-1, f"{logprobs}-1"), (21, f"{logprobs}21"), (100, f"{logprobs}100"),
                     ("1", f"logprobs: {integer}"), (1.5, f"logprobs: {integer}")],
        "seed": [("s", f"seed: {integer}"), (1.5, f"seed: {integer}"), ([], f"seed: {integer}")],
        "stop": [(5, "stop must be one of: str, list[str]"), ([5], "stop must be one of: str, list[str]"),
                 ({"a": 1}, "stop must be one of: str, list[str]")],
        "stream": [("yes", f"stream: {boolean}"), (2, f"stream: {boolean}"), ([], f"stream: {boolean}")],
        "echo": [("true", f"echo: {boolean}"), ([], f"echo: {boolean}")],
        "model": [("no-such-model", f"The model `no-such-model` does not exist; this server serves `{model}`."),
                  (5, "model: Input should be a valid string")],
        "stop_token_ids": [([-1], outside("stop_token_ids", -1)), ("x", f"stop_token_ids: {a_list}"),
                           ([1.5], f"stop_token_ids.0: {integer}")],
        "best_of": [([2], f"best_of: {integer}")],
        "presence_penalty": [([1.0], f"presence_penalty: {number}")],
        "frequency_penalty": [([1.0], f"frequency_penalty: {number}")],
        "stream_options": [("x", "stream_options: Input should be a valid dictionary or instance of StreamOptions"),
                           ({"include_usage": "x"}, f"stream_options.include_usage: {boolean}")],
        "ignore_eos": [("x", f"ignore_eos: {boolean}"), ([], f"ignore_eos: {boolean}")],
        # vLLM's extensions
        "repetition_penalty": [(0, "repetition_penalty must be in (0, 2.0], got 0.0"),
                               (2.5, "repetition_penalty must be in (0, 2.0], got 2.5"),
                               ("x", f"repetition_penalty: {number}")],
        "min_p": [(1.5, "min_p must be in [0, 1], got 1.5"), (-1, "min_p must be in [0, 1], got -1.0"),
                  ([], f"min_p: {number}")],
        "min_tokens": [(5, "min_tokens must be between 0 and max_tokens (4), got 5"),
                       (-1, "min_tokens must be between 0 and max_tokens (4), got -1"), (1.5, f"min_tokens: {integer}")],
        "use_beam_search": [(True, "use_beam_search=true is not supported: this server has no beam search"),
                            ("x", f"use_beam_search: {boolean}")],
        "truncate_prompt_tokens": [
            (0, "truncate_prompt_tokens must be -1 (the last max_model_len tokens) or at least 1, got 0"),
            (-5, "truncate_prompt_tokens must be -1 (the last max_model_len tokens) or at least 1, got -5"),
            ("x", f"truncate_prompt_tokens: {integer}")],
        "priority": [(1, "priority=1 needs --scheduling-policy priority (this server runs fcfs)"),
                     (1.5, f"priority: {integer}")],
        "skip_special_tokens": [("x", f"skip_special_tokens: {boolean}")],
        "include_stop_str_in_output": [(1, f"include_stop_str_in_output: {boolean}")],
        "add_special_tokens": [([], f"add_special_tokens: {boolean}")],
    }
    for field, values in wrong_values.items():
        for value, message in values:
            status = 404 if message.startswith("The model `") else 400
            cases.append(("/v1/completions", {**good, field: value}, status, message))
    cases.append(("/v1/completions", {k: v for k, v in good.items() if k != "prompt"}, 400, "prompt: Field required"))
    over_cache = cache_tokens + 100  # valid ids, over one DP rank's KV cache, which bounds max_model_len
    assert max_model_len <= cache_tokens
    cases.append(("/v1/completions", {**good, "prompt": [5] * over_cache}, 400, too_long(over_cache, 4)))
    cases.append(("/v1/completions", {**good, "max_tokens": max_model_len}, 400, too_long(3, max_model_len)))
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    roles = "supported roles: system, user, assistant, tool"
    for messages, message in (
            ([], "messages is empty: a conversation needs at least one user message"),
            (None, f"messages: {a_list}"), ("hi", f"messages: {a_list}"),
            ([{}], f"messages[0] has role=None; {roles}"),
            ([{"role": "user"}], "messages[0] (user) content must be text, got NoneType"),
            ([{"role": "nobody", "content": "x"}], f"messages[0] has role='nobody'; {roles}"),
            ([{"role": "user", "content": 5}], "messages[0] (user) content must be text, got int"),
            ([{"content": "x"}], f"messages[0] has role=None; {roles}"),
            ([[]], "messages[0] is a list, not a mapping with role and content"),
            ([{"role": "user", "content": None}], "messages[0] (user) content must be text, got NoneType")):
        cases.append(("/v1/chat/completions", {**chat, "messages": messages}, 400, message))
    for field, value, status, message in (
            ("max_tokens", -3, 400, f"{at_least_1}-3"),
            ("n", 0, 400, "n must be between 1 and 128, got 0"),
            ("temperature", -1, 400, "temperature must be in [0, 100], got -1.0"),
            ("model", "other", 404, f"The model `other` does not exist; this server serves `{model}`."),
            ("max_completion_tokens", -1, 400, f"{at_least_1}-1"),
            ("top_logprobs", 50, 400, "top_logprobs needs logprobs=true"),
            ("stream", "x", 400, f"stream: {boolean}")):
        cases.append(("/v1/chat/completions", {**chat, field: value}, status, message))
    for body, message in (({}, "give either prompt or messages"),
                          ({"prompt": 5}, "prompt: Input should be a valid string"),
                          ({"prompt": None}, "give either prompt or messages"),
                          ({"messages": "x"}, f"messages: {a_list}")):
        cases.append(("/tokenize", body, 400, message))
    for body, message in (({}, "tokens: Field required"), ({"tokens": "abc"}, f"tokens: {a_list}"),
                          ({"tokens": [-1]}, outside("tokens", -1)),
                          ({"tokens": [vocab + 5]}, outside("tokens", vocab + 5)),
                          ({"tokens": [1.5]}, f"tokens.0: {integer}")):
        cases.append(("/detokenize", body, 400, message))
    return cases


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}  # OpenAI's error types for these statuses


@pytest.mark.parametrize("case_name", ["v32-w1", "v4-w16"])
def test_malformed_requests_get_4xx_and_change_nothing(case_name, servers, tiny_source):
    family, _ = CASES[case_name]
    server = servers(case_name)
    (served,) = server.openai().models.list().data
    server.model = served.id
    ps = prompts(family, tiny_source)
    before = complete(server, ps[0])
    vocab = json.loads((tiny_source(family, "fp8") / "config.json").read_text())["vocab_size"]
    cases = malformed(vocab, server.model, served.max_model_len, int(FLAGS[FLAGS.index("--cache-tokens") + 1]))
    assert len(cases) >= 100
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, status, message in cases:
            if isinstance(body, bytes):
                response = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            got = (response.status_code, response.json())
            error = got[1]["error"]
            # the field at fault where the body's shape names one; OpenAI's code for an unknown model
            param = "model" if status == 404 else error["param"]
            assert param is None or message.startswith(param) or status == 404, (path, body, got)
            want = {"message": message, "type": ERROR_TYPES[status], "param": param,
                    "code": "model_not_found" if status == 404 else None}
            assert got == (status, {"error": want}), (path, body, got)
        got = http.get("/no/such/route")
        want = {"message": "GET /no/such/route: Not Found", "type": "not_found_error", "param": None, "code": None}
        assert (got.status_code, got.json()) == (404, {"error": want})
    assert complete(server, ps[0]) == before


# -- hostile bodies (issue 71): no input costs more than its own request --------------------------------------------

DEEP = 5000  # JSON nesting past Python's recursion limit (json.loads recurses once per level)
BIG = "x" * 2**20
STRINGS = ("a\ud800b", "\udfff", "a\x00b", BIG, "__DEEP__")  # lone surrogates, NUL, 1 MiB, deep nesting
OTHERS = (7, 1.5, True, None, [], {}, ["x", 1], {"a": "\ud800"})  # wrong types, and a surrogate one level down
TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def fuzz_cases(prompt: list[int]) -> list[tuple[str, list, object]]:
    """(route, path into the body, value) for every string field of chat and completion bodies: each field gets
    every hostile string and every wrong type; logit_bias gets them as its key."""
    chat = ["messages", 0, "content"], ["messages", 0, "name"], ["messages", 0, "role"], \
        ["tools", 0, "function", "name"], ["tools", 0, "function", "description"], \
        ["tools", 0, "function", "parameters"], ["response_format"], ["response_format", "json_schema", "schema"], \
        ["tool_choice"], ["chat_template_kwargs"]
    both = ["stop"], ["stop", 0], ["user"], ["cache_salt"], ["model"], ["kv_transfer_params"], \
        ["kv_transfer_params", "remote_hashes"], ["kv_transfer_params", "remote_engine_id"]
    cases = [(route, path, value) for route, paths in (("/v1/chat/completions", chat + both),
                                                       ("/v1/completions", (["prompt"], ["suffix"], *both)))
             for path in paths for value in STRINGS + OTHERS]
    cases += [(route, ["logit_bias", KEY], value) for route in ("/v1/chat/completions", "/v1/completions")
              for value in STRINGS[:4] + ("9" * 5000,)]
    return cases


KEY = object()  # in a path: the value is a key of the object before it


def fuzz_body(route: str, path: list, value, prompt: list[int]) -> bytes:
    """A normal body of `route` with `value` put at `path` (the containers on the way made as needed), as JSON with
    Python's escapes (a lone surrogate travels as \\ud800)."""
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [json.loads(json.dumps(TOOL))],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
    else:
        body = {"prompt": prompt}
    body.update(max_tokens=1, temperature=0, stop=["zz"])
    if path[0] == "kv_transfer_params":
        body["kv_transfer_params"] = {"do_remote_prefill": True}
    if path[-1] is KEY:
        body[path[0]] = {value: 1}
    else:
        *parents, last = path
        node = body
        for part in parents:
            node = node[part]
        node[last] = value
    text = json.dumps(body)
    return text.replace('"__DEEP__"', "[" * DEEP + "]" * DEEP).encode()


@pytest.mark.parametrize("case_name", ["v32-w1", "v4-w16"])
def test_hostile_bodies_cost_only_their_own_request(case_name, servers, tiny_source):
    """Issue 71's fuzzer: every string field of chat and completion bodies gets lone surrogates, NUL, 1 MiB, deep
    nesting and wrong types. No answer is a 5xx, the server never dies (the next case's connection would be
    refused), and a normal request gives its tokens after every field. Before the fix, a lone surrogate in cache_salt killed rank 0."""
    family, _ = CASES[case_name]
    server = servers(case_name)
    server.model = server.openai().models.list().data[0].id
    ps = prompts(family, tiny_source)
    normal = {"prompt": ps[0], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    cases, bad = fuzz_cases(ps[0]), []
    assert len(cases) > 300
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = http.post("/v1/completions", json=normal).json()["choices"][0]["text"]
        for i, (route, path, value) in enumerate(cases):
            try:  # a dead server refuses the next case's connection: every case checks the one before it
                response = http.post(route, content=fuzz_body(route, path, value, ps[0]),
                                     headers={"content-type": "application/json"})
            except httpx.TransportError as exc:
                raise AssertionError((i, route, path, repr(value)[:40], server.log())) from exc
            if response.status_code >= 500:
                bad.append((route, path, repr(value)[:40], response.status_code, response.text[:300]))
            if i + 1 == len(cases) or cases[i + 1][1] != path:  # the field's last case: the engine still serves
                after = http.post("/v1/completions", json=normal)
                assert after.status_code == 200 and after.json()["choices"][0]["text"] == before, (route, path)
    assert not bad, bad
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert "dsrun:request_failures_total" not in metrics or \
        not re.search(r"^dsrun:request_failures_total\{[^}]*\} [1-9]", metrics, re.M)


def kv_in_use(server) -> tuple[float, float]:
    """(sum of KV usage over DP ranks, running requests) from /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    usage = sum(float(v) for v in re.findall(r'^dsrun:kv_cache_usage_perc\{[^}]*\} (\S+)$', text, re.M))
    running = sum(float(v) for v in re.findall(r'^dsrun:num_requests_running\{[^}]*\} (\S+)$', text, re.M))
    return usage, running


@pytest.mark.parametrize("case_name", ["v32-w1", "v4-w16"])
def test_client_disconnect_frees_the_cache(case_name, servers, tiny_source):
    family, _ = CASES[case_name]
    server = servers(case_name)
    ps = prompts(family, tiny_source)
    body = {"prompt": ps[2], "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert next(line for line in lines if line.startswith("data:"))
            assert kv_in_use(server)[0] > 0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while kv_in_use(server) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"still in use after the disconnect: {kv_in_use(server)}"
        time.sleep(0.2)


def test_sigterm_finishes_requests_in_flight_and_exits_0(servers, tiny_source):
    server = servers("v32-w1")
    ps = prompts("deepseek_v32", tiny_source)
    body = {"prompt": ps[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, finish, usage = [], None, None
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                usage = chunk.get("usage") or usage
                if chunk["choices"]:
                    texts.append(chunk["choices"][0]["text"])
                    finish = chunk["choices"][0]["finish_reason"] or finish
                if len(texts) == 2:
                    server.proc.send_signal(15)  # SIGTERM once the request is under way
    assert finish == "length" and usage["completion_tokens"] == 40
    assert server.proc.wait(60) == 0, server.log()
    del servers.running["v32-w1"]


def test_killing_one_rank_ends_the_server(servers):
    server = servers("v4-w16")
    victim = next(p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if any(f.path.endswith("rank5.log") for f in p.open_files()))
    victim.kill()
    code = server.proc.wait(KILL_DEADLINE_S)
    del servers.running["v4-w16"]
    assert code != 0
    assert "rank 5 failed: killed by SIGKILL" in server.log()


@pytest.fixture(scope="module")
def chat_server(tiny_source, tmp_path_factory):
    """World 1 V4 with the real vocabulary, so chat prompts tokenize inside it."""
    shards = tmp_path_factory.mktemp("chat") / "v4-chat"
    shard(tiny_source("deepseek_v4", "fp8", real_vocab=True), shards, Layout(1, 1, 1, 1))
    server = Server(shards, shards.parent / "server.log", "--dtype", "float32")
    server.model = "v4-chat"
    yield server
    assert server.stop() == 0, server.log()


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_encodes_the_conversation_and_splits_reasoning(chat_server, tiny_source, thinking):
    from tokenizers import Tokenizer

    from dsconv.family.arch import family_for
    from dsconv.family.text import encode_chat_ids

    source = tiny_source("deepseek_v4", "fp8", real_vocab=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "介绍下北京故宫"}]
    config = json.loads((source / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = encode_chat_ids(tokenizer, family_for(config), messages, thinking, {})
    reference = AutoModelForCausalLM.from_pretrained(tiny_source("deepseek_v4", "bf16", real_vocab=True),
                                                     dtype=torch.float32).eval()
    response = chat_server.openai().chat.completions.create(
        model=chat_server.model, messages=messages, max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
        extra_body={"chat_template_kwargs": {"thinking": thinking}, "ignore_eos": True,
                    "return_tokens_as_token_ids": True})
    assert response.usage.prompt_tokens == len(ids)
    got = [int(TOKEN_ID.fullmatch(t.token).group(1)) for t in response.choices[0].logprobs.content]
    # Each token is transformers' argmax given the tokens before it, from one whole forward of prompt + reply.
    # (On this fixture transformers' forward over the first 15 tokens alone picked another 15th token than its
    # forward over 18 tokens did at the same position, which ours matched; so no use_cache=False generate here.)
    with torch.no_grad():
        logits = reference(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1]
    want = logits.argmax(dim=-1).tolist()
    assert len(got) == NEW_TOKENS and got == want
    message = response.choices[0].message
    text = tokenizer.decode(want, skip_special_tokens=True)
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if thinking:  # the reply opened with <think>: what comes before </think> is reasoning
        before, closed, after = text.partition("</think>")
        assert reasoning == before and message.content == (after if closed else None)
    else:
        assert message.content == text and reasoning is None


def test_v4_int8_kv_cache_server(tiny_source, tmp_path):
    """DeepSeek-V4 served with --kv-cache-dtype int8 (C8) in a byte budget, blocks of 64: the ready line gives the
    INT8 cache's blocks and sequence slots (with their prefix-caching state blocks, 2 MB a slot here), and a greedy
    completion's tokens equal the INT8 cache's in process."""
    from dsconv.runner.models.registry import build_model
    from dsconv.runner.models.dist import Dist
    from dsconv.runner.models.weights import load_manifest
    from tests.helpers import greedy

    shards = tmp_path / "v4-int8"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    prompt = list(range(5, 45))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    with torch.no_grad():
        want = greedy(model, new_cache(256, "int8", 64), [prompt], 6, eos_id=None)[0]
    server = Server(shards, tmp_path / "server.log", "--dtype", "float32", "--kv-cache-dtype", "int8",
                    "--kv-cache-memory-bytes", 40 << 20, "--block-size", "64")
    try:
        assert re.search(r"KV cache per attention-DP rank: \d+ blocks x 64 tokens = \d+ tokens, .* 16 sequence "
                         r"slots .* state blocks each for prefix hits.* MiB \(int8\)", server.log()), server.log()
        out = server.openai().completions.create(model="v4-int8", prompt=prompt, max_tokens=6, temperature=0,
                                                 logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        assert out.usage.completion_tokens == 6
        assert ids_of(out.choices[0]) == want
    finally:
        assert server.stop() == 0, server.log()


def test_int8_kv_cache_server_fills_its_byte_budget(tiny_source, tmp_path):
    """`--kv-cache-dtype int8 --kv-cache-memory-bytes B`: the server sizes its cache to as many whole blocks as
    B holds in the INT8 layout (what it reports when ready), more than twice what auto's float32 entries fit on
    CPU, and serves with it."""
    from dsconv.family.arch import family_for
    from dsconv.family.deepseek_v3 import cache_fields
    from dsconv.family.arch import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
    from dsconv.runner.models.kv_cache import LatentCache

    shards = tmp_path / "v32-int8"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(1, 1, 1, 1))
    config = json.loads((shards / "config.json").read_text())
    cfg = family_for(config).parse_config(config)
    budget = 3 << 20
    per_token = {kv: LatentCache(cfg.num_hidden_layers, 1, BLOCK_SIZE, cache_fields(cfg, kv), torch.float32, "meta")
                 .bytes_per_token for kv in ("auto", "int8")}
    tokens = budget // (per_token["int8"] * BLOCK_SIZE) * BLOCK_SIZE
    assert tokens > 2 * budget // per_token["auto"]
    server = Server(shards, tmp_path / "server.log", "--dtype", "float32", "--kv-cache-dtype", "int8",
                    "--kv-cache-memory-bytes", budget)
    try:
        blocks = tokens // BLOCK_SIZE
        line = f"KV cache per attention-DP rank: {blocks} blocks x {BLOCK_SIZE} tokens = {tokens} tokens, "
        assert line in server.log()
        assert "MiB (int8)" in server.log()
        out = server.openai().completions.create(model="v32-int8", prompt=list(range(5, 45)), max_tokens=4,
                                                 temperature=0)
        assert len(out.choices[0].text) > 0 and out.usage.completion_tokens == 4
    finally:
        assert server.stop() == 0, server.log()
