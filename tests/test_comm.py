"""comm/: launch, process groups and collectives on real gloo process groups (CPU).

One 16-rank launch runs every group and collective check in sequence (each rank asserts; a failed assert
fails its rank, which fails the launch with the rank and the assertion named). Small 4-rank launches check
that failures end the job quickly and loudly. Rank bodies are module-level functions so the ranks can
import them.
"""

import json
import multiprocessing.util
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsconv.comm.collectives import (all_gather_cat, all_reduce_sum, all_to_all_counted,
                                     all_to_all_variable, barrier, broadcast_bytes,
                                     gather_bytes)
from dsconv.comm.groups import Group, make_groups
from dsconv.comm.launch import backend_for, launch
from dsconv.errors import InputError
from dsconv.family.layout import Layout

REPO = Path(__file__).resolve().parents[1]
V32_LAYOUT = Layout(16, ep=16, tp=16, attn_tp=8)  # attention DP2 x TP8, EP16, lm_head TP16
SEED = 1234  # shared by all ranks, so each can rebuild what every other rank sends
TIMEOUT_S = 120.0  # collective timeout; failure tests must end far sooner, by the supervisor's kill
# From a rank's failure to the job's end. The supervisor's stop takes seconds; without it the other ranks would
# wait for the collective timeout (TIMEOUT_S) or for ever. Measured from the failure, not from the launch: how
# long ranks take to start depends on the machine's load, and is no part of the claim.
FAILURE_BOUND_S = 60.0
# Polls for an event (ranks up, processes gone) end as soon as it happens; the bound only ends a broken run.
EVENT_BOUND_S = 300.0


# ---------------------------------------------------------------------------------------------------------
# 16 ranks: groups and collectives

def _check_sixteen_ranks() -> None:
    rank = dist.get_rank()
    print(f"hello from rank {rank}")
    manifest_layout = json.loads(json.dumps(V32_LAYOUT.to_json()))  # as the manifest stores it
    groups = make_groups(manifest_layout)
    _check_membership(groups, rank)
    _check_all_reduce(groups, rank)
    _check_all_gather(groups, rank)
    for dtype in (torch.int8, torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for row_shape in ((), (3, 2)):
            _check_all_to_all(groups.ep, rank, dtype, row_shape, zero_senders={5}, zero_receivers={7})
    _check_all_to_all(groups.attn_dp, rank, torch.int8, (4,), zero_senders=set(), zero_receivers=set())
    _check_all_to_all(groups.ep, rank, torch.float32, (4,), zero_senders=set(range(16)), zero_receivers=set())
    _check_bytes(groups, rank)
    with pytest.raises(IndexError):  # a row past its block: refused before anything is sent
        all_to_all_counted(torch.zeros(3, 2), torch.tensor([3] + [0] * 15), 2, groups.ep)
    barrier(groups.attn_tp)
    barrier(groups.attn_dp)
    _check_reused_and_trivial_groups(rank)


def _check_reused_and_trivial_groups(rank: int) -> None:
    # V4-Flash: attention replicated, so attn_tp groups have one rank and attn_dp is the world; no new groups.
    v4 = make_groups(Layout(16, ep=16, tp=16, attn_tp=1))
    assert v4.attn_tp.ranks == (rank,) and v4.attn_tp.handle is None
    assert v4.attn_dp.handle is dist.group.WORLD
    x = torch.tensor([float(rank)])
    assert all_reduce_sum(x, v4.attn_tp).item() == rank
    assert torch.equal(all_gather_cat(x, v4.attn_tp, dim=0), x)
    recv, recv_counts = all_to_all_variable(torch.arange(3), [3], v4.attn_tp)
    assert recv.tolist() == [0, 1, 2] and recv_counts == [3]
    barrier(v4.attn_tp)
    assert v4.mc2 is None  # made for the NPU path only
    # MC2's ops allow no other op in their communicator: the EP members again, in a group of their own
    npu = make_groups(Layout(16, ep=16, tp=16, attn_tp=1), mc2=True)
    assert npu.mc2.ranks == npu.ep.ranks and npu.mc2.rank == npu.ep.rank
    assert all(npu.mc2.handle is not getattr(npu, name).handle for name in ("world", "ep", "tp", "attn_dp", "host"))
    # Identical member lists share one process group.
    shared = make_groups(Layout(16, ep=8, tp=8, attn_tp=8))
    assert shared.ep.handle is shared.attn_tp.handle is shared.tp.handle
    # Gather within a subgroup, in group-rank order: [0..7] on ranks 0..7, [8..15] on ranks 8..15.
    gathered = all_gather_cat(torch.tensor([rank]), shared.attn_tp, dim=0)
    assert gathered.tolist() == list(shared.attn_tp.ranks)


def _payload(rank: int, length: int) -> bytes:
    return bytes((rank + i) % 256 for i in range(length))


def _check_bytes(groups, rank: int) -> None:
    """Payloads with their lengths in the blocks' headers: empty, within the capacity, at it, and past it (a second
    collective, which every member enters from the headers alone)."""
    for length in (0, 5, 16, 40):
        source = groups.world.ranks[3]
        got = broadcast_bytes(_payload(3, length) if rank == source else None, groups.world, source, 16)
        assert got == _payload(3, length), (length, got)
    lengths = [rank % 3 * 9 for rank in range(16)]  # 0, 9 and 18 bytes against a capacity of 16 (rank 2's too)
    for dest in (0, 2):
        got = gather_bytes(_payload(rank, lengths[rank]), groups.world, dest, 16)
        assert got == ([_payload(r, n) for r, n in enumerate(lengths)] if rank == dest else None), (dest, got)
    dest = groups.attn_tp.ranks[1]
    got = gather_bytes(_payload(rank, 20), groups.attn_tp, dest, 16)
    assert got == ([_payload(r, 20) for r in groups.attn_tp.ranks] if rank == dest else None)


def _check_membership(groups, rank: int) -> None:
    expected = V32_LAYOUT.groups()
    for name in ("attn_tp", "attn_dp", "ep", "tp"):
        group = getattr(groups, name)
        [members] = [m for m in expected[name] if rank in m]
        assert list(group.ranks) == members, (name, group.ranks, members)
        assert group.ranks[group.rank] == rank
        assert dist.get_process_group_ranks(group.handle) == members, name
    assert groups.world.ranks == tuple(range(16)) and groups.world.rank == rank
    assert groups.ep.handle is dist.group.WORLD and groups.tp.handle is dist.group.WORLD  # reused, not rebuilt


def _check_all_reduce(groups, rank: int) -> None:
    x = torch.tensor([float(rank), 1.0])
    assert all_reduce_sum(x, groups.attn_tp) is x  # in place
    block = range(0, 8) if rank < 8 else range(8, 16)
    assert x.tolist() == [float(sum(block)), 8.0]
    y = torch.tensor([rank], dtype=torch.int64)
    all_reduce_sum(y, groups.attn_dp)
    assert y.item() == 2 * (rank % 8) + 8  # {r, r + 8}


def _check_all_gather(groups, rank: int) -> None:
    full = torch.randn(5, 16 * 3, generator=torch.Generator().manual_seed(SEED))  # [tokens, vocab]
    mine = full[:, 3 * rank:3 * rank + 3]  # this rank's vocab slice, not contiguous
    assert torch.equal(all_gather_cat(mine, groups.tp, dim=1), full)


def _sent_by(src: int, size: int, dtype, row_shape, zero_senders, zero_receivers):
    """What group rank `src` sends: (rows [N, *row_shape] grouped by destination, counts [size])."""
    gen = torch.Generator().manual_seed(SEED + src)
    counts = torch.randint(0, 4, (size,), generator=gen)  # 0..3 rows per destination: zeros do occur
    counts[list(zero_receivers)] = 0
    if src in zero_senders:
        counts[:] = 0
    shape = (int(counts.sum()), *row_shape)
    if dtype.is_floating_point:
        rows = torch.randn(shape, generator=gen).to(dtype)
    else:
        rows = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int64).to(dtype)
    return rows, counts


def _check_all_to_all(group, rank, dtype, row_shape, zero_senders, zero_receivers) -> None:
    """Both forms of the exchange: variable-size after the counts, and the counts in fixed-capacity blocks (capacity
    3, the most `_sent_by` sends one rank; with one-byte rows the header takes eight rows)."""
    send, counts = _sent_by(group.rank, group.size, dtype, row_shape, zero_senders, zero_receivers)
    _check_received(group, dtype, row_shape, zero_senders, zero_receivers, *all_to_all_variable(send, counts, group))
    recv, recv_counts, sent = all_to_all_counted(send, counts, 3, group, async_op=True).wait()
    assert sent == counts.tolist()
    _check_received(group, dtype, row_shape, zero_senders, zero_receivers, recv, recv_counts)


def _check_received(group, dtype, row_shape, zero_senders, zero_receivers, recv, recv_counts) -> None:
    # Brute force: slice every sender's buffer for the rows addressed to us.
    expected_rows, expected_counts = [], []
    for src in range(group.size):
        rows, src_counts = _sent_by(src, group.size, dtype, row_shape, zero_senders, zero_receivers)
        start = int(src_counts[:group.rank].sum())
        expected_rows.append(rows[start:start + int(src_counts[group.rank])])
        expected_counts.append(int(src_counts[group.rank]))
    expected = torch.cat(expected_rows)
    assert recv_counts == expected_counts, (recv_counts, expected_counts)
    assert recv.dtype == dtype and recv.shape == expected.shape, (recv.dtype, recv.shape, expected.shape)
    assert torch.equal(recv.view(torch.uint8), expected.view(torch.uint8)), (group.name, dtype, row_shape)


def test_counted_exchange_refuses_rows_over_its_capacity():
    alone = Group("ep", (0,), 0, None)
    rows = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="3 rows cannot travel in 1 blocks of capacity 2"):
        all_to_all_counted(rows, torch.tensor([3]), 2, alone)
    with pytest.raises(ValueError, match=r"must give one count per rank of group ep \(1\)"):
        all_to_all_counted(rows, torch.tensor([1, 2]), 3, alone)
    recv, counts, sent = all_to_all_counted(rows, torch.tensor([3]), 3, alone)
    assert recv is rows and counts == sent == [3]


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """A fresh directory as tempfile's, where launch makes its ranks' store: -> it, empty."""
    multiprocessing.util.get_temp_dir()  # multiprocessing's own (the fork server's socket) stays where it was
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


@pytest.mark.slow
def test_sixteen_ranks_groups_and_collectives(tmp_path, scratch, capsys):
    logs = tmp_path / "logs"
    code = launch(_check_sixteen_ranks, (), world_size=16, device="cpu", timeout_s=TIMEOUT_S, log_dir=logs)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "hello from rank 5" in (logs / "rank5.log").read_text()  # ranks > 0 log to files
    assert not (logs / "rank0.log").exists()  # rank 0 keeps the console and had nothing to report
    assert list(scratch.iterdir()) == []  # the ranks' store is gone with the job


# ---------------------------------------------------------------------------------------------------------
# Failures end the job: loudly, once, within a bound

def _mark_failure(marker_dir: str) -> None:
    Path(marker_dir, "failed_at").write_text(repr(time.time()))


def _failed_at(marker_dir: Path) -> float:
    return float((marker_dir / "failed_at").read_text())


def _raise_while_others_wait(marker_dir: str) -> None:
    rank = dist.get_rank()
    trio = dist.new_group([0, 1, 2])  # every rank creates it, members or not
    dist.barrier()
    if rank == 3:
        _mark_failure(marker_dir)
        raise RuntimeError("boom from rank 3")
    if rank == 2:
        time.sleep(10 * TIMEOUT_S)  # alive and silent: ranks 0 and 1 would wait for it until killed
    dist.all_reduce(torch.ones(1), group=trio)


def _sigkill_while_others_wait(marker_dir: str) -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        _mark_failure(marker_dir)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _failure_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "failed:" in line]


def test_rank_that_raises_ends_the_job(tmp_path, scratch, capsys):
    logs = tmp_path / "logs"
    code = launch(_raise_while_others_wait, (str(tmp_path),), world_size=4, device="cpu", timeout_s=TIMEOUT_S,
                  log_dir=logs)
    ended = time.time()
    err = capsys.readouterr().err
    assert code != 0
    assert ended - _failed_at(tmp_path) < FAILURE_BOUND_S
    assert _failure_lines(err) == [f"rank 3 failed: RuntimeError: boom from rank 3 (logs in {logs})"], err
    assert "Traceback" in (logs / "rank3.log").read_text()
    assert list(scratch.iterdir()) == []  # a failed job leaves no store behind either


def test_rank_killed_by_signal_ends_the_job(tmp_path, capsys):
    code = launch(_sigkill_while_others_wait, (str(tmp_path),), world_size=4, device="cpu", timeout_s=TIMEOUT_S, log_dir=tmp_path)
    ended = time.time()
    err = capsys.readouterr().err
    assert code != 0
    assert ended - _failed_at(tmp_path) < FAILURE_BOUND_S
    assert _failure_lines(err) == [f"rank 1 failed: killed by SIGKILL (logs in {tmp_path})"], err


# ---------------------------------------------------------------------------------------------------------
# The supervisor itself: Ctrl-C stops every rank; a killed supervisor leaves no rank behind

def _write_pid_and_sleep(pid_dir: str) -> None:
    rank = dist.get_rank()

    def stopped(signum, frame):  # the supervisor stops a rank by SIGTERM; one it lost would get none
        Path(pid_dir, f"{rank}.stopped").touch()
        os._exit(0)

    signal.signal(signal.SIGTERM, stopped)
    # Written whole under a temporary name, so a reader never sees an empty file
    tmp = Path(pid_dir, f"{rank}.pid.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(tmp.with_suffix(""))
    time.sleep(10 * TIMEOUT_S)


SUPERVISOR = """
import sys
from dsconv.comm.launch import launch
from test_comm import _write_pid_and_sleep
if __name__ == "__main__":
    sys.exit(launch(_write_pid_and_sleep, (sys.argv[1],), world_size=2, device="cpu", timeout_s=120.0,
                    log_dir=sys.argv[1]))
"""

# Ctrl-C inside the last rank's Process.start(), after the fork server forked it and before the supervisor has
# its pid (CPython's forkserver Popen._launch): the one moment a supervisor could lose track of a rank.
SUPERVISOR_INTERRUPTED_WHILE_STARTING = """
import os, signal, sys, time
from multiprocessing import popen_forkserver
from pathlib import Path

launch_one = popen_forkserver.Popen._launch

def launch_then_interrupt(self, process_obj):
    launch_one(self, process_obj)
    if process_obj.name == "rank1":
        while len(list(Path(sys.argv[1]).glob("*.pid"))) < 2:  # both ranks are up
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

popen_forkserver.Popen._launch = launch_then_interrupt
""" + SUPERVISOR


def _start_supervisor(tmp_path, script: str = SUPERVISOR) -> tuple[subprocess.Popen, list[int]]:
    """The supervisor in its own process, once both ranks have written their pid files. Its stderr goes to a
    file: a pipe would reach end-of-file only when the fork server and resource tracker it started have
    exited too, which takes seconds more under load and is no part of what the tests claim."""
    path = [str(REPO / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # the test module by name, and dsconv as we see it
    from tests.helpers import answer_ctrl_c  # here: the ranks import this module by name, without `tests`

    with open(tmp_path / "supervisor.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(tmp_path)], env=env, stderr=err,
                                preexec_fn=answer_ctrl_c)  # Ctrl-C reaches it even from a background job
    deadline = time.monotonic() + EVENT_BOUND_S
    while len(list(tmp_path.glob("*.pid"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    if len(pids) < 2:
        _kill_leftovers(proc, pids)
        pytest.fail(f"the ranks did not start: {_supervisor_err(tmp_path)}")
    return proc, pids


def _supervisor_err(tmp_path) -> str:
    return (tmp_path / "supervisor.err").read_text()


def _wait_gone(pids: list[int], bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    # A rank that exited but is not reaped yet (a zombie) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped, possibly while we read
        return False


def _assert_interrupted(proc: subprocess.Popen, pids: list[int], tmp_path) -> None:
    try:
        proc.wait(timeout=EVENT_BOUND_S)
        # The supervisor stopped and joined every rank before exiting (a rank it had lost track of would exit
        # on its own once the supervisor is gone, unstopped)
        assert sorted(p.name for p in tmp_path.glob("*.stopped")) == ["0.stopped", "1.stopped"], \
            _supervisor_err(tmp_path)
        assert [pid for pid in pids if _alive(pid)] == [], _supervisor_err(tmp_path)
        assert proc.returncode == 130, _supervisor_err(tmp_path)
        assert "interrupted: stopping 2 ranks" in _supervisor_err(tmp_path)
    finally:
        _kill_leftovers(proc, pids)


def _kill_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    """Never leave our own processes behind, even when a test fails."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    proc, pids = _start_supervisor(tmp_path)
    proc.send_signal(signal.SIGINT)
    _assert_interrupted(proc, pids, tmp_path)


@pytest.mark.slow
def test_ctrl_c_while_ranks_start_stops_every_rank(tmp_path):
    proc, pids = _start_supervisor(tmp_path, SUPERVISOR_INTERRUPTED_WHILE_STARTING)  # it interrupts itself
    _assert_interrupted(proc, pids, tmp_path)


@pytest.mark.slow
def test_ranks_exit_when_supervisor_is_killed(tmp_path):
    proc, pids = _start_supervisor(tmp_path)
    proc.kill()
    proc.wait()
    try:
        assert _wait_gone(pids, bound_s=EVENT_BOUND_S)
    finally:
        _kill_leftovers(proc, pids)


# ---------------------------------------------------------------------------------------------------------
# Under torchrun: the entry runs in this process (a one-rank "torchrun" environment keeps it cheap)

def _one_rank_body(fail: bool, user_error: bool = False) -> None:
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    if user_error:
        raise InputError("--max-model-len 9 does not fit")
    if fail:
        raise ValueError("bad shard")


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="0").items():  # port 0: the OS picks
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():  # a failed entry leaves the group up; torchrun would end the process here
        dist.destroy_process_group()


def test_under_torchrun_runs_in_this_process(torchrun_env, tmp_path, capfd):
    assert launch(_one_rank_body, (False,), world_size=1, device="cpu", timeout_s=30, log_dir=tmp_path) == 0
    assert not dist.is_initialized()
    assert launch(_one_rank_body, {"fail": True}, world_size=1, device="cpu", timeout_s=30, log_dir=tmp_path) == 1
    assert _failure_lines(capfd.readouterr().err) == [f"rank 0 failed: ValueError: bad shard (logs in {tmp_path})"]
    # a user mistake only a rank could find: exit 2, as for one the command finds itself
    dist.destroy_process_group()  # what the failed entry left up (torchrun would have ended the process)
    assert launch(_one_rank_body, {"fail": False, "user_error": True}, world_size=1, device="cpu", timeout_s=30,
                  log_dir=tmp_path / "user") == 2


def test_under_torchrun_world_size_must_match(torchrun_env, tmp_path):
    with pytest.raises(InputError, match="torchrun started 1 processes but the layout needs world size 16"):
        launch(_one_rank_body, (False,), world_size=16, device="cpu", timeout_s=30, log_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# backend_for

def test_backend_for_cpu_is_gloo():
    assert backend_for("cpu") == "gloo"


def test_backend_for_unknown_device_names_it():
    with pytest.raises(ValueError, match="device='tpu' is not one of 'npu', 'cuda', 'cpu'"):
        backend_for("tpu")


def test_backend_for_npu_without_torch_npu():
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    with pytest.raises(InputError, match="--device npu needs torch_npu"):
        backend_for("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_backend_for_cuda_without_cuda():
    with pytest.raises(InputError, match="--device cuda, but torch sees no CUDA device"):
        backend_for("cuda")


def test_only_local_cpu_jobs_start_their_fork_server_early(monkeypatch):
    """dsrun's commands start the fork server first thing (comm/forkserver.py) only where the launch will fork the
    ranks from it: a local CPU job, not accelerator ranks (spawned) nor a rank under torchrun."""
    import multiprocessing.forkserver

    from dsconv.comm.forkserver import TORCHRUN_ENV, rank_preload, start_rank_server

    started = []
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: started.append(True))
    for device in ("npu", "cuda"):
        start_rank_server(device, ["dsconv.runner.entrypoints.generate"])
    with monkeypatch.context() as torchrun:
        for name in TORCHRUN_ENV:
            torchrun.setenv(name, "0")
        start_rank_server("cpu", ["dsconv.runner.entrypoints.generate"])
    assert started == []
    start_rank_server("cpu", ["dsconv.runner.entrypoints.generate"])
    assert started == [True]
    assert rank_preload(["dsconv.runner.entrypoints.generate", "torch"]) == [  # the SIGTERM shield first
        "dsconv.comm.rank_server", "torch", "torch.distributed", "dsconv.comm.launch",
        "dsconv.runner.entrypoints.generate"]
