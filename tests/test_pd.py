"""Prefill/decode disaggregation end to end: `dsrun serve` producers (P) and consumers (D) over the Mooncake transfer
engine (TCP on loopback), behind `dsrun router`, driven by the openai client and langchain-openai in their defaults.

Exactness: float32 greedy tokens through the router equal transformers' with auto caches (tests/test_serve.py
holds one colocated instance to the same tokens), and with INT8 caches, and for chat with tools, those of one
colocated instance (no --kv-transfer-config) of the same shards. P and D run different layouts: with auto caches P
at world 4 (V3.2 with context-parallel prefill over the 4 ranks, V4 attention DP4) and D at world 16 (DP16, EP16);
with INT8 caches P at world 1 and D at world 2. The tiny models carry the real vocabulary (chat and tools need it);
block size 4 makes every prompt cross several blocks, and the prompts' lengths leave a partial last block and a full
one.

Trust: D reads only offers P signed with the key they share (engine/kv_auth.py): forged, altered, expired or
replayed kv_transfer_params sent straight to D are refused with a 400, nothing read and nothing posted anywhere; D
publishes what it read only once P says the lease held for the whole read (engine/kv_release.py).

Faults, each with its documented outcome and both sides' pools counted back to idle: a consumer that never comes
(the producer's lease ends), a producer killed before its blocks are read (the request fails with the transfer's
error, or is recomputed on D), a producer that never answers (the read's timeout), every backend of a router down
(503 in OpenAI's shape)."""

import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.errors import InputError
from dsconv.family.layout import Layout
from dsconv.runner.engine.block_pool import block_hashes
from dsconv.runner.engine.kv_auth import AuthKey
from dsconv.runner.engine.kv_transfer import Export, KVTransferConfig, LoadReport, Offer, RankRegions
from dsconv.runner.engine.request import SamplingParams, SeqResult
from tests.helpers import Server, shard
from tests.test_serve import expected_tokens, ids_of

pytestmark = pytest.mark.slow

FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "24", "--cache-tokens", "1024", "--block-size", "4")
# (family, P's world and flags, D's world, cache dtype)
CP4 = ("--prefill-context-parallel-size", "4", "--prefill-cp-min-tokens", "8")
CASES = {"v32-p4cp-d16-auto": ("deepseek_v32", 4, CP4, 16, "auto"),
         "v4-p4-d16-auto": ("deepseek_v4", 4, (), 16, "auto"),
         "v32-p1-d2-int8": ("deepseek_v32", 1, (), 2, "int8"), "v4-p1-d2-int8": ("deepseek_v4", 1, (), 2, "int8")}
BIG = ["v32-p4cp-d16-auto", "v4-p4-d16-auto"]
# INT8 caches, held to a colocated instance's INT8 tokens (transformers keeps no INT8 cache), and chat; the auto ones
# are held to transformers' tokens, which tests/test_serve.py holds a colocated instance to
SMALL = ["v32-p1-d2-int8", "v4-p1-d2-int8"]
LENGTHS = (23, 40)  # a partial last block; whole blocks (the last token is D's)
NEW_TOKENS = 6
ROUTER_START_S = 30
WEATHER = {"type": "function", "function": {  # one short argument: the call is a few dozen tokens
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "What is the weather in Paris this week?"}]


SECRET = "pd-test-secret-0123456789"  # the key every P and D of this module shares
KEY = AuthKey(SECRET.encode())


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"auth_key": SECRET, **extra}})


def resigned(params: dict, key: AuthKey = KEY, **changes) -> dict:
    """P's params changed and signed again with a lease of a minute from now (as a producer holding the key would)."""
    changed = {**params, "expires_at": time.time() + 60, **changes}
    return {**Offer.from_params(changed).signed(key).params(), "do_remote_prefill": True}


class Listener:
    """A tiny HTTP server on loopback: GET /v1/models names `model`, every POST is answered `status`; `received`
    records each request's path (a forged offer must make D send it nothing)."""

    def __init__(self, status: int = 503, model: str = "m"):
        self.received: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                outer.received.append(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(status, {"error": {"message": "draining", "type": "unavailable", "param": None,
                                                "code": status}})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Router:
    """`dsrun router --port 0` as a subprocess, ready when constructed."""

    def __init__(self, log_path, prefill: list[str], decode: list[str]):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(router_command(prefill, decode), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_START_S
        while not (bound := re.search(r"dsrun router: on (http://\S+),", log_path.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        self.url = bound.group(1)

    def openai(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def router_command(prefill: list[str], decode: list[str]) -> list[str]:
    args = [a for url in prefill for a in ("--prefill", url)] + [a for url in decode for a in ("--decode", url)]
    return [sys.executable, "-m", "dsconv.runner.cli", "router", "--port", "0", *args]


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) on a server's /metrics (a counter's `_total`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(tuple(name + suffix + end for suffix in ("", "_total") for end in "{ ")))


def idle(server) -> bool:
    """Every DP rank's pool idle (published blocks nobody holds count as free) and no lease held."""
    return metric(server.url, "dsrun:kv_cache_usage_perc") == 0 and metric(server.url, "dsrun:kv_transfer_leases") == 0


def wait_until(check, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def started(*servers: tuple) -> list[Server]:
    """Servers (Server's arguments each) started side by side -> them, each ready."""
    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(lambda args: Server(*args), servers))


@pytest.fixture(scope="module")
def deployments(tiny_source, tmp_path_factory):
    """deployments(case) -> (P, D, colocated, router), started on first use, stopped at the end."""
    running: dict[str, tuple] = {}
    shards: dict[tuple[str, int], object] = {}

    def shards_of(family, world):
        if (family, world) not in shards:
            out = tmp_path_factory.mktemp(f"{family}-w{world}") / f"{family}-w{world}"
            shard(tiny_source(family, "fp8", real_vocab=True), out, Layout(world, world, world, 1))
            shards[family, world] = out
        return shards[family, world]

    def get(case: str):
        if case not in running:
            family, p_world, p_flags, d_world, dtype = CASES[case]
            root = tmp_path_factory.mktemp(case)
            flags = (*FLAGS, "--kv-cache-dtype", dtype, "--served-model-name", family)  # one name for the router
            colocated = [(shards_of(family, 1), root / "c.log", *flags)] if case in SMALL else []
            p, d, *c = started(
                (shards_of(family, p_world), root / "p.log", *flags, *p_flags, "--kv-transfer-config",
                 kv_config("kv_producer")),
                (shards_of(family, d_world), root / "d.log", *flags, "--kv-transfer-config", kv_config("kv_consumer")),
                *colocated)
            for server in (p, d, *c):
                server.model = server.openai().models.list().data[0].id
            running[case] = (p, d, c[0] if c else None, Router(root / "router.log", [p.url], [d.url]))
        return running[case]

    yield get
    servers = [server for deployment in running.values() for server in deployment if server is not None]
    for server in servers:  # SIGTERM to all at once, then the exit codes
        server.proc.send_signal(signal.SIGTERM)
    for server in servers:
        assert server.proc.wait(60) == 0, server.log() if isinstance(server, Server) else server.log_path.read_text()


@pytest.fixture(scope="module")
def reference(tiny_source):
    models = {}

    def get(family):
        if family not in models:
            models[family] = AutoModelForCausalLM.from_pretrained(tiny_source(family, "bf16", real_vocab=True),
                                                                  dtype=torch.float32).eval()
        return models[family]

    return get


def prompts(family: str, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(family) + seed)
    return [torch.randint(2, 129280, (n,), generator=gen).tolist() for n in LENGTHS]


def complete(server, model, prompt, **extra):
    """Greedy token ids of a prompt, through a router or from a server."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    out = server.openai().completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                                             logprobs=0, extra_body=body, **extra)
    return [ids_of(c) for c in sorted(out.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_through_the_router_equals_transformers(case, deployments, reference):
    """INT8 caches against the colocated instance's INT8 cache (transformers keeps no INT8 cache); auto ones against
    both."""
    p, d, c, router = deployments(case)
    family, dtype = CASES[case][0], CASES[case][4]
    received = metric(d.url, "dsrun:kv_transfer_received_tokens")
    for prompt in prompts(family):  # one request each: every prompt is handed over on its own
        got = complete(router, d.model, prompt)
        if c is not None:
            assert got == complete(c, c.model, prompt)
        if dtype == "auto":
            assert got == [expected_tokens(reference(family), prompt, NEW_TOKENS)]
    # D received every full block but the one holding the last token, and computed only the rest
    assert metric(d.url, "dsrun:kv_transfer_received_tokens") - received == sum((n - 1) // 4 * 4 for n in LENGTHS)
    assert metric(d.url, "dsrun:kv_transfer_failures") == 0 and metric(d.url, "dsrun:kv_transfer_bytes") > 0
    if case == "v32-p4cp-d16-auto":
        assert metric(p.url, "dsrun:context_parallel_prefills") >= 2  # the two longer prompts, over P's 4 ranks
    assert wait_until(lambda: idle(p) and idle(d)), "the pools did not return to idle"  # D confirmed to P


@pytest.mark.parametrize("case", BIG)
def test_prefix_hits_on_both_sides(case, deployments, reference):
    """The same prompt again: P computes only its last block (its prefix cache), D holds every block already and
    receives none. A prompt extending it: D receives only the blocks past what it holds."""
    p, d, c, router = deployments(case)
    family = CASES[case][0]
    prompt = prompts(family, seed=1)[1]  # 40 tokens: 9 blocks handed over

    def expected_of(ids):
        return complete(c, c.model, ids) if c is not None else [expected_tokens(reference(family), ids, NEW_TOKENS)]

    expected = expected_of(prompt)
    assert complete(router, d.model, prompt) == expected
    hits, received = metric(p.url, "dsrun:prefix_cache_hits"), metric(d.url, "dsrun:kv_transfer_received_tokens")
    assert complete(router, d.model, prompt) == expected
    assert metric(p.url, "dsrun:prefix_cache_hits") - hits == 36  # P: every full block but the last token's
    assert metric(d.url, "dsrun:kv_transfer_received_tokens") == received  # D: nothing new to receive
    longer = prompt + prompts(family, seed=2)[0]  # 40 + 23 tokens
    assert complete(router, d.model, longer) == expected_of(longer)
    assert metric(d.url, "dsrun:kv_transfer_received_tokens") - received == (len(longer) - 1) // 4 * 4 - 40
    assert wait_until(lambda: idle(p) and idle(d))


def tool_calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or ()]


@pytest.mark.parametrize("case", SMALL)  # a call is ~100 tokens: decoded at world 2, not 16
def test_chat_n_streaming_and_a_tool_call_equal_a_colocated_instance(case, deployments):
    p, d, c, router = deployments(case)
    ask = dict(messages=MESSAGES, tools=[WEATHER], tool_choice="required", temperature=0.0, max_tokens=160, n=2)
    alone = c.openai().chat.completions.create(model=c.model, **ask)
    calls, names, usage = {}, {}, None  # streamed through the router: each choice's call, in pieces
    for chunk in router.openai().chat.completions.create(model=d.model, stream=True,
                                                        stream_options={"include_usage": True}, **ask):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                names[choice.index] = names.get(choice.index) or call.function.name
                calls[choice.index] = calls.get(choice.index, "") + (call.function.arguments or "")
    assert [[(names[i], json.loads(calls[i]))] for i in sorted(calls)] == \
        [tool_calls(choice.message) for choice in alone.choices]
    assert names == {0: "get_weather", 1: "get_weather"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (alone.usage.prompt_tokens, alone.usage.completion_tokens)
    assert wait_until(lambda: idle(p) and idle(d))


@pytest.mark.parametrize("case", SMALL[:1])
def test_langchain_openai_through_the_router(case, deployments):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel
    from typing import Literal

    class Weather(BaseModel):
        """The weather of a city."""
        city: Literal["Paris", "Lima"]

    p, d, c, router = deployments(case)

    def ask(url, model):  # the client in its defaults; the call asked for, so that random weights end it
        llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", temperature=0)
        return llm.bind_tools([Weather], tool_choice="required").invoke("Weather in Paris?").tool_calls

    via = ask(router.url, d.model)
    assert [call["name"] for call in via] == ["Weather"]
    assert [(call["name"], call["args"]) for call in via] == \
        [(call["name"], call["args"]) for call in ask(c.url, c.model)]
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert "dsrun:router_requests" in httpx.get(f"{router.url}/metrics").text


@pytest.mark.parametrize("case", SMALL[:1])
def test_a_batch_completion_hands_each_prompt_over(case, deployments):
    """Two prompts in one request: P hands each over ({"prompts": [...]}), D reads each its own."""
    p, d, c, router = deployments(case)
    batch = prompts(CASES[case][0], seed=3)
    received = metric(d.url, "dsrun:kv_transfer_received_tokens")
    assert complete(router, d.model, batch) == [complete(c, c.model, prompt)[0] for prompt in batch]
    assert metric(d.url, "dsrun:kv_transfer_received_tokens") - received == sum((n - 1) // 4 * 4 for n in LENGTHS)
    assert wait_until(lambda: idle(p) and idle(d))


@pytest.mark.parametrize("case", SMALL[:1])
def test_a_prefill_instance_that_fails_is_skipped(case, deployments):
    """A P answering 503 (draining): the request goes to the next P, or with none left to D alone; both counted."""
    from starlette.testclient import TestClient

    from dsconv.runner.entrypoints.router import create_app

    p, d, c, _ = deployments(case)
    prompt = prompts(CASES[case][0], seed=4)[0]
    expected = complete(c, c.model, prompt)
    draining = Listener(503)
    body = {"model": d.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    try:
        for prefill, counter in (([draining.url, p.url], ("dsrun:router_requests_total{", 'outcome="failed"')),
                                 ([draining.url], ("dsrun:router_prefill_fallbacks_total ", ""))):
            with TestClient(create_app(prefill, [d.url], 120)) as client:
                reply = client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert [[int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]] \
                    == expected
                counted = [line for line in client.get("/metrics").text.splitlines()
                           if line.startswith(counter[0]) and counter[1] in line]
                assert counted and float(counted[0].rsplit(" ", 1)[1]) == 1, counted
        assert len(draining.received) == 2  # one try each
    finally:
        draining.close()
    assert wait_until(lambda: idle(p) and idle(d))


def test_a_router_over_instances_of_different_models_refuses_to_start():
    a, b = Listener(model="deepseek_v32"), Listener(model="other")
    try:
        proc = subprocess.run(router_command([a.url], [b.url]), capture_output=True, text=True, timeout=120)
    finally:
        a.close()
        b.close()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "serve different models" in lines[0], proc.stderr


# -- faults ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_shards(tiny_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "v32-w1"
    shard(tiny_source("deepseek_v32", "fp8"), out, Layout(1, 1, 1, 1))
    return out


def handed_over(p, prompt) -> dict:
    """P's kv_transfer_params for a prompt, as a router gets them."""
    reply = httpx.post(f"{p.url}/v1/completions", json={"model": p.openai().models.list().data[0].id,
                                                         "prompt": prompt, "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    return {**reply.json()["kv_transfer_params"], "do_remote_prefill": True}


def to_consumer(d, prompt, params):
    """A greedy completion on one server (with P's params, or None: computed there)."""
    body = {"model": d.openai().models.list().data[0].id, "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, **({"kv_transfer_params": params} if params else {})}
    return httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)


LEASE_S = 6  # P's lease in test_faults: long enough for a read and its release on a slow CPU, short to wait out


def forgeries(params: dict, listener: Listener) -> dict[str, dict]:
    """P's params for a prompt, altered as a client reaching D could alter them (kept unsigned, or signed with
    another key)."""
    first = params["remote_ranks"][0]
    elsewhere = [{**first, "session": listener.url.removeprefix("http://")}]
    return {"another session": {**params, "remote_ranks": elsewhere},
            "other block ids": {**params, "remote_blocks": [b + 1 for b in params["remote_blocks"]]},
            "another remote_url": {**params, "remote_url": listener.url},
            "an altered hash list": {**params, "remote_hashes": params["remote_hashes"][::-1]},
            "a longer lease": {**params, "expires_at": params["expires_at"] + 3600},
            "another key": resigned(params, AuthKey(b"not-the-shared-key-0123"), remote_url=listener.url)}


def refused(d, prompt, params, needle: str) -> None:
    reply = to_consumer(d, prompt, params)
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text


def test_faults(fault_shards, tmp_path):
    asked = [list(range(start, start + 40)) for start in (5, 50, 95)]  # one per consumer that must read it
    p, fail, recompute = started(
        (fault_shards, tmp_path / "p.log", *FLAGS, "--kv-transfer-config",
         kv_config("kv_producer", lease_s=LEASE_S)),
        (fault_shards, tmp_path / "fail.log", *FLAGS, "--kv-transfer-config",
         kv_config("kv_consumer", transfer_timeout_s=1)),
        (fault_shards, tmp_path / "recompute.log", *FLAGS, "--kv-transfer-config",
         kv_config("kv_consumer", kv_load_failure_policy="recompute")))
    listener = Listener()
    try:
        # the answers computed in one place (P serves plain requests too), and one handed over
        expected = [to_consumer(p, prompt, None).json()["choices"][0]["text"] for prompt in asked]
        params = handed_over(p, asked[0])
        for name, forged in forgeries(params, listener).items():  # straight to D: nothing read, nothing posted
            refused(recompute, asked[0], forged, "not signed by a producer sharing this server's auth key")
        assert metric(recompute.url, "dsrun:kv_transfer_bytes") == 0 and idle(recompute) and listener.received == []
        good = to_consumer(recompute, asked[0], params)
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected[0], good.text
        assert metric(recompute.url, "dsrun:kv_transfer_received_tokens") == 36
        read = metric(recompute.url, "dsrun:kv_transfer_bytes")
        refused(recompute, asked[0], params, "already taken")  # a replayed offer
        assert wait_until(lambda: idle(p))

        # a consumer that never comes: the producer's lease ends and its blocks go back; the offer is then refused
        params = handed_over(p, asked[0])
        assert metric(p.url, "dsrun:kv_transfer_leases") == 1
        assert wait_until(lambda: idle(p), timeout=3 * LEASE_S)
        assert metric(p.url, "dsrun:kv_transfer_leases_expired") == 1
        refused(recompute, asked[0], params, "has ended")
        assert metric(recompute.url, "dsrun:kv_transfer_bytes") == read and listener.received == []

        # a producer killed before its blocks are read: fail (a clear error) or recompute (the right text); the
        # test signs again for the dead P, so that its slowness cannot end the leases first
        params = [resigned(handed_over(p, prompt)) for prompt in asked[1:]]
        for process in [*psutil.Process(p.proc.pid).children(recursive=True), p.proc]:
            process.kill()  # the ranks too: a rank holds the transfer engine
        p.proc.wait(30)
        failed = to_consumer(fail, asked[1], params[0])
        assert failed.status_code == 500 and "the KV cache transfer failed" in failed.json()["error"]["message"]
        assert failed.json()["error"]["type"]
        redone = to_consumer(recompute, asked[2], params[1])
        assert redone.status_code == 200 and redone.json()["choices"][0]["text"] == expected[2]
        assert metric(fail.url, "dsrun:kv_transfer_failures") == 1
        assert metric(recompute.url, "dsrun:kv_transfer_failures") == 1

        # a producer that never answers: the read's own timeout
        with socket.socket() as hole:
            hole.bind(("127.0.0.1", 0))
            hole.listen()
            silent = resigned(params[1], transfer_id="silent", remote_ranks=[
                {**r, "session": f"127.0.0.1:{hole.getsockname()[1]}"} for r in params[1]["remote_ranks"]])
            began = time.monotonic()
            slow = to_consumer(fail, asked[2], silent)
            assert slow.status_code == 500 and "took longer than 1 s" in slow.json()["error"]["message"], slow.text
            assert time.monotonic() - began < 20
        for server in (fail, recompute):
            assert wait_until(lambda: idle(server)), server.log()
    finally:
        listener.close()
        for server in (p, fail, recompute):
            if server.proc.poll() is None:
                server.stop()


def test_router_with_every_backend_down(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: connections are refused
        router = Router(tmp_path / "router.log", [url], [url])
        try:
            reply = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert reply.status_code == 503
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
            assert httpx.get(f"{router.url}/health").status_code == 503
            with pytest.raises(openai.APIStatusError) as raised:
                router.openai().completions.create(model="m", prompt="hi", max_tokens=2)
            assert raised.value.status_code == 503
        finally:
            assert router.stop() == 0


@pytest.mark.parametrize("config,needle", [
    ("{", "--kv-transfer-config is not JSON"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "kv_connector 'NixlConnector' is not one"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}', "kv_role 'kv_both' is not kv_producer"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": []}',
     "kv_connector_extra_config must be a JSON object"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"lease": 1}}',
     "unknown kv_connector_extra_config key 'lease'"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     f'{{"lease_s": -1, "auth_key": "{SECRET}"}}}}', "lease_s must be a positive number"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
     f'{{"kv_load_failure_policy": "retry", "auth_key": "{SECRET}"}}}}',
     "kv_load_failure_policy 'retry' is not fail or recompute"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}',
     'P/D hand-overs are signed: give P and D one shared secret of at least 16 bytes in kv_connector_extra_config: '
     '"auth_key_file"'),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
     '{"auth_key": "short-secret"}}', "the key from auth_key is 12 bytes"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
     '{"auth_key_env": "DSRUN_TEST_UNSET_KEY"}}', "auth_key_env names 'DSRUN_TEST_UNSET_KEY', which is not set"),
])
def test_bad_kv_transfer_config(config, needle):
    with pytest.raises(InputError, match=re.escape(needle)) as raised:
        KVTransferConfig.parse(config)
    assert "\n" not in str(raised.value) and "short-secret" not in str(raised.value)


def test_the_key_comes_from_a_file_or_the_environment_and_is_never_shown(tmp_path, monkeypatch):
    (tmp_path / "key").write_text(SECRET + "\n")
    monkeypatch.setenv("DSRUN_TEST_KEY", SECRET)
    configs = [KVTransferConfig.parse(kv_config("kv_consumer") if source == "auth_key" else json.dumps(
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {source: value}}))
        for source, value in (("auth_key", SECRET), ("auth_key_file", str(tmp_path / "key")),
                              ("auth_key_env", "DSRUN_TEST_KEY"))]
    assert all(config.key == KEY for config in configs)
    assert all(SECRET not in text for config in configs for text in (repr(config), config.summary, str(config)))


@pytest.mark.parametrize("role,needle", [("kv_both", "kv_role 'kv_both'"),
                                         ("kv_consumer", "P/D hand-overs are signed: give P and D one shared secret")])
def test_bad_kv_transfer_config_is_one_line_and_exit_2(fault_shards, role, needle):
    """As `dsrun serve` meets it: before any rank starts (a config without a key included)."""
    proc = subprocess.run([sys.executable, "-m", "dsconv.runner.cli", "serve", "--shards", str(fault_shards),
                           "--port", "0", "--kv-transfer-config", '{"kv_connector": "MooncakeConnector", '
                           f'"kv_role": "{role}"}}'], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


# -- the block pools' side, on rank 0's scheduler alone -------------------------------------------------------------


def pd_scheduler(role: str, policy: str = "fail", lease_s: float = 30.0, ended: list | None = None):
    """A scheduler of two DP ranks with a P/D connector of `role`; ended: where a consumer records the leases it
    ends ((transfer id, the answer's callback or None)) instead of asking a producer over HTTP."""
    from dsconv.runner.engine.config import SchedulerConfig
    from dsconv.runner.engine.kv_connector.pd import ConsumerConnector, ProducerConnector
    from dsconv.runner.engine.scheduler import PoolShape, Scheduler

    config = KVTransferConfig(role, KEY, lease_s=lease_s, load_failure_policy=policy, release_url="http://p")
    if role == "kv_producer":
        connector = ProducerConnector(config, [(RankRegions(f"host:{index}", (), ()),) for index in range(2)])
    else:
        record = ended if ended is not None else []
        connector = ConsumerConnector(config, 2, end=lambda offer, on_answer=None: record.append(
            (offer.transfer_id, on_answer)))
    return Scheduler(SchedulerConfig(kv_transfer=config), PoolShape(2, 16, 4, prefix_caching=True),
                     connector=connector)


def produced(prompt: list[int], lease_s: float = 0.5) -> tuple[object, dict]:
    """A producer's scheduler after one handed-over request ran -> (it, the request's kv_transfer_params)."""
    from tests.test_scheduler import fake_results

    producer = pd_scheduler("kv_producer", lease_s=lease_s)
    producer.add("r", prompt, SamplingParams(max_tokens=1, kv_transfer=Export()), None)
    while (step := producer.schedule()) is not None:
        outputs = producer.update(step, fake_results(step))
    return producer, outputs[-1][1].connector_params


def closed(producer, transfer_id: str, now: float | None = None) -> bool:
    """The producer's loop closes a lease a consumer ended (at `now`) -> whether it held until then."""
    return producer.connector.close(transfer_id, time.monotonic() if now is None else now, producer.ranks)


def test_a_producer_leases_the_prompts_full_blocks_until_confirmed_or_expired():
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks handed over (the 4th block holds the last token)
    producer, params = produced(prompt)
    pool = producer.ranks[0].blocks
    assert len(params["remote_blocks"]) == 3 and params["remote_hashes"] == [h.hex() for h in
                                                                             block_hashes(prompt, 4)[:3]]
    assert pool.num_free == pool.num_blocks - 3 and len(producer.connector.leases) == 1  # held: never given out
    assert closed(producer, params["transfer_id"]) and pool.num_free == pool.num_blocks
    assert not closed(producer, params["transfer_id"])  # a second confirmation changes nothing
    producer, params = produced(prompt)
    _, wait, _ = producer.poll(time.monotonic())
    assert wait is not None and producer.ranks[0].blocks.num_free == 13
    _, wait, changed = producer.poll(time.monotonic() + 1)
    assert wait is None and changed and producer.connector.leases_expired == 1
    assert producer.ranks[0].blocks.num_free == producer.ranks[0].blocks.num_blocks


@pytest.mark.parametrize("outcome", ["read", "fail", "recompute"])
def test_a_consumer_reads_only_what_it_lacks_and_frees_all_on_failure(outcome):
    prompt = list(range(10, 23))
    _, params = produced(prompt)
    ended = []
    consumer = pd_scheduler("kv_consumer", policy="recompute" if outcome == "recompute" else "fail", ended=ended)
    offer = Offer.from_params({**params, "do_remote_prefill": True})
    outputs = []
    request = consumer.add("d", prompt, SamplingParams(max_tokens=2, kv_transfer=offer), outputs.append, dp_rank=1)
    (load,) = consumer.connector.sends[1]
    assert [src for src, _ in load.blocks] == params["remote_blocks"] and not consumer.ranks[1].waiting
    step = consumer.schedule()
    assert step.batches[1].kv.loads == (load,) and not step.batches[1].seq_ids  # read first, computed next step
    error = None if outcome == "read" else "the peer is gone"
    failed = consumer.reported([LoadReport(request.seq_id, error, 0.01, 0 if error else 123)])
    consumer.update(step, [[], []])
    (transfer_id, on_answer), = ended  # arrived: P is asked whether the lease held; failed: P just lets go
    assert transfer_id == offer.transfer_id and (on_answer is not None) == (error is None)
    if error is None:
        assert consumer.schedule() is None and consumer.connector.confirming  # nothing runs before P's answer
        on_answer(True, "")
        assert not consumer.poll(time.monotonic())[0]
    pool = consumer.ranks[1].blocks
    if outcome == "fail":
        assert failed[0][1].finished and "the KV cache transfer failed: the peer is gone" in failed[0][1].error
        assert pool.num_free == pool.num_blocks and not consumer.has_work
        return
    assert not failed
    step = consumer.schedule()  # the request starts: a hit of 12 tokens when read, its whole prompt otherwise
    assert step.batches[1].context_lens == [13] and step.batches[1].num_tokens == (1 if outcome == "read" else 13)
    assert consumer.connector.received_tokens == (12 if outcome == "read" else 0)
    # a second request of the same prompt reads nothing: the blocks are the pool's (read or computed)
    consumer.update(step, [[], [SeqResult(5, None)]])
    again = consumer.add("e", prompt, SamplingParams(max_tokens=1, kv_transfer=offer), outputs.append, dp_rank=1)
    assert again.seq_id not in consumer.connector.plans and not consumer.connector.sends[1]


def test_an_offer_of_other_tokens_or_block_size_is_refused():
    prompt = list(range(10, 23))
    _, params = produced(prompt)
    consumer = pd_scheduler("kv_consumer")
    offer = Offer.from_params({**params, "do_remote_prefill": True})
    with pytest.raises(InputError, match="not this prompt's"):
        consumer.check_kv([1, *prompt[1:]], SamplingParams(max_tokens=1, kv_transfer=offer))
    with pytest.raises(InputError, match="the producer's blocks are 8 tokens, this server's 4"):
        consumer.check_kv(prompt, SamplingParams(max_tokens=1, kv_transfer=dataclasses.replace(
            offer, block_size=8).signed(KEY)))
    with pytest.raises(InputError, match="kv_transfer_params for a kv_producer: this server is kv_consumer"):
        consumer.check_kv(prompt, SamplingParams(max_tokens=1, kv_transfer=Export()))
    with pytest.raises(InputError, match="lacks 'remote_blocks'"):
        Offer.from_params({k: v for k, v in params.items() if k != "remote_blocks"})


def test_a_consumer_refuses_forged_expired_or_replayed_offers():
    """Each refused before anything is taken: no blocks, no read queued (the live forms: test_faults)."""
    prompt = list(range(10, 23))
    _, params = produced(prompt, lease_s=30)
    consumer = pd_scheduler("kv_consumer")
    first = params["remote_ranks"][0]

    def check(raw: dict, needle: str) -> None:
        offer = Offer.from_params(raw)
        with pytest.raises(InputError, match=re.escape(needle)):
            consumer.check_kv(prompt, SamplingParams(max_tokens=1, kv_transfer=offer))

    for forged in ({**params, "remote_ranks": [{**first, "session": "evil:1"}]},
                   {**params, "remote_blocks": [b + 1 for b in params["remote_blocks"]]},
                   {**params, "remote_url": "http://evil"},
                   {**params, "remote_hashes": params["remote_hashes"][::-1]},
                   {**params, "signature": "0" * 64}, resigned(params, AuthKey(b"not-the-shared-key-0123"))):
        check(forged, "not signed by a producer sharing this server's auth key")
    check(resigned(params, expires_at=time.time() - 1), "has ended")
    consumer.check_kv(prompt, SamplingParams(max_tokens=1, kv_transfer=Offer.from_params(params)))
    check(params, f"transfer {params['transfer_id']} was already taken")
    assert not consumer.connector.sends[0] and not consumer.connector.sends[1] and not consumer.has_work


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_lease_that_ends_during_the_read_is_never_published(policy):
    """P's lease ends while D reads (a fake clock: P is asked after it): P says so, and D publishes nothing; `fail`
    ends the request with the transfer's error, `recompute` computes the whole prompt."""
    prompt = list(range(10, 23))
    producer, params = produced(prompt, lease_s=30)
    ended = []
    consumer = pd_scheduler("kv_consumer", policy=policy, ended=ended)
    offer = Offer.from_params(params)
    request = consumer.add("d", prompt, SamplingParams(max_tokens=2, kv_transfer=offer), None, dp_rank=1)
    step = consumer.schedule()
    assert not consumer.reported([LoadReport(request.seq_id, None, 0.01, 123)])
    consumer.update(step, [[], []])
    (_, on_answer), = ended
    assert on_answer is not None  # arrived: P is asked
    held = closed(producer, offer.transfer_id, now=time.monotonic() + 31)  # the read outlived the lease
    assert not held and producer.connector.leases_expired == 1
    assert producer.ranks[0].blocks.num_free == producer.ranks[0].blocks.num_blocks  # P may give them to anyone now
    on_answer(held, "the producer's lease ended before the read did")
    outputs, _, _ = consumer.poll(time.monotonic())
    pool = consumer.ranks[1].blocks
    assert pool.match(block_hashes(prompt, 4)[:3]) == []  # never published under the prompt's hashes
    assert consumer.connector.load_failures == 1 and consumer.connector.received_tokens == 0
    if policy == "fail":
        assert [out.error for _, out in outputs] == ["the KV cache transfer failed: the producer's lease ended "
                                                     "before the read did"]
        assert pool.num_free == pool.num_blocks and not consumer.has_work
        return
    assert not outputs
    step = consumer.schedule()
    assert step.batches[1].context_lens == [13] and step.batches[1].num_tokens == 13  # the whole prompt computed


def test_a_producer_answers_held_only_while_the_lease_runs():
    prompt = list(range(10, 23))
    producer, params = produced(prompt, lease_s=30)
    assert closed(producer, params["transfer_id"])  # in time: held for the whole read
    assert not closed(producer, params["transfer_id"])  # ended: nothing held any more
    producer, params = produced(prompt, lease_s=30)
    expires = producer.connector.leases[params["transfer_id"]].expires
    assert not closed(producer, params["transfer_id"], now=expires)  # ended, not yet closed by the loop


def test_a_producer_answers_from_any_thread_while_its_loop_is_busy():
    """The release is answered on P's HTTP thread from the leases' ends the connector recorded when it opened them,
    so a long step of P's never makes a lease that held look ended; the loop frees the blocks at its next turn."""
    prompt = list(range(10, 23))
    producer, held = produced(prompt, lease_s=30)
    release = producer.connector.release
    assert release(held["transfer_id"]) and not release(held["transfer_id"])  # once only
    assert not release("unknown")
    pool = producer.ranks[0].blocks
    assert pool.num_free == pool.num_blocks - 3  # the loop has not turned yet
    producer.poll(time.monotonic())
    assert pool.num_free == pool.num_blocks and not producer.connector.leases
    ended, params = produced(prompt, lease_s=0.01)
    time.sleep(0.02)
    assert not ended.connector.release(params["transfer_id"])  # past its end, not closed by the loop yet
    ended, params = produced(prompt, lease_s=0.01)
    time.sleep(0.02)
    ended.poll(time.monotonic())
    assert not ended.connector.leases and not ended.connector.release(params["transfer_id"])  # closed at its end


# -- the read, between two transfer engines of this process ---------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_read_moves_the_blocks_whole_in_parts(monkeypatch, kv_cache_dtype):
    """A consumer's read of three blocks (every field and layer, INT8 with its scales) from a producer's cache, in
    parts of one block's bytes: the blocks arrive equal, the others untouched; a bad unit fails and moves nothing."""
    from dsconv.comm.kv_transfer import TransferAgent
    from dsconv.family.deepseek_v3 import cache_fields, tiny_config
    from dsconv.family.deepseek_v3_config import parse_config
    from dsconv.runner.engine import kv_transfer
    from dsconv.runner.engine.kv_transfer import Load, rank_regions, run_load
    from dsconv.runner.models.kv_cache import LatentCache

    cfg = parse_config(tiny_config("deepseek_v32"))
    fields = cache_fields(cfg, kv_cache_dtype)
    theirs, ours = (LatentCache(cfg.num_hidden_layers, 8, 4, fields, torch.float32) for _ in range(2))
    for stored in theirs.data.values():
        stored.copy_(torch.randint(-100, 100, stored.shape).to(stored.dtype))
    producer, consumer = TransferAgent("127.0.0.1"), TransferAgent("127.0.0.1")
    regions = rank_regions(producer, theirs)
    monkeypatch.setattr(kv_transfer, "STAGING_BYTES", sum(r.unit_bytes for r in regions.blocks))  # a block a part
    pairs = ((5, 0), (1, 2), (6, 3))
    report = run_load(consumer, ours.transfer_views(), Load(7, (regions,), pairs, (), 5.0), 0)
    assert report.error is None and report.bytes == 3 * sum(r.unit_bytes for r in regions.blocks)
    for stored, copied in zip(theirs.data.values(), ours.data.values()):
        blocks = stored.view(stored.shape[0], -1, 4, stored.shape[2])
        got = copied.view(copied.shape[0], -1, 4, copied.shape[2])
        for src, dst in pairs:
            assert torch.equal(got[:, dst], blocks[:, src])
        assert not got[:, [1, 4, 5, 6, 7]].any()  # nothing else written
    bad = run_load(consumer, ours.transfer_views(), Load(8, (regions,), ((9, 1),), (), 5.0), 0)
    assert "outside the producer's cache" in bad.error and bad.bytes == 0


def test_the_router_keeps_a_prefix_on_its_prefill_instance_within_the_load_slack():
    from dsconv.runner.entrypoints.router import PREFIX_SLACK, Router, prefix_key, scores_prompt

    router = Router(["http://p0", "http://p1"], ["http://d0"], 5.0)
    p0, p1 = router.prefill
    turn = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]}
    later = {"messages": [*turn["messages"], {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]}
    key = prefix_key(later)
    assert key == prefix_key({**later, "messages": [*later["messages"][:-1], {"role": "user", "content": "other"}]})
    assert key != prefix_key({**later, "cache_salt": "tenant"}) and prefix_key(turn) != key
    p0.in_flight = 1
    assert router.candidates(router.prefill, key) == [p1, p0]  # unknown prefix: the least loaded
    router.remember(key, p0)
    assert router.candidates(router.prefill, key) == [p0, p1]  # its prefix wins within the slack
    p0.in_flight = 1 + PREFIX_SLACK + 1
    assert router.candidates(router.prefill, key) == [p1, p0]  # beyond it, load wins
    assert scores_prompt({"prompt": "x", "echo": True, "logprobs": 1}) and not scores_prompt({"prompt": "x"})
