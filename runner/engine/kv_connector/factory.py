"""The connectors a run asks for, built on every rank at start (engine/core.py's start_engine calls this before it
assembles the engine): KV offload (--kv-offloading-*) and P/D disaggregation (--kv-transfer-config), in the order
their work runs on a rank: offload's copies first, then a consumer's reads."""

from __future__ import annotations

import pickle

from dsconv.comm.collectives import gather_bytes
from dsconv.comm.kv_transfer import TransferAgent
from dsconv.runner.engine.kv_connector.base import KVConnector, KVConnectorWorker
from dsconv.runner.engine.kv_connector.multi import MultiConnector, MultiConnectorWorker
from dsconv.runner.engine.kv_connector.offload import OffloadConnector, OffloadWorker
from dsconv.runner.engine.kv_connector.pd import ConsumerConnector, ProducerConnector, TransferWorker
from dsconv.runner.engine.kv_offload import BLOCK, STATE, OffloadConfig, TierShape
from dsconv.runner.engine.kv_transfer import KVTransferConfig, rank_regions
from dsconv.runner.engine.offload_store import OffloadStore, agree, file_bytes, scan

# one rank's transfer session and registered regions, pickled: a few hundred bytes (gather_bytes sends longer ones
# in a second round)
REGIONS_BYTES = 8 * 2**10


def build_for(cache, dist, run) -> tuple[KVConnector | None, KVConnectorWorker | None]:
    """`build` with what `run` (a RunConfig) asks for: --kv-offloading-* and --kv-transfer-config."""
    return build(cache, dist, run.offload, run.scheduler.kv_transfer)


def build(cache, dist, offload: OffloadConfig | None = None, kv_transfer: KVTransferConfig | None = None
          ) -> tuple[KVConnector | None, KVConnectorWorker | None]:
    """On every rank, every rank calling it (P/D gathers every rank's regions to rank 0) -> (rank 0's scheduler side,
    None on the others; this rank's worker side), each None without a connector, a list's when there are two."""
    leads, sides = dist.rank == 0, []
    if offload is not None:
        sides.append(_offload(cache, dist, offload, leads))
    if kv_transfer is not None:
        sides.append(_transfer(cache, dist, kv_transfer, leads))
    if not sides:
        return None, None
    if len(sides) == 1:
        return sides[0]
    connectors, workers = zip(*sides)
    return (MultiConnector(list(connectors)) if leads else None), MultiConnectorWorker(list(workers))


def _offload(cache, dist, config: OffloadConfig, leads: bool) -> tuple[OffloadConnector | None, OffloadWorker]:
    """This rank's host slots (and disk files); on rank 0 the tiers' index, the disk tier's files found at start
    included (every rank's: a block counts where every rank of its DP index has a file for it)."""
    blocks, states = cache.transfer_views()
    units = {BLOCK: sum(view.shape[1] for view in blocks), STATE: sum(view.shape[1] for view in states)}
    shape = TierShape.of(config, dist.world_size, {BLOCK: cache.num_blocks, STATE: cache.state_blocks}, units,
                         file_bytes(config.fingerprint, units))
    tp, dp_index = dist.attn_tp, dist.rank // dist.attn_tp
    worker = OffloadWorker(OffloadStore(cache, shape, dp_index, dist.rank, config.path, config.fingerprint))
    if not leads:
        return None, worker
    found = None if config.path is None else \
        [agree([scan(config.path, rank) for rank in range(index * tp, (index + 1) * tp)])
         for index in range(dist.world_size // tp)]
    return OffloadConnector(config, shape, found, dist.world_size // tp), worker


def _transfer(cache, dist, config: KVTransferConfig, leads: bool) -> tuple[KVConnector | None, TransferWorker]:
    """This rank's transfer engine; a producer's ranks register their caches, and rank 0 learns every rank's
    session and regions, which its offers name."""
    agent = TransferAgent(config.host)
    worker = TransferWorker(agent, cache.transfer_views(), dist.attn_tp_rank)
    mine = rank_regions(agent, cache) if config.producer else None
    if dist.world_size == 1:
        everyone = [mine]
    else:
        parts = gather_bytes(pickle.dumps(mine), dist.groups.host, 0, REGIONS_BYTES)
        everyone = None if parts is None else [pickle.loads(part) for part in parts]
    if not leads:
        return None, worker
    dp, tp = dist.world_size // dist.attn_tp, dist.attn_tp
    if not config.producer:
        return ConsumerConnector(config, dp), worker
    return ProducerConnector(config, [tuple(everyone[index * tp:(index + 1) * tp]) for index in range(dp)]), worker
