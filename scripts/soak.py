"""A soak of `dsrun serve` and its P/D pair as users and their disks meet them, for a bounded time.

    python scripts/soak.py [--duration 300] [--work DIR] [--json FILE] [--seed 0]

Three instances of the tiny V3.2 checkpoint (random weights, token-id prompts, float32, greedy):
- A: world 2 (DP2, EP2) with prefix caching, a small device pool, and KV offload to host memory and to a disk tier
  small enough to fill (--kv-offloading-size / --kv-offloading-path / --kv-offloading-disk-size);
- P and D: a producer and a consumer at world 1, behind `dsrun router`, sharing a fresh P/D key.

Load: CLIENTS threads, each sending one request at a time until the time is up, drawn (seeded) from a mix of whole
and streamed completions to A, clients that disconnect mid-stream, turns of CONVERSATIONS conversations whose old
turns come back later (their prefixes from the offload tiers), requests through the router, and bodies a hostile
client sends (a lone surrogate as cache_salt). Faults, at fixed fractions of the time:
- CORRUPT_AT: two of A's tier files get a changed byte and a foreign file is dropped beside them;
- READ_ONLY: A's tier directory is made read-only (a read-only bind mount over it; needs root) and later writable;
- KILL_P_AT: P's whole process group is killed (SIGKILL) and P is started again on its port.

Checked, each a line of the summary, the exit code 1 when one fails:
- every request answered: a 200, or an error in OpenAI's shape (never a dropped connection, but the disconnects the
  client itself made); hostile bodies answered 400;
- every server healthy at the end (/health 200), and every pool back to idle (no KV block in use, no request
  running, no P/D lease held) within IDLE_S;
- RSS: each instance's process tree sampled every RSS_EVERY_S; the growth from the end of warm-up (WARMUP of the
  time) to the end is printed, and checked against RSS_GROWTH_LIMIT of the warm figure (a leak of a request's
  worth per request would cross it; the tiny models' own noise does not).

tests/test_soak.py runs it for 60 seconds in the suite; docs/benchmarks.md has a 5-minute run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from dsconv.family.layout import Layout
from dsconv.scripts.bench_serve import free_port, machine, shards_for

CLIENTS = 3
CONVERSATIONS = 12  # each grows by a turn at a time; more than the device pool holds, so old ones come from the tiers
TURN_TOKENS = (6, 20)  # new user tokens a turn adds
MAX_TOKENS = 4
BASE = ("--dtype", "float32", "--served-model-name", "soak", "--max-num-batched-tokens", "64")
# A: a device pool of 512 tokens (32 blocks of 16 a DP rank), a host tier of 6 blocks a rank and a disk tier of 24
# (the tiny V3.2's block is 96 KiB at float32, the error for a smaller tier says), against conversations of up to 400
# tokens each (300 blocks in all): the disk tier fills and drops its oldest files
A_FLAGS = ("--cache-tokens", "512", "--kv-offloading-size", "0.0011", "--kv-offloading-disk-size", "0.0044")
CORRUPT_AT, READ_ONLY, KILL_P_AT = 0.25, (0.4, 0.55), 0.7
FAULTS = ("corrupt files", "read-only", "writable again", "P killed")
WARMUP = 0.3
RSS_EVERY_S = 2.0
RSS_GROWTH_LIMIT = 0.25
IDLE_S = 60.0
START_S = 300.0
# the request mix: (kind, weight)
MIX = (("whole", 3), ("stream", 2), ("disconnect", 1), ("turn", 4), ("router", 2), ("router-stream", 1),
       ("hostile", 1))


class Instance:
    """A `dsrun serve` (or `dsrun router`) subprocess in a process group of its own, on a fixed port."""

    def __init__(self, name: str, command: list[str], log: Path, port: int):
        self.name, self.command, self.log, self.port = name, command, log, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: {self.name} did not start (code {self.proc.poll()}); its log {self.log} "
                                 f"ends:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def rss(self) -> int:
        """Bytes resident over the process and its descendants (the ranks, the fork server)."""
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0


def serve(name: str, shards: Path, work: Path, *flags: str) -> Instance:
    port = free_port()
    command = [sys.executable, "-m", "dsconv.runner.cli", "serve", "--shards", str(shards), "--port", str(port),
               *BASE, *flags]
    return Instance(name, command, work / f"{name}.log", port)


def pd_config(role: str, key: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"auth_key": key}})


class Tally:
    """What every request got, by kind: ok, a clean error (status: count), or a failure (described)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ok: dict[str, int] = {}
        self.errors: dict[str, dict[int, int]] = {}
        self.failures: list[str] = []

    def add(self, kind: str, status: int | None, failure: str | None = None) -> None:
        with self.lock:
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")
            elif status == 200:
                self.ok[kind] = self.ok.get(kind, 0) + 1
            else:
                by_status = self.errors.setdefault(kind, {})
                by_status[status] = by_status.get(status, 0) + 1


class Load:
    """The clients: each draws a request from MIX, sends it, and tallies what came back."""

    def __init__(self, a: Instance, router: Instance, vocab: int, seed: int, deadline: float, tally: Tally):
        self.a, self.router, self.vocab, self.deadline, self.tally = a, router, vocab, deadline, tally
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.conversations = [self._tokens(40) for _ in range(CONVERSATIONS)]
        self.turn = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.random.randrange(2, self.vocab) for _ in range(n)]

    def run(self, client: int) -> None:
        kinds, weights = zip(*MIX)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < self.deadline:
                with self.lock:
                    kind = self.random.choices(kinds, weights)[0]
                    prompt = self._tokens(self.random.randrange(5, 60))
                try:
                    self._send(http, kind, prompt)
                except Exception as exc:  # noqa: BLE001  (a dropped connection, or a reply not in OpenAI's shape)
                    self.tally.add(kind, None, f"{type(exc).__name__}: {exc}")

    def _send(self, http: httpx.Client, kind: str, prompt: list[int]) -> None:
        body = {"model": "soak", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        url = self.router.url if kind.startswith("router") else self.a.url
        if kind == "turn":  # the reply's ids join the conversation, as a chat client keeps the assistant's turn
            body["prompt"], at = self._next_turn()
            response = http.post(f"{url}/v1/completions", json={**body, "logprobs": 0,
                                                                 "return_tokens_as_token_ids": True})
            if response.status_code == 200:
                tokens = response.json()["choices"][0]["logprobs"]["tokens"]
                with self.lock:
                    self.conversations[at] += [int(t.removeprefix("token_id:")) for t in tokens]
            self._tally(kind, response)
        elif kind == "hostile":
            raw = json.dumps({**body, "cache_salt": "\ud800"})  # a lone surrogate: no UTF-8 encoder takes it
            response = http.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
            self.tally.add(kind, response.status_code,
                           None if response.status_code == 400 else f"answered {response.status_code}, not 400")
        elif kind in ("stream", "router-stream", "disconnect"):
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    response.read()
                    self._tally(kind, response)
                    return
                for line in response.iter_lines():
                    if kind == "disconnect" and line.startswith("data: {"):
                        break  # leaving the block closes the connection mid-stream
            self.tally.add(kind, 200)
        else:
            self._tally(kind, http.post(f"{url}/v1/completions", json=body))

    def _next_turn(self) -> tuple[list[int], int]:
        """The next conversation's whole history plus a new user turn, in round-robin (so old ones come back)."""
        with self.lock:
            at = self.turn % CONVERSATIONS
            self.turn += 1
            self.conversations[at] = self.conversations[at] + self._tokens(self.random.randrange(*TURN_TOKENS))
            if len(self.conversations[at]) > 400:  # a new conversation in its place, within the context
                self.conversations[at] = self._tokens(40)
            return list(self.conversations[at]), at

    def _tally(self, kind: str, response: httpx.Response) -> None:
        if response.status_code == 200:
            self.tally.add(kind, 200)
            return
        try:
            error = response.json()["error"]
            clean = isinstance(error["message"], str) and error["message"]
        except (ValueError, KeyError, TypeError):
            clean = False
        self.tally.add(kind, response.status_code,
                       None if clean else f"HTTP {response.status_code} without an error body: {response.text[:200]}")


class Faults:
    """The faults, each at its moment (`due`), with what happened to each written down."""

    def __init__(self, a_tier: Path, p: Instance, started: float, duration: float):
        self.tier, self.p, self.started, self.duration = a_tier, p, started, duration
        self.done: dict[str, str] = {}
        self.mounted = False

    def due(self, now: float) -> None:
        at = (now - self.started) / self.duration
        for name, when, act in zip(FAULTS, (CORRUPT_AT, *READ_ONLY, KILL_P_AT),
                                   (self.corrupt, self.freeze, self.thaw, self.kill_p)):
            if at >= when and name not in self.done:
                outcome = act()  # None: not yet possible, tried again at the next look
                if outcome is not None:
                    self.done[name] = outcome

    def corrupt(self) -> str | None:
        files = sorted(self.tier.glob("rank*/*.kv"))
        if len(files) < 2:  # the tier has not spilled yet
            return None
        for path in files[:2]:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        foreign = self.tier / "rank000" / f"block-{secrets.token_hex(16)}.kv"
        foreign.write_bytes(b'{"not": "a header"}\n' + os.urandom(64))
        return f"2 of {len(files)} files changed, a foreign one dropped"

    def freeze(self) -> str:
        for command in (["mount", "--bind", str(self.tier), str(self.tier)],
                        ["mount", "-o", "remount,ro,bind", str(self.tier)]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                if self.mounted:
                    self.thaw()
                return f"not exercised: {' '.join(command)}: {done.stderr.strip() or done.returncode}"
            self.mounted = True
        return "read-only bind mount over the tier"

    def thaw(self) -> str:
        if not self.mounted:
            return "nothing to undo"
        subprocess.run(["umount", str(self.tier)], check=True)
        self.mounted = False
        return "unmounted"

    def kill_p(self) -> str:
        self.p.kill()
        killed = time.monotonic()
        self.p.start()
        return f"killed, serving again after {time.monotonic() - killed:.1f} s"


def metric(url: str, name: str) -> float:
    """A metric's samples summed over their labels (a counter by its _total)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"{re.escape(name)}(_total)?[{{ ]", line))


def idle(instance: Instance) -> bool:
    return all(metric(instance.url, name) == 0 for name in ("dsrun:kv_cache_usage_perc", "dsrun:num_requests_running",
                                                            "dsrun:num_requests_waiting", "dsrun:kv_transfer_leases"))


def soak(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="dsrun-soak-"))
    w2 = shards_for(work, "deepseek_v32", Layout(2, 2, 2, 1))
    w1 = shards_for(work, "deepseek_v32", Layout(1, 1, 1, 1))
    vocab = json.loads((w1 / "config.json").read_text())["vocab_size"]
    tier, key = work / "tier", secrets.token_hex(16)
    tier.mkdir(exist_ok=True)
    a = serve("A", w2, work, *A_FLAGS, "--kv-offloading-path", str(tier))
    p = serve("P", w1, work, "--kv-transfer-config", pd_config("kv_producer", key))
    d = serve("D", w1, work, "--kv-transfer-config", pd_config("kv_consumer", key))
    port = free_port()
    router = Instance("router", [sys.executable, "-m", "dsconv.runner.cli", "router", "--port", str(port),
                                 "--prefill", p.url, "--decode", d.url], work / "router.log", port)
    instances = [a, p, d, router]
    try:
        for instance in instances:
            instance.start()
        return run_load(args, work, a, p, d, router, tier, vocab)
    finally:
        codes = {instance.name: instance.stop() for instance in reversed(instances)}
        print(f"soak: stopped, exit codes {codes}; logs in {work}", file=sys.stderr, flush=True)


def run_load(args, work: Path, a: Instance, p: Instance, d: Instance, router: Instance, tier: Path,
             vocab: int) -> dict:
    started = time.monotonic()
    tally, faults = Tally(), Faults(tier, p, started, args.duration)
    load = Load(a, router, vocab, args.seed, started + args.duration, tally)
    clients = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    rss: dict[str, list[tuple[float, int]]] = {i.name: [] for i in (a, p, d)}
    try:
        while any(client.is_alive() for client in clients):
            now = time.monotonic()
            faults.due(now)
            for instance in (a, p, d):
                rss[instance.name].append((now - started, instance.rss()))
            time.sleep(RSS_EVERY_S)
        for client in clients:
            client.join()
    finally:
        faults.thaw()
    return report(args, tally, faults, rss, [a, p, d, router])


def report(args, tally: Tally, faults: Faults, rss: dict, instances: list[Instance]) -> dict:
    deadline = time.monotonic() + IDLE_S
    healthy = {i.name: i.healthy() for i in instances}
    servers = [i for i in instances if i.name != "router"]
    while not all(idle(i) for i in servers) and time.monotonic() < deadline:
        time.sleep(1)
    pools_idle = {i.name: idle(i) for i in servers}
    growth = {}
    for name, samples in rss.items():
        warm = [r for t, r in samples if t >= WARMUP * args.duration]
        if warm:
            growth[name] = {"warm_mib": warm[0] / 2**20, "end_mib": warm[-1] / 2**20,
                            "growth": (warm[-1] - warm[0]) / warm[0]}
    checks = {"every fault made": len(faults.done) == len(FAULTS) and not any(
                  outcome.startswith("not exercised") for outcome in faults.done.values()),
              "every request answered": not tally.failures, "healthy at the end": all(healthy.values()),
              "pools idle at the end": all(pools_idle.values()),
              "RSS flat after warm-up": all(g["growth"] <= RSS_GROWTH_LIMIT for g in growth.values())}
    return {"duration_s": args.duration, "machine": machine(None), "ok": tally.ok, "errors": tally.errors,
            "failures": tally.failures[:20], "faults": faults.done, "healthy": healthy, "idle": pools_idle,
            "rss": growth, "checks": checks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--work", help="where the shards, the tier and the logs go (default: a new temp dir)")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    summary = soak(args)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    for check, held in summary["checks"].items():
        print(f"soak: {check}: {'yes' if held else 'NO'}")
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
