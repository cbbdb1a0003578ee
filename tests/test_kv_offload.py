"""KV cache offload (runner/engine/kv_offload.py, runner/engine/offload_store.py): the host and disk tiers under the
prefix cache. A device pool far smaller than the prompts' working set gives its published blocks up; with offload
they are kept in host slots (and files), and a later request copies them back instead of computing them. Float32
greedy tokens with hits from the host tier, and from disk after a restart, equal those computed from scratch:
V3.2 (the tiny indexer's index_topk of 8, so it selects from cached keys) and V4 (hits inside the sliding window and
in HCA / CSA windows, restored from offloaded state blocks), auto and INT8 caches, world 1 here and world 16 in the
slow tests. Faults: torn, corrupt and foreign files, a full disk, a write a killed server left, a read-only or
failing filesystem, files on some ranks only; a graceful stop writes the host tier to disk for the next start."""

import errno
import json
import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsconv.errors import InputError
from dsconv.family.layout import Layout
from dsconv.runner.engine.block_pool import block_hashes
from dsconv.runner.engine.core import EngineClient
from dsconv.runner.engine.kv_connector import factory
from dsconv.runner.engine.kv_connector.offload import OffloadConnector
from dsconv.runner.engine.kv_offload import (BLOCK, DROP, FETCH, SAVE, SPILL, STATE, HostTier, OffloadConfig,
                                             OffloadCounts, Offloader, OffloadOps, OffloadReport, TierShape)
from dsconv.runner.engine.offload_store import (DIRECTORY_META, LENGTH_BYTES, MAGIC, TEMPORARY, OffloadStore, agree,
                                                decode, encode, file_bytes, file_name, open_directory, rank_directory,
                                                scan, unit_file_bytes)
from dsconv.runner.engine.speculative import SpeculativeConfig
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import build_model
from dsconv.runner.models.weights import load_manifest
from tests.helpers import launch_ranks, run_config, shard
from tests.rank_entries import one_after_another
from tests.test_prefix_cache import NEW_TOKENS, engine, one_by_one

BLOCK_SIZE = 16


# -- the tiers, alone ----------------------------------------------------------------------------------------------

def test_host_tier_gives_out_least_recently_used_slots_never_a_busy_one():
    tier = HostTier(2)
    assert tier.take(b"a") == (0, None) and tier.take(b"b") == (1, None)
    tier.find(b"a")  # a used: b is now the least recent
    tier.busy.add(1)  # b's slot being filled from disk this step
    assert tier.take(b"c") == (0, b"a")
    tier.busy.add(0)
    assert tier.take(b"d") is None  # both busy
    tier.busy.clear()
    assert tier.take(b"d") == (1, b"b") and tier.find(b"b") is None


def test_offloader_saves_spills_drops_and_forgets_what_failed():
    shape = TierShape({BLOCK: 1, STATE: 0}, {BLOCK: 1, STATE: 0}, {BLOCK: 8, STATE: 0})
    counts = OffloadCounts()
    offloader = Offloader(shape, {BLOCK: [], STATE: []}, counts)
    offloader.evicted(BLOCK, 5, b"a")
    assert offloader.take_ops().ops == ((SAVE, BLOCK, 5, 0),)
    offloader.evicted(BLOCK, 6, b"b")  # the one slot goes to b: a is written to disk first
    assert offloader.take_ops().ops == ((SPILL, BLOCK, 0, b"a"), (SAVE, BLOCK, 6, 0))
    assert offloader.where(BLOCK, b"a") == "disk" and offloader.where(BLOCK, b"b") == "host"
    offloader.evicted(BLOCK, 7, b"c")  # b spills, and the disk tier's one entry drops a's file first
    assert offloader.take_ops().ops == ((DROP, BLOCK, b"a"), (SPILL, BLOCK, 0, b"b"), (SAVE, BLOCK, 7, 0))
    assert offloader.fetch([(BLOCK, b"b")])  # the slot takes b back; c finds no room on disk (b's file is read)
    assert offloader.where(BLOCK, b"b") == "pending"
    assert offloader.take_ops().ops == ((FETCH, BLOCK, b"b", 0),)
    report = OffloadReport(0, failed_fetches=[(BLOCK, b"b", "its checksum does not match")], corrupt=1)
    offloader.reported(report)
    offloader.reported(report)  # another rank of the DP index failed it too: removed once
    offloader.settled()
    assert offloader.where(BLOCK, b"b") is None and counts.corrupt_files == 2
    assert offloader.take_ops().ops == ((DROP, BLOCK, b"b"),)  # on every rank of the DP index, not only the failing one
    assert counts.evictions == {"device": 3, "host": 3, "disk": 1}


def test_a_fetch_pins_the_files_it_reads_so_its_own_spills_keep_them():
    """Issue 71, 2: a two-block prefix on a full disk tier of 3, its second block's file the oldest, and a host tier
    of 2 holding others. Each fetch's slot spills a host block, whose file needs room: the prefix's files are pinned
    before the first slot is taken, so the other file goes, not the prefix's second (whose touch raised KeyError)."""
    shape = TierShape({BLOCK: 2, STATE: 0}, {BLOCK: 3, STATE: 0}, {BLOCK: 8, STATE: 0})
    offloader = Offloader(shape, {BLOCK: [b"b", b"z", b"a"], STATE: []}, OffloadCounts())
    offloader.evicted(BLOCK, 0, b"x")
    offloader.evicted(BLOCK, 1, b"y")
    offloader.take_ops()
    assert offloader.fetch([(BLOCK, b"a"), (BLOCK, b"b")])
    assert offloader.take_ops().ops == ((DROP, BLOCK, b"z"), (SPILL, BLOCK, 0, b"x"), (FETCH, BLOCK, b"a", 0),
                                        (DROP, BLOCK, b"x"), (SPILL, BLOCK, 1, b"y"), (FETCH, BLOCK, b"b", 1))
    assert [offloader.where(BLOCK, h) for h in (b"a", b"b", b"x", b"y", b"z")] == \
        ["pending", "pending", None, "disk", None]


def tiny_store(tmp_path, host_slots=2, width=8):
    """An OffloadStore over a one-view cache of 4 blocks of `width` bytes, with a disk tier in tmp_path/tier."""
    cache = SimpleNamespace(transfer_views=lambda: ([torch.arange(4 * width, dtype=torch.uint8).view(4, width)], []),
                            device=torch.device("cpu"))
    shape = TierShape({BLOCK: host_slots, STATE: 0}, {BLOCK: 4, STATE: 0}, {BLOCK: width, STATE: 0})
    return OffloadStore(cache, shape, 0, 0, tmp_path / "tier", "fp")


def failing(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, errno.errorcode[code])
    return fail


def test_filesystem_errors_are_reported_stop_the_writes_and_a_failed_read_is_a_miss(tmp_path, monkeypatch):
    """Issue 71, 3: EROFS on removing a file (even a missing one), EACCES on writing, EIO on reading: each is
    reported by errno, none escapes; after the first, the rank writes nothing more. A header that is JSON but not an
    object is a corrupt file (it raised AttributeError)."""
    store = tiny_store(tmp_path)
    monkeypatch.setattr(Path, "unlink", failing(errno.EROFS))
    report = store.run(OffloadOps(((DROP, BLOCK, b"gone"),)))
    monkeypatch.undo()
    assert [name for name, _ in report.disk_errors] == ["EROFS"] and store.stopped is not None
    store = tiny_store(tmp_path)
    store.write = failing(errno.EACCES)
    report = store.run(OffloadOps(((SAVE, BLOCK, 1, 0), (SPILL, BLOCK, 0, b"a"), (SPILL, BLOCK, 0, b"b"))))
    assert [name for name, _ in report.disk_errors] == ["EACCES"]  # b was not tried
    assert [digest for _, digest, _ in report.failed_spills] == [b"a", b"b"]
    store = tiny_store(tmp_path)
    store.run(OffloadOps(((SAVE, BLOCK, 1, 0), (SPILL, BLOCK, 0, b"a"))))
    monkeypatch.setattr(Path, "read_bytes", failing(errno.EIO))
    report = store.run(OffloadOps(((FETCH, BLOCK, b"a", 1),)))
    monkeypatch.undo()
    assert [name for name, _ in report.disk_errors] == ["EIO"] and report.failed_fetches[0][1] == b"a"
    header = b"[1, 2]"
    whole = unit_file_bytes("fp", BLOCK, b"c", 8)  # the size a real file has: the reader looks at it first
    (store.directory / file_name(BLOCK, b"c")).write_bytes(MAGIC + len(header).to_bytes(LENGTH_BYTES, "little")
                                                           + header + bytes(whole - len(MAGIC) - LENGTH_BYTES - 6))
    report = tiny_store(tmp_path).run(OffloadOps(((FETCH, BLOCK, b"c", 1),)))
    assert report.corrupt == 1 and "not a JSON object" in report.failed_fetches[0][2]
    assert not (store.directory / file_name(BLOCK, b"c")).exists()


def test_the_first_filesystem_error_stops_the_spills_once_and_says_why(capsys):
    """Issue 71, 3: EDQUOT from a rank stops every spill with one log line, the metrics and /health's field; later
    errors are counted, not logged again. Reads go on: a block on disk is still a disk hit."""
    from fastapi.testclient import TestClient
    import prometheus_client

    from dsconv.runner.engine.metrics import ServeMetrics
    from dsconv.runner.entrypoints.openai.app import create_app

    shape = TierShape({BLOCK: 1, STATE: 0}, {BLOCK: 4, STATE: 0}, {BLOCK: 8, STATE: 0})
    connector = OffloadConnector(OffloadConfig(1), shape, [({BLOCK: [b"on disk"], STATE: []}, {})], 1)
    offloader, counts = connector.offloaders[0], connector.counts
    offloader.reported(OffloadReport(0, 3, failed_spills=[(BLOCK, b"on disk", "quota")],
                                     disk_errors=[("EDQUOT", "writing x: quota exceeded")]))
    offloader.reported(OffloadReport(0, 4, disk_errors=[("EDQUOT", "writing y: quota exceeded")]))
    assert capsys.readouterr().err.count("the disk tier takes no more blocks") == 1
    assert counts.disk_stopped == "EDQUOT on rank 3: writing x: quota exceeded"
    assert offloader.take_ops().ops == ((DROP, BLOCK, b"on disk"),)  # the failed write's file on the other ranks
    offloader.evicted(BLOCK, 0, b"a")
    offloader.evicted(BLOCK, 1, b"b")  # a falls out of the host tier: not written
    assert offloader.take_ops().ops == ((SAVE, BLOCK, 0, 0), (SAVE, BLOCK, 1, 0))
    metrics = ServeMetrics("m", 1)
    metrics.record_offload(connector)
    value = metrics.registry.get_sample_value
    assert value("dsrun:kv_offload_disk_errors_total", {"model_name": "m", "errno": "EDQUOT"}) == 2
    assert value("dsrun:kv_offload_disk_stopped", {"model_name": "m"}) == 1
    front = SimpleNamespace(is_ready=lambda: True, connector_health=connector.health)
    health = TestClient(create_app(front, prometheus_client.CollectorRegistry())).get("/health")
    assert health.json() == {"kv_offload_disk": "disabled: EDQUOT on rank 3: writing x: quota exceeded"}


def test_files_read_back_only_whole_and_their_own():
    payload = bytes(range(200))
    data = encode("fp", BLOCK, b"\x01" * 16, payload)
    assert decode(data, "fp", BLOCK, b"\x01" * 16, 200) == payload
    cases = {"torn": data[:-10], "checksum": data[:-1] + b"\x00", "another model": data,
             "another block": data, "not a KV offload file": b"garbage"}
    expected = {"torn": "torn", "checksum": "checksum", "another model": "another model",
                "another block": "another block", "not a KV offload file": "not a KV offload file"}
    for name, bad in cases.items():
        fingerprint = "other" if name == "another model" else "fp"
        digest = b"\x02" * 16 if name == "another block" else b"\x01" * 16
        with pytest.raises(ValueError, match=expected[name]):
            decode(bad, fingerprint, BLOCK, digest, 200)


def test_a_directory_is_refused_for_another_run_or_another_use(tmp_path):
    identity = {"model": "a" * 64, "dtype": "float32", "kv_cache_dtype": "auto", "block_size": 16, "world_size": 1}
    fingerprint = open_directory(tmp_path / "tier", identity)
    assert open_directory(tmp_path / "tier", identity) == fingerprint  # reopened: the same
    with pytest.raises(InputError, match=r"holds another run's KV cache \(it was written for kv_cache_dtype 'auto'\)"):
        open_directory(tmp_path / "tier", {**identity, "kv_cache_dtype": "int8"})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=f"is not empty and is not a KV offload directory \\(no {DIRECTORY_META}\\)"):
        open_directory(tmp_path / "other", identity)


def test_flags_are_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="--kv-offloading-size 0 must be a positive number of GiB"):
        OffloadConfig.of(0, None, None)
    with pytest.raises(InputError, match="is not a directory"):
        OffloadConfig.of(1, tmp_path / "file", 1)
    with pytest.raises(InputError, match="go together"):
        OffloadConfig.of(1, tmp_path, None)
    with pytest.raises(InputError, match="need --kv-offloading-size"):
        OffloadConfig.of(None, tmp_path, 1)


# -- the engine at world 1 -----------------------------------------------------------------------------------------

def pool_bytes(cache) -> int:
    """The device pool's bytes on this rank: its blocks and state blocks (tier sizes here are multiples of it)."""
    blocks, states = cache.transfer_views()
    return cache.num_blocks * sum(v.shape[1] for v in blocks) + cache.state_blocks * sum(v.shape[1] for v in states)


def offload_engine(model, new_cache, kv_cache_dtype, cache_tokens, host=0.0, path=None, disk=0.0, fingerprint="",
                   caching=True, block_size=BLOCK_SIZE, max_seqs=2):
    """An engine on one rank with a device pool of `cache_tokens` and, when `host` > 0, tiers of `host` (and `disk`)
    times the pool's bytes (so each holds about that many times its blocks and state blocks)."""
    cache = new_cache(cache_tokens, kv_cache_dtype, block_size=block_size, max_seqs=max_seqs, prefix_caching=caching)
    if not host:
        return engine(model, cache, max_seqs, 4096, caching)
    size = pool_bytes(cache)
    connector, worker = factory.build(cache, Dist(), OffloadConfig(int(host * size), path, int(disk * size),
                                                                   fingerprint))
    return engine(model, cache, max_seqs, 4096, caching, connector=connector, connector_worker=worker)


def identity(kv_cache_dtype: str) -> dict:
    return {"model": "tiny", "dtype": "float32", "kv_cache_dtype": kv_cache_dtype, "block_size": BLOCK_SIZE,
            "world_size": 1}


@pytest.fixture(scope="module")
def family_shards(tiny_source, tmp_path_factory):
    """family -> its tiny model's shards at world 1."""
    built = {}
    for family in ("deepseek_v32", "deepseek_v4"):
        built[family] = tmp_path_factory.mktemp(f"offload-{family}") / "w1"
        shard(tiny_source(family, "fp8"), built[family], Layout(1, 1, 1, 1))
    return built


@pytest.fixture(scope="module")
def families(family_shards):
    """family -> (model, new_cache) of its tiny trained-shape model at world 1, float32."""
    built = {}
    for family, shards in family_shards.items():
        model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
        built[family] = model, new_cache
    return built


def test_a_directory_written_without_mtp_is_refused_with_it(family_shards, tmp_path):
    """Issue 71, 4: --speculative-config adds V3.2's MTP layer to every block: a directory written without it is
    another run's (one line), not a directory of files that all fail their size check."""
    run = run_config(family_shards["deepseek_v32"], "float32", 8 * BLOCK_SIZE, block_size=BLOCK_SIZE)
    config = OffloadConfig(2**30, tmp_path / "tier", 2**30)
    run.with_offload(config)
    assert run.with_offload(config).offload.fingerprint  # reopened: the same run
    with pytest.raises(InputError, match=r"holds another run's KV cache \(it was written for cache_bytes .*"
                                         r"speculative_tokens '0'\)"):
        replace(run, speculative=SpeculativeConfig("mtp", 1)).with_offload(config)


HOST = {"deepseek_v32": 0.5, "deepseek_v4": 0.1}  # the host tier per family, in device pools: small enough to spill
DISK = 20


def workload(family: str, seed: int) -> tuple[list[list[int]], int]:
    """Prompts that share prefixes with earlier ones, each separated from the one it shares with by unrelated prompts
    that push its blocks out of a small device pool -> (prompts, the device pool's tokens). V3.2: 40-token prompts in
    a pool of 8 blocks. V4: around a 300-token base, hits at 192 (inside the HCA window 128 .. 255, which the request
    completes) and at 256 - 16, both past the first sliding window, in a pool of 22 blocks."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(2, 500, (n,), generator=gen).tolist()

    if family == "deepseek_v32":
        base = tokens(40)
        return [base, tokens(40), tokens(40), tokens(40), base[:35] + tokens(5), tokens(40), tokens(40), tokens(40),
                base + tokens(3)], 8 * BLOCK_SIZE
    base = tokens(300)
    return [base, tokens(300), base[:200] + tokens(60), tokens(300), base[:256], tokens(300), base[:270] + tokens(9)], \
        22 * BLOCK_SIZE


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_hits_from_host_and_after_a_restart_from_disk_give_the_tokens_computed_from_scratch(
        families, family, kv_cache_dtype, tmp_path):
    """Three engines on the same prompts: without prefix caching (the reference); with a small host tier (HOST)
    and a disk tier it spills to; then a fresh engine on the same directory (a restart): its device pool and host tier
    start empty, so the prompts seen once before (the ones between the shared ones) find blocks on disk."""
    model, new_cache = families[family]
    prompts, pool = workload(family, 7)
    fresh, _ = one_by_one(offload_engine(model, new_cache, kv_cache_dtype, pool, caching=False), prompts)
    fingerprint = open_directory(tmp_path / "tier", identity(kv_cache_dtype))
    first = offload_engine(model, new_cache, kv_cache_dtype, pool, HOST[family], tmp_path / "tier", DISK, fingerprint)
    got, cached = one_by_one(first, prompts)
    counts = first.connector.find(OffloadConnector).counts
    assert got == fresh
    assert counts.hit_tokens["host"] > 0 and counts.moved["host_to_disk"] > 0
    assert sum(cached) == sum(counts.hit_tokens.values())
    restarted = offload_engine(model, new_cache, kv_cache_dtype, pool, HOST[family], tmp_path / "tier", DISK,
                               fingerprint)
    again, cached_again = one_by_one(restarted, prompts)
    counts = restarted.connector.find(OffloadConnector).counts
    assert again == fresh
    assert cached_again[1] > 0 and counts.hit_tokens["disk"] > 0 and counts.corrupt_files == 0
    assert sum(cached_again) == sum(counts.hit_tokens.values())


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_a_graceful_stop_writes_the_host_tier_for_the_next_start(families, family, tmp_path):
    """Issue 71, 5: a host tier that holds the working set spills nothing; the engine's loop ends gracefully and
    writes it (V4: state blocks too) to disk; a new engine on the directory finds every full block of a prompt
    served early (gone from the device pool) there, and gives the tokens computed from scratch."""
    model, new_cache = families[family]
    _, pool = workload(family, 5)
    # the first prompt's blocks (V4: its state blocks too, one sequence slot's worth) leave the device pool
    length, count = (40, 6) if family == "deepseek_v32" else (300, 3)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (length,), generator=gen).tolist() for _ in range(count)]
    fingerprint = open_directory(tmp_path / "tier", identity("auto"))
    first = offload_engine(model, new_cache, "auto", pool, 8, tmp_path / "tier", DISK, fingerprint, max_seqs=1)
    fresh, _ = one_by_one(first, prompts)  # the first prompt's tokens computed from scratch (nothing was cached)
    assert first.connector.find(OffloadConnector).counts.moved["host_to_disk"] == 0
    first.run(EngineClient(), until_idle=True)  # nothing to run: the loop ends as a drained server's does
    written = scan(tmp_path / "tier", 0)
    assert written[BLOCK] and (family == "deepseek_v32") == (not written[STATE])
    restarted = offload_engine(model, new_cache, "auto", pool, 8, tmp_path / "tier", DISK, fingerprint, max_seqs=1)
    again, cached = one_by_one(restarted, prompts[:1])
    full = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    disk_hits = restarted.connector.find(OffloadConnector).counts.hit_tokens["disk"]
    assert again == fresh[:1] and cached == [full] and disk_hits == full


@pytest.mark.slow
def test_ctrl_c_on_a_live_server_keeps_its_host_tier_for_the_restart(family_shards, tmp_path):
    """Issue 71, 5, as a user meets it: `dsrun serve` with a host tier that holds the working set, stopped by Ctrl-C
    (the launcher's first SIGINT drains as SIGTERM does), exits 0 and writes the tier; the restarted server finds
    every full block of the prompt it served before (cached_tokens) and gives the same greedy tokens."""
    import signal

    import httpx

    from tests.helpers import Server, answer_ctrl_c

    flags = ("--dtype", "float32", "--cache-tokens", "256", "--kv-offloading-size", "0.01",
             "--kv-offloading-path", tmp_path / "tier", "--kv-offloading-disk-size", "0.01")
    prompt = torch.randint(2, 500, (70,), generator=torch.Generator().manual_seed(71)).tolist()
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answers = []
    for run in range(2):
        server = Server(family_shards["deepseek_v32"], tmp_path / f"server{run}.log", *flags,
                        preexec_fn=answer_ctrl_c)
        try:
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            answers.append((answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
            if run == 0:  # out of the device pool, into the host tier: a request of its own fills the pool
                httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [7] * 240}, timeout=120)
        finally:
            server.proc.send_signal(signal.SIGINT)
            assert server.proc.wait(120) == 0 and "dsrun serve: stopped" in server.log(), server.log()
    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert answers[1] == (answers[0][0], full), answers


def test_a_flush_stops_at_its_deadline(tmp_path):
    """The flush's bound (offload_store.FLUSH_S): ops left when the deadline has passed are not run."""
    store = tiny_store(tmp_path)
    store.run(OffloadOps(((SAVE, BLOCK, 1, 0),)))
    store.run(OffloadOps(((SPILL, BLOCK, 0, b"a"),)), deadline=time.monotonic() - 1)
    assert not (store.directory / file_name(BLOCK, b"a")).exists()
    store.flush(OffloadOps(((SPILL, BLOCK, 0, b"a"),)))
    assert (store.directory / file_name(BLOCK, b"a")).exists()


def test_v4_host_hits_mid_csa_window(families):
    """Blocks of 2 tokens and a device pool of 30: the shared prompts' blocks and state blocks are pushed out by the
    prompts between them, and come back from the host tier at 34 and 30 tokens, boundaries at 2 mod 4 that leave the
    CSA compressor's and the indexer's window half full (restored from offloaded state blocks)."""
    model, new_cache = families["deepseek_v4"]
    gen = torch.Generator().manual_seed(2)
    base, fillers = (torch.randint(2, 500, (40,), generator=gen).tolist(),
                     [torch.randint(2, 500, (44,), generator=gen).tolist() for _ in range(2)])
    prompts = [base + [3, 4], fillers[0], base[:34] + [5, 6, 7], fillers[1], base[:30] + [8]]
    fresh, _ = one_by_one(offload_engine(model, new_cache, "auto", 60, caching=False, block_size=2), prompts)
    _, alone = one_by_one(offload_engine(model, new_cache, "auto", 60, block_size=2), prompts)
    got, cached = one_by_one(offload_engine(model, new_cache, "auto", 60, 4, block_size=2), prompts)
    assert got == fresh and cached == [0, 0, 34, 0, 30] and alone[2] < 34


def test_offload_finds_what_the_device_pool_alone_loses(families):
    """V3.2's workload: the device pool alone has given up the shared prompts' blocks (all or part) by the time
    they come back; with a host tier of 4 times the device pool every shared full block is found."""
    model, new_cache = families["deepseek_v32"]
    prompts, pool = workload("deepseek_v32", 3)
    _, alone = one_by_one(offload_engine(model, new_cache, "auto", pool), prompts)
    _, offloaded = one_by_one(offload_engine(model, new_cache, "auto", pool, 4), prompts)
    assert alone[4] < 32 and alone[8] < 32
    assert offloaded == [0, 0, 0, 0, 32, 0, 0, 0, 32]


def test_bad_files_are_skipped_counted_and_removed_and_the_tokens_stay_right(families, tmp_path):
    """After a first engine has filled the disk tier: one of the first prompt's files truncated, its other one's
    payload changed, and a later prompt's first file replaced by another run's; a temporary file as a killed write
    leaves it. The restarted engine removes the temporary file unread, skips and removes the three, counts
    them, and computes those blocks: the tokens computed from scratch."""
    model, new_cache = families["deepseek_v32"]
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 500, (40,), generator=gen).tolist() for _ in range(10)]
    fresh, _ = one_by_one(offload_engine(model, new_cache, "auto", 8 * BLOCK_SIZE, caching=False), prompts)
    fingerprint = open_directory(tmp_path / "tier", identity("auto"))
    first = offload_engine(model, new_cache, "auto", 8 * BLOCK_SIZE, 0.25, tmp_path / "tier", 20, fingerprint)
    one_by_one(first, prompts)
    files = rank_directory(tmp_path / "tier", 0)
    a, b = (files / file_name(BLOCK, h) for h in block_hashes(prompts[0], BLOCK_SIZE))
    later = next(i for i in range(1, len(prompts))  # a later prompt whose first block is on disk
                 if (files / file_name(BLOCK, block_hashes(prompts[i], BLOCK_SIZE)[0])).exists())
    digest, size = block_hashes(prompts[later], BLOCK_SIZE)[0], first.worker.connector.store.unit_bytes[BLOCK]
    c = files / file_name(BLOCK, digest)
    assert a.exists() and b.exists()
    a.write_bytes(a.read_bytes()[:-100])
    data = bytearray(b.read_bytes())
    data[-1] ^= 0xFF
    b.write_bytes(bytes(data))
    c.write_bytes(encode("another run", BLOCK, digest, decode(c.read_bytes(), fingerprint, BLOCK, digest, size)))
    torn = files / f"{file_name(BLOCK, block_hashes(prompts[-1], BLOCK_SIZE)[0])}{TEMPORARY}4242"
    torn.write_bytes(b"half a file")
    restarted = offload_engine(model, new_cache, "auto", 8 * BLOCK_SIZE, 0.25, tmp_path / "tier", 20, fingerprint)
    assert not torn.exists()
    got, cached = one_by_one(restarted, [prompts[0], prompts[later]])
    assert got == [fresh[0], fresh[later]]
    assert restarted.connector.find(OffloadConnector).counts.corrupt_files == 3
    assert not a.exists() and not b.exists() and not c.exists()
    assert cached == [0, 0]


def test_a_full_disk_stops_writing_and_requests_go_on(families, tmp_path):
    """Every write the disk tier tries fails with ENOSPC: the first failure stops the spills; the requests get the
    tokens computed from scratch, and no file is left."""
    model, new_cache = families["deepseek_v32"]
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(2, 500, (40,), generator=gen).tolist() for _ in range(6)] * 2
    fresh, _ = one_by_one(offload_engine(model, new_cache, "auto", 8 * BLOCK_SIZE, caching=False), prompts)
    fingerprint = open_directory(tmp_path / "tier", identity("auto"))
    core = offload_engine(model, new_cache, "auto", 8 * BLOCK_SIZE, 0.25, tmp_path / "tier", 20, fingerprint)
    tries = []

    def full(path, data):
        tries.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    core.worker.connector.store.write = full
    got, _ = one_by_one(core, prompts)
    assert got == fresh
    stopped = core.connector.find(OffloadConnector).counts.disk_stopped
    assert len(tries) == 1 and stopped.startswith("ENOSPC on rank 0: writing")
    assert core.connector.health()["kv_offload_disk"].startswith("disabled: ENOSPC")
    assert not list(rank_directory(tmp_path / "tier", 0).iterdir())


# -- world 16 ------------------------------------------------------------------------------------------------------

# the other two pairs are left to `pytest -m manual` for the suite's 20 minutes (about 12 s each; docs/testing.md)
WORLD_16_CASES = [("deepseek_v32", "int8"), ("deepseek_v4", "auto"),
                  pytest.param("deepseek_v32", "auto", marks=pytest.mark.manual),
                  pytest.param("deepseek_v4", "int8", marks=pytest.mark.manual)]


@pytest.mark.slow
@pytest.mark.parametrize("family,kv_cache_dtype", WORLD_16_CASES)
def test_world_16_host_and_disk_hits_after_a_restart(families, tiny_source, tmp_path, family, kv_cache_dtype):
    """DP16 / EP16: the workload one prompt after another on attention-DP rank 5, with a host and a disk tier; then
    the ranks started again on the same directory: both runs give the tokens computed from scratch at world 1, and
    the restarted one finds its first prompt's blocks on disk."""
    model, new_cache = families[family]
    prompts, pool = workload(family, 16)
    fresh, _ = one_by_one(offload_engine(model, new_cache, kv_cache_dtype, pool, caching=False), prompts)
    shards = tmp_path / "w16"
    shard(tiny_source(family, "fp8"), shards, Layout(16, 16, 16, 1))
    run = run_config(shards, "float32", pool, kv_cache_dtype=kv_cache_dtype, max_num_seqs=2, block_size=BLOCK_SIZE)
    size = pool_bytes(new_cache(pool, kv_cache_dtype, block_size=BLOCK_SIZE, max_seqs=2, prefix_caching=True))
    run = run.with_offload(OffloadConfig(int(size * 16 * HOST[family]), tmp_path / "tier", size * 16 * DISK))
    results = []
    for attempt in range(2):
        got = launch_ranks(one_after_another, {"prompts": prompts, "max_new_tokens": NEW_TOKENS, "dp_rank": 5}, run,
                           tmp_path / f"results{attempt}")
        results.append(got)
    assert [r["generated"] for r in results] == [fresh, fresh]
    assert results[0]["cached"][1] == 0 and results[1]["cached"][1] > 0  # seen once before: on disk
    meta = json.loads((tmp_path / "tier" / DIRECTORY_META).read_text())
    assert meta["world_size"] == 16 and any(rank_directory(tmp_path / "tier", 5).iterdir())


def test_metrics_count_what_grew_per_tier_and_direction():
    """The scheduler's running totals become Prometheus counters: per tier, per direction, corrupt files."""
    from types import SimpleNamespace

    from dsconv.runner.engine.metrics import ServeMetrics

    metrics, counts = ServeMetrics("m", 1), OffloadCounts()
    scheduler = SimpleNamespace(counts=counts)
    counts.hit_tokens["disk"] += 32
    counts.moved["host_to_device"] += 4096
    counts.evictions["host"] += 2
    counts.corrupt_files += 1
    metrics.record_offload(scheduler)
    counts.hit_tokens["disk"] += 16
    metrics.record_offload(scheduler)
    value = metrics.registry.get_sample_value
    assert value("dsrun:kv_offload_hit_tokens_total", {"model_name": "m", "tier": "disk"}) == 48
    assert value("dsrun:kv_offload_bytes_total", {"model_name": "m", "direction": "host_to_device"}) == 4096
    assert value("dsrun:kv_offload_evictions_total", {"model_name": "m", "tier": "host"}) == 2
    assert value("dsrun:kv_offload_corrupt_files_total", {"model_name": "m"}) == 1


def test_the_ready_line_gives_each_tiers_size(tmp_path):
    """512 MiB a rank on disk holds 511 files of a 1 MiB block: the disk size counts their headers (issue 71, 4)."""
    config = OffloadConfig(2 * 2**30, tmp_path, 8 * 2**30)
    units = {BLOCK: 2**20, STATE: 0}
    files = file_bytes("f" * 32, units)
    assert files[BLOCK] == len(encode("f" * 32, BLOCK, bytes(16), bytes(2**20)))
    shape = TierShape.of(config, 16, {BLOCK: 100, STATE: 0}, units, files)
    assert shape.host == {BLOCK: 128, STATE: 0} and shape.disk == {BLOCK: 511, STATE: 0}
    assert shape.summary(config) == (f"KV offload: host 2 GiB (128 blocks a rank), disk 8 GiB at {tmp_path} (511 "
                                     f"blocks a rank)")


def test_files_found_past_a_smaller_disk_size_are_dropped():
    """Restarted with room for 2 files where 3 were kept: the oldest one's file goes in the first step."""
    shape = TierShape({BLOCK: 1, STATE: 0}, {BLOCK: 2, STATE: 0}, {BLOCK: 8, STATE: 0})
    offloader = Offloader(shape, {BLOCK: [b"old", b"mid", b"new"], STATE: []}, OffloadCounts())
    assert offloader.take_ops().ops == ((DROP, BLOCK, b"old"),)
    assert [offloader.where(BLOCK, h) for h in (b"old", b"mid", b"new")] == [None, "disk", "disk"]


def test_a_block_is_on_disk_only_where_every_rank_of_its_dp_index_has_its_file(tmp_path):
    """Issue 71, 4: every rank's directory is scanned; a hash whose file only some ranks of the DP index have is
    no hit, and those files go in the first step."""
    for rank, hashes in ((0, [b"a", b"b", b"c"]), (1, [b"b", b"c", b"d"])):
        directory = rank_directory(tmp_path, rank)
        directory.mkdir()
        for digest in hashes:
            (directory / file_name(BLOCK, digest)).write_bytes(b"")
    known, strays = agree([scan(tmp_path, 0), scan(tmp_path, 1)])
    assert sorted(known[BLOCK]) == [b"b", b"c"] and sorted(strays[BLOCK]) == [b"a", b"d"]
    shape = TierShape({BLOCK: 1, STATE: 0}, {BLOCK: 4, STATE: 0}, {BLOCK: 8, STATE: 0})
    offloader = Offloader(shape, known, OffloadCounts(), strays)
    assert sorted(op[2] for op in offloader.take_ops().ops if op[0] == DROP) == [b"a", b"d"]
    assert [offloader.where(BLOCK, h) for h in (b"a", b"b", b"c", b"d")] == [None, "disk", "disk", None]


# -- the KV connector seam (issue 73) ------------------------------------------------------------------------------

def test_a_connector_written_in_the_tests_plugs_in_through_the_seam(families):
    """tests/dict_connector.py, written against runner/engine/kv_connector/base.py alone, saves every block the
    device pool gives up into a dict on the rank and serves prefixes from it: on V3.2's workload it finds every shared
    full block the device pool alone loses (as a large host tier does), the tokens are those computed from scratch,
    and its calls come in the order docs/architecture.md gives for a step."""
    from tests.dict_connector import DictConnector, DictWorker

    model, new_cache = families["deepseek_v32"]
    prompts, pool = workload("deepseek_v32", 3)
    fresh, _ = one_by_one(offload_engine(model, new_cache, "auto", pool, caching=False), prompts)
    cache = new_cache(pool, "auto", block_size=BLOCK_SIZE, max_seqs=2, prefix_caching=True)
    connector = DictConnector()
    got, cached = one_by_one(engine(model, cache, 2, 4096, True, connector=connector,
                                    connector_worker=DictWorker(cache)), prompts)
    assert got == fresh and cached == [0, 0, 0, 0, 32, 0, 0, 0, 32] and connector.hit_tokens >= BLOCK_SIZE
    calls = " ".join(connector.calls) + " "
    assert re.fullmatch(r"((hit |evicted )*step_meta reported (finished removed )*)+", calls), calls[:300]
    assert "evicted" in calls


def test_nothing_is_set_on_an_engine_from_outside_its_parts(family_shards, tmp_path, monkeypatch):
    """start_engine hands every optional part (KV offload's connector, the expert-load balancer, the shape recorder,
    the metrics) to new_engine: from start_engine on, through requests to a graceful stop, every assignment to an
    attribute of the engine or one of its parts comes from a method of that part's own class (a recorder on each
    class hears each assignment and who made it). Before issue 73 start_engine set worker.balancer, worker.offload
    and the scheduler's offloaders on the built engine, and the loop set scheduler.on_lease."""
    import sys

    from dsconv.runner.engine import core, dp_rank, sample_plan, scheduler, shapes, worker
    from dsconv.runner.engine.block_pool import BlockPool, StatePool
    from dsconv.runner.engine.kv_connector.offload import OffloadConnector, OffloadWorker
    from dsconv.runner.engine.kv_offload import Offloader
    from dsconv.runner.engine.metrics import ServeMetrics
    from dsconv.runner.engine.request import SamplingParams
    from dsconv.runner.models.eplb import ExpertBalancer

    parts = (core.EngineCore, worker.Worker, worker.InputBuilder, scheduler.Scheduler, dp_rank.DPRank, BlockPool,
             StatePool, sample_plan.SamplePlan, OffloadConnector, OffloadWorker, Offloader, OffloadStore,
             ExpertBalancer, shapes.ShapeRecorder, ServeMetrics)
    outside = []

    def recorded(self, name, value):
        caller = sys._getframe(1)  # a method of the part's own (a dataclass's generated __init__ included)
        own = caller.f_locals.get("self") is self or any(caller.f_code.co_qualname.startswith(f"{cls.__name__}.")
                                                           for cls in type(self).__mro__)
        if not own:
            outside.append(f"{caller.f_code.co_qualname} set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    for part in parts:
        monkeypatch.setattr(part, "__setattr__", recorded)
    run = run_config(family_shards["deepseek_v32"], "float32", 8 * BLOCK_SIZE, block_size=BLOCK_SIZE,
                     max_num_seqs=2, expert_load_record=tmp_path / "load.json")
    run = replace(run, record_shapes=tmp_path / "shapes.jsonl").with_offload(
        OffloadConfig(4 * run.cache_bytes[0] * run.cache_blocks))
    built = core.start_engine(run, metrics=ServeMetrics("tiny", 1))
    door, finished = EngineClient(), []
    door.open(built)
    for prompt in workload("deepseek_v32", 5)[0]:
        door.submit(prompt, SamplingParams(max_tokens=4), lambda out: finished.append(out) if out.finished else None)
    built.run(door, until_idle=True)
    assert len(finished) == 9 and all(out.error is None for out in finished)
    assert built.connector.find(OffloadConnector) is not None and built.worker.balancer is not None
    assert not outside, outside
