"""The serving benchmarks as clients (tests/bench_clients.py: guidellm 0.8.1's and vLLM 0.12.0's `vllm bench serve`
request bodies, read from their sources): each body gets a 200 and a stream its client reads, the token counts
in the usage those clients read; guidellm itself runs its synchronous and concurrent (4 streams) profiles against
live servers with no error."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dsconv.family.layout import Layout
from tests.bench_clients import bodies, read_stream
from tests.helpers import Server, shard
from tests.test_serve_api import MODEL, make_client

OUTPUT_TOKENS = 16


def _check(name: str, path: str, body: dict, stream: dict, prompt_tokens: int) -> None:
    usage = stream["usage"]
    assert stream["done"] and usage is not None, (name, stream)
    assert usage["completion_tokens"] == OUTPUT_TOKENS and usage["prompt_tokens"] == prompt_tokens, (name, usage)
    assert usage["total_tokens"] == prompt_tokens + OUTPUT_TOKENS
    assert stream["text"] and stream["iterations"] >= 1, (name, stream)
    if body["stream_options"].get("continuous_usage_stats"):  # every chunk's count, up to the final one
        assert len(stream["counts"]) > 1 and stream["counts"] == sorted(stream["counts"]), (name, stream["counts"])
    else:
        assert len(stream["counts"]) == 1, (name, stream["counts"])  # the usage-only chunk alone


def test_benchmark_bodies_through_the_front_end():
    """Against the front end with tests/test_serve_api.py's fake engine: 200s, the usage each client reads."""
    client, engine = make_client()
    for name, (path, body, headers) in bodies(MODEL, "hello", OUTPUT_TOKENS).items():
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 200, (name, response.text)
        prompt, params, _ = list(engine.submitted.values())[-1]
        assert params.ignore_eos and params.max_tokens == OUTPUT_TOKENS, name
        _check(name, path, body, read_stream(name, response.text.splitlines()), len(prompt))


# --- live servers on real-vocabulary tiny models ------------------------------------------------------------------

CASES = {"v32-w1": ("deepseek_v32", Layout(1, 1, 1, 1)), "v4-w1": ("deepseek_v4", Layout(1, 1, 1, 1))}
GUIDELLM_PROFILES = {"synchronous": ("kind=synchronous", 4), "concurrent": ("kind=concurrent,streams=4", 8)}
PROMPT_TOKENS = 48


def guidellm(server: Server, shards: Path, profile: str, requests: int, output: Path) -> dict:
    """guidellm run against the server, its JSON report read back."""
    command = [sys.executable, "-m", "guidellm", "run",
               "--backend", f"kind=openai_http,target={server.url},model={server.model}",
               "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=huggingface_auto,model={shards}",
               "--output", f"kind=json,path={output}", "--disable-console-interactive"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(output.read_text())


@pytest.mark.slow
@pytest.mark.manual  # by hand (`pytest -m manual`): the suite's 20 minutes; the bodies are checked above in the suite
@pytest.mark.parametrize("case", list(CASES))
def test_benchmark_clients_against_live_servers(case, tiny_source, tmp_path):
    family, layout = CASES[case]
    shards = tmp_path / case
    shard(tiny_source(family, "fp8", real_vocab=True), shards, layout)
    server = Server(shards, tmp_path / "server.log")  # the default dtype (BF16), as users serve
    try:
        server.model = server.openai().models.list().data[0].id
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}).json()["tokens"]
        for name, (path, body, headers) in bodies(server.model, "hello", OUTPUT_TOKENS).items():
            with httpx.stream("POST", f"{server.url}{path}", json=body, headers=headers, timeout=300) as response:
                assert response.status_code == 200, (name, response.read())
                stream = read_stream(name, list(response.iter_lines()))
            prompt_tokens = len(ids) if "chat" not in name else stream["usage"]["prompt_tokens"]
            _check(name, path, body, stream, prompt_tokens)
        for profile, (spec, requests) in GUIDELLM_PROFILES.items():
            report = guidellm(server, shards, spec, requests, tmp_path / f"{profile}.json")
            (benchmark,) = report["benchmarks"]
            totals = benchmark["metrics"]["request_totals"]
            # guidellm counts the requests inside its measurement window (one at an edge may fall outside it): every one
            # it counts succeeded
            assert totals["errored"] == 0 and totals["incomplete"] == 0, (profile, totals)
            assert 0 < totals["successful"] == totals["total"] <= requests, (profile, totals)
    finally:
        assert server.stop() == 0, server.log()
