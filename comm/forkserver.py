"""The fork server that local CPU ranks start from, and starting it before the command's own imports.

A local CPU job forks its ranks from multiprocessing's fork server, which imports torch and the entry's modules once
for every rank (comm/launch.py). It imports them in a process of its own, so a command that starts it first thing
imports torch in both processes at once instead of one after the other: `dsrun generate --max-new-tokens 1` took
3.00 s instead of 4.04 at world 1 and 3.60 instead of 4.68 at world 16 (medians of 5, 2-core AMD EPYC,
scripts/bench_startup.py). This module imports neither torch nor anything that does, so that the fork server is
started before they load.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_MODULE = "dsconv.comm.launch"  # the ranks' own code (comm/launch.py), which every rank runs
SERVER_MODULE = "dsconv.comm.rank_server"  # imported in the fork server alone: it outlives a SIGTERM to the group


def under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV)


def forks_ranks(device: str) -> bool:
    """Whether a local job on `device` forks its ranks from the fork server (CPU); accelerator ranks are spawned
    (a forked process cannot use a device its parent has initialised), and torchrun starts its own."""
    return device == "cpu" and not under_torchrun()


def rank_preload(modules: list[str]) -> list[str]:
    """What the fork server imports: its SIGTERM shield (comm/rank_server.py), then for every rank torch, its
    distributed package, the launcher's rank code and the entry's `modules` (each rank imports them to unpickle its
    entry)."""
    return list(dict.fromkeys([SERVER_MODULE, "torch", "torch.distributed", LAUNCH_MODULE, *modules]))


def start_rank_server(device: str, modules: list[str]) -> None:
    """Start the fork server for a job on `device` whose entry lives in `modules`, now, if the job will fork its
    ranks from it; it imports rank_preload(modules) while this process goes on. It must run before anything
    changes this process's environment for the ranks (the server and every rank keep the environment it started
    with). A later launch with other modules still works: its ranks import what the server did not."""
    if not forks_ranks(device):
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(rank_preload(modules))
    multiprocessing.forkserver.ensure_running()
