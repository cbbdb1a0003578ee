"""What the serving benchmarks people publish with send to an OpenAI-compatible server, read from their sources, and
how a stream of theirs is read back. tests/test_bench_clients.py replays them against dsrun serve.

- guidellm 0.8.1 (PyPI wheel guidellm-0.8.1; guidellm/backends/openai/request_handlers.py, the completions and chat
  handlers' `format`; guidellm/backends/openai/http.py drops every None value before sending, so its `stop: None`
  never leaves): streamed, with stream_options {include_usage, continuous_usage_stats}, ignore_eos with the
  dataset's output length, chat content as a list of text parts; no temperature.
- vLLM 0.12.0's `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py; serve.py adds temperature 0 and,
  for the random dataset, ignore_eos): the `openai` backend (completions) with repetition_penalty 1.0 and logprobs
  null, the `openai-chat` backend with max_completion_tokens; both streamed with include_usage, and an
  `Authorization: Bearer None` header when OPENAI_API_KEY is unset, with an X-Request-ID.
"""

import json

GUIDELLM_VERSION, VLLM_BENCH_VERSION = "0.8.1", "0.12.0"
STREAM_USAGE = {"include_usage": True}
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def chat_content(prompt: str) -> list[dict]:
    return [{"type": "text", "text": prompt}]


def bodies(model: str, prompt: str, output_tokens: int) -> dict[str, tuple[str, dict, dict]]:
    """name -> (path, body, headers) of each client's request for `prompt` and `output_tokens` new tokens."""
    vllm_headers = {"Authorization": "Bearer None", "X-Request-ID": "bench-0a1b2c3d-0"}
    return {
        "guidellm-completions": ("/v1/completions", {
            "model": model, "stream": True, "stream_options": CONTINUOUS_USAGE, "max_tokens": output_tokens,
            "ignore_eos": True, "prompt": prompt}, {}),
        "guidellm-chat": ("/v1/chat/completions", {
            "model": model, "stream": True, "stream_options": CONTINUOUS_USAGE, "max_completion_tokens": output_tokens,
            "ignore_eos": True, "messages": [{"role": "user", "content": chat_content(prompt)}]}, {}),
        "vllm-bench-openai": ("/v1/completions", {
            "model": model, "prompt": prompt, "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": output_tokens, "logprobs": None, "stream": True, "stream_options": STREAM_USAGE,
            "ignore_eos": True}, vllm_headers),
        "vllm-bench-openai-chat": ("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": chat_content(prompt)}], "temperature": 0.0,
            "max_completion_tokens": output_tokens, "stream": True, "stream_options": STREAM_USAGE,
            "ignore_eos": True}, vllm_headers),
    }


def read_stream(name: str, lines: list[str]) -> dict:
    """A stream read as the client reads it: the text (completions' choices[0].text, chat's delta.content), the text
    chunks (guidellm counts each as one token iteration), the last usage seen (guidellm keeps the last one; vLLM's
    bench reads the usage-only chunk), each chunk's completion_tokens where it carries usage, and whether [DONE]
    came."""
    text, iterations, usage, counts, done = "", 0, None, [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            raise AssertionError(f"{name}: an error chunk {chunk}")
        if chunk.get("usage"):
            usage = chunk["usage"]
            counts.append(usage["completion_tokens"])
        if chunk["choices"]:
            choice = chunk["choices"][0]
            piece = choice["text"] if "text" in choice else (choice["delta"].get("content") or "")
            text += piece
            iterations += bool(piece)
    return {"text": text, "iterations": iterations, "usage": usage, "counts": counts, "done": done}
