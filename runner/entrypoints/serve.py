"""`dsrun serve` on every rank: rank 0 runs the HTTP front end (uvicorn in a thread, answering /health with 503
while the model loads) and the engine loop in its main thread; the other ranks follow rank 0's steps.

SIGTERM reaches rank 0 (the local launcher forwards it; the other ranks ignore it and stop when rank 0 says
so): admission stops, requests in flight finish (aborted after --drain-timeout), every rank leaves the loop and
the job exits 0.
"""

from __future__ import annotations

import ipaddress
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from dsconv.family.arch import family_for
from dsconv.errors import InputError
from dsconv.runner.engine.worker import start_rank
from dsconv.runner.engine.client import EngineClient
from dsconv.runner.engine.core import EngineCore, follow
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.worker import Worker
from dsconv.runner.engine.metrics import ServeMetrics
from dsconv.runner.engine.request import resolve_max_model_len
from dsconv.runner.engine.scheduler import Scheduler

# Idle ranks wait inside a collective for rank 0's next message; rank 0 sends a keep-alive at this fraction of
# the collective timeout, so an idle server never times out.
KEEPALIVE_FRACTION = 0.25
SERVER_START_S = 30.0  # how long uvicorn may take to bind before the server gives up


def rank_main(shards: str, manifest: dict, dtype: str, result_dir: str, device: str, host: str, port: int,
              model_name: str, tokenizer_path: str, max_num_seqs: int, max_num_batched_tokens: int,
              cache_tokens: int, balancing: str, timeout_s: float, drain_timeout_s: float,
              kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
              api_key: str | None = None, cp_size: int = 1, cp_min_tokens: int | None = None,
              max_model_len: int | None = None) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _, dist, model, new_cache = start_rank(shards, manifest, dtype, device, cp_size)
        cache = _new_cache(new_cache, cache_tokens, kv_cache_dtype, kv_cache_memory_bytes)
        worker = Worker(model, cache, dist, dp_index=rank // manifest["layout"]["attn_tp"],
                        grammars=_grammars(manifest, tokenizer_path))
        torch.distributed.barrier()  # every rank has loaded
        follow(worker)
        return

    config, layout = manifest["model"]["config"], manifest["layout"]
    from dsconv.runner.entrypoints.openai.app import create_app
    from dsconv.family.chat import read_tokenizer_config
    from tokenizers import Tokenizer

    metrics = ServeMetrics(model_name, layout["dp"])
    grammars = _grammars(manifest, tokenizer_path)
    client = EngineClient(None, vocab_size=config["vocab_size"], max_model_len=config["max_position_embeddings"],
                          keepalive_s=timeout_s * KEEPALIVE_FRACTION, drain_timeout_s=drain_timeout_s,
                          model_name=model_name, tokenizer=Tokenizer.from_file(tokenizer_path),
                          family=family_for(config), tokenizer_config=read_tokenizer_config(Path(tokenizer_path).parent),
                          bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                          grammars=grammars)
    server, port, thread = _start_http(create_app(client, metrics.registry, api_key), host, port)
    if api_key is None and not _loopback(host):
        print(f"dsrun serve: WARNING: listening on {host} without --api-key: anyone who can reach the port can use "
              f"the model", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: client.drain())
    try:
        _, dist, model, new_cache = start_rank(shards, manifest, dtype, device, cp_size)
        cache = _new_cache(new_cache, cache_tokens, kv_cache_dtype, kv_cache_memory_bytes)
        client.max_model_len = resolve_max_model_len(max_model_len, config["max_position_embeddings"],
                                                     cache.num_blocks * cache.block_size)
        scheduler = Scheduler(layout["dp"], cache.num_blocks, cache.block_size, max_num_seqs, max_num_batched_tokens,
                              config.get("eos_token_id"), balancing, share_blocks=cache.paged, cp_size=cp_size,
                              cp_min_tokens=cp_min_tokens)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        client.attach(EngineCore(scheduler, Worker(model, cache, dist, dp_index=0, grammars=grammars), world,
                                 layout["attn_tp"], metrics))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank has loaded
        print(f"dsrun serve: ready, {model_name!r} on http://{host}:{port} ({world} ranks, "
              f"DP {layout['dp']} x attention TP {layout['attn_tp']}, EP {layout['ep']}); KV cache "
              f"{cache.num_blocks * cache.block_size} tokens per DP rank ({kv_cache_dtype}); max_model_len "
              f"{client.max_model_len}", flush=True)
        client.set_ready()  # after the line above: a client that sees /health 200 finds it in the log
        client.run()
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_S)
    print("dsrun serve: stopped", flush=True)


def _grammars(manifest: dict, tokenizer_path: str) -> Grammars:
    """This rank's constrained decoding (its tables are built on the first request that needs them)."""
    config = manifest["model"]["config"]
    return Grammars(tokenizer_path, config["vocab_size"], config.get("eos_token_id"))


def _new_cache(new_cache, cache_tokens: int, kv_cache_dtype: str, memory_bytes: int | None):
    """The rank's cache: --cache-tokens tokens, or as many as --kv-cache-memory-bytes holds (every rank computes
    the same count from the same shapes, so the block pools agree)."""
    if memory_bytes is not None:
        cache_tokens = new_cache.tokens_in(memory_bytes, kv_cache_dtype)
        if cache_tokens < 1:
            raise InputError(f"--kv-cache-memory-bytes {memory_bytes} holds less than one block of the KV cache")
    return new_cache(cache_tokens, kv_cache_dtype)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _start_http(app, host: str, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="http", daemon=True)  # no signal handlers off the main thread
    thread.start()
    deadline = time.monotonic() + SERVER_START_S
    while not server.started:
        thread.join(timeout=0.05)
        if not thread.is_alive() or time.monotonic() > deadline:
            raise InputError(f"cannot serve on {host}:{port} (is the port in use?)")
    port = server.servers[0].sockets[0].getsockname()[1]  # the one the OS chose for --port 0
    print(f"dsrun serve: listening on http://{host}:{port}, loading the model", file=sys.stderr, flush=True)
    return server, port, thread
