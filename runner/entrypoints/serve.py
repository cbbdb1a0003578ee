"""`dsrun serve`: `main` checks the options and launches the ranks. On every rank (`rank_main`): rank 0 runs the
HTTP front end (uvicorn in a thread, answering /health with 503 while the model loads) and the engine loop in its
main thread; the other ranks follow rank 0's steps.

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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsconv.comm.launch import launch
from dsconv.errors import InputError
from dsconv.family.text import TOKENIZER_FILE, TextTokenizer, tokenizer_dir
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import EngineClient, start_engine
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.metrics import ServeMetrics
from dsconv.runner.engine.request import resolve_max_model_len
from dsconv.runner.entrypoints.options import EngineOptions

# Idle ranks wait inside a collective for rank 0's next message; rank 0 sends a keep-alive at this fraction of
# the collective timeout, so an idle server never times out.
KEEPALIVE_FRACTION = 0.25
SERVER_START_S = 30.0  # how long uvicorn may take to bind before the server gives up
PORTS = 65536


@dataclass(frozen=True)
class ServeOptions:
    """`dsrun serve`'s options (runner/cli.py says what each means)."""
    shards: Path | None
    host: str
    port: int
    served_model_name: str | None
    api_key: str | None
    engine: EngineOptions  # the engine flags serve takes (options.SERVE)


def main(o: ServeOptions) -> int:
    """The command: the options checked against the shards, the ranks launched; they serve until SIGTERM -> the
    job's exit code."""
    if not 0 <= o.port < PORTS:
        raise InputError(f"--port {o.port} is not a port number")
    if o.api_key is not None and (not o.api_key.strip() or not o.api_key.isascii() or not o.api_key.isprintable()):
        raise InputError("--api-key (or DSRUN_API_KEY) must be non-empty printable ASCII (HTTP headers carry it)")
    o.engine.check()  # before the demo is built for a server that would refuse its flags
    shards = o.shards
    if shards is None:
        from dsconv.shard.demo import announced_demo_shards  # the converter is imported only for the demo

        shards = announced_demo_shards("serving")
    e = o.engine
    run = e.run_config(shards, "serve")
    run.check_holds(e.max_model_len)
    resolve_max_model_len(e.max_model_len, run.max_position_embeddings, run.cache_tokens)  # refused here, not on a rank
    return launch(rank_main, {"run": run, "host": o.host, "port": o.port,
                              "model_name": o.served_model_name or Path(shards).resolve().name, "timeout_s": e.timeout,
                              "api_key": o.api_key}, world_size=run.layout.world_size, device=run.device,
                  timeout_s=e.timeout, sigterm_to_rank0=True)


def rank_main(run: RunConfig, host: str, port: int, model_name: str, timeout_s: float,
              api_key: str | None = None) -> None:
    """Every rank of `dsrun serve` (timeout_s: the collectives' timeout, which the keep-alive stays under)."""
    run = replace(run, keepalive_s=timeout_s * KEEPALIVE_FRACTION)
    # every rank applies the grammars' masks; their tables are built from the tokenizer on first use
    grammars = Grammars(tokenizer_dir(run.shards) / TOKENIZER_FILE, run.vocab_size, run.eos_token_id)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        engine = start_engine(run, grammars)
        torch.distributed.barrier()  # every rank has loaded
        engine.run()
        return

    from dsconv.runner.entrypoints.openai.app import create_app
    from dsconv.runner.entrypoints.openai.streaming import Front

    layout = run.layout
    metrics = ServeMetrics(model_name, layout.dp)
    door = EngineClient()
    front = Front(door, TextTokenizer.load(run.shards, run.model_config), run.family, model_name, run.vocab_size,
                  resolve_max_model_len(run.max_model_len, run.max_position_embeddings, run.cache_tokens), grammars)
    server, port, thread = _start_http(create_app(front, metrics.registry, api_key), host, port)
    run = _with_release_url(run, host, port)
    if api_key is None and not _loopback(host):
        print(f"dsrun serve: WARNING: listening on {host} without --api-key: anyone who can reach the port can use "
              f"the model", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: door.drain())
    try:
        engine = start_engine(run, grammars, metrics)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank has loaded
        print(f"dsrun serve: ready, {model_name!r} on http://{host}:{port} ({layout.world_size} ranks, "
              f"DP {layout.dp} x attention TP {layout.attn_tp}, EP {layout.ep}); {run.cache_summary()}; "
              f"max_model_len {engine.max_model_len}; {run.overlap_summary}"
              f"{'; ' + run.speculative.summary if run.speculative is not None else ''}"
              f"{'; ' + run.scheduler.kv_transfer.summary if run.scheduler.kv_transfer is not None else ''}"
              f"{'; ' + run.experts_summary if run.experts_summary else ''}"
              f"{'; ' + engine.connector.summary() if engine.connector.summary() else ''}",
              flush=True)
        door.open(engine)  # after the line above: a client that sees /health 200 finds it in the log
        engine.run(door)
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_S)
    print("dsrun serve: stopped", flush=True)


def _with_release_url(run: RunConfig, host: str, port: int) -> RunConfig:
    """A P/D producer's own URL in its offers, where consumers end its leases (engine/kv_release.py): the address
    it listens on, or, listening on every address, its kv_connector_extra_config host (the one its peers reach)."""
    kv_transfer = run.scheduler.kv_transfer
    if kv_transfer is None or not kv_transfer.producer:
        return run
    unspecified = _is_address(host) and ipaddress.ip_address(host).is_unspecified  # 0.0.0.0, ::
    reachable = kv_transfer.host if unspecified else host
    address = f"[{reachable}]" if ":" in reachable else reachable  # an IPv6 address in a URL
    if unspecified and _loopback(reachable):
        print(f"dsrun serve: WARNING: a P/D producer listening on {host} tells consumers to end its leases at "
              f"http://{address}:{port}, its kv_connector_extra_config host: a consumer on another node cannot reach "
              f"it (set host to this node's address)", file=sys.stderr, flush=True)
    return replace(run, scheduler=replace(run.scheduler,
                                          kv_transfer=replace(kv_transfer, release_url=f"http://{address}:{port}")))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
