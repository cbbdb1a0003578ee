"""Start the ranks of one job: under torchrun, or as `world_size` local processes supervised from here.

Under torchrun (`torchrun --nnodes 2 --nproc-per-node 8 -m ...`) torchrun owns the processes and this module
only initialises the process group from its environment and runs the entry in the current process.

Otherwise `launch` starts the ranks itself and supervises them, one rank per visible device for cuda / npu (a
machine with fewer devices than ranks is refused before any rank starts: start one process per device on each
node with torchrun instead). CPU ranks are `multiprocessing` processes from the "forkserver" context: the fork server is a fresh interpreter (exec'ed, so it shares no threads, CUDA state or
sockets with this process) that imports torch and the entry's module once; each rank is forked from it. With "spawn" every rank
imports torch again, seconds of CPU each (figures in docs/benchmarks.md, "Kernel choices"). Failure handling is the same as with spawn: `Process.exitcode`
tells an exception (positive) from a signal (negative), `Process.sentinel` lets the supervisor sleep until
any rank exits, and `terminate`/`kill` reach a rank even while it is blocked inside a C++ collective, which
no in-process timeout can interrupt. Accelerator ranks start with "spawn": each initialises its device runtime
in a fresh interpreter, and a device start-up of seconds dwarfs the import cost.

As with any multiprocessing program, each rank re-imports the caller's main module, so a script that calls
`launch` must do so under `if __name__ == "__main__":` (console scripts such as `dsrun` already do). Rank 0
writes to the stdout the fork server inherited when the first `launch` of this process started it.

Failure is loud and bounded: the first rank to exit non-zero (or by a signal) is reported in one line,
`rank R failed: <error>`, and every other rank gets SIGTERM, then SIGKILL after TERMINATE_GRACE_S, so the
job ends within seconds of the failure even when the others wait in a collective that will never complete.
The collective timeout (`timeout_s`) is the backstop for hangs with no dead rank (ranks that entered
different collectives) and for multi-node runs, where torchrun does the supervising.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dsconv.comm.forkserver import rank_preload, under_torchrun
from dsconv.errors import InputError

LOCAL_ADDR = "127.0.0.1"
# A SIGTERM'd rank normally dies at once (Python installs no SIGTERM handler); the grace only lets a rank
# that does handle it flush its log before SIGKILL.
TERMINATE_GRACE_S = 5.0
# After a rank fails, the first failure is named once no other rank is dead without the supervisor knowing: a rank
# killed by a signal closes its sockets before its parent sees it exit (a forkserver's child is reaped by the fork
# server, which reports it through a pipe; on 2 busy cores that report took over 2 s), so a neighbour's "connection
# reset" may arrive first. The kernel marks the killed process a zombie as it dies, long before a peer has seen the
# reset, failed, recorded its error and exited, so the supervisor waits while any rank it believes alive is a zombie
# in /proc (or gone), at most this long; a rank that raised records its error and time itself, and nothing is waited
# for when no rank is dead (before, the supervisor waited this long whenever a rank stayed blocked).
FAILURE_SETTLE_S = 15.0
SETTLE_POLL_S = 0.05  # how often a dead rank's state is looked at again while its exit is awaited
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a job ended by Ctrl-C (128 + SIGINT)
USER_ERROR_EXIT = 2  # a rank that refused its input (InputError, such as a flag only a loaded rank can check): the
#                      job exits 2, as a command does for a user mistake


def backend_for(device: str) -> str:
    if device == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
        except ModuleNotFoundError as e:
            raise InputError(f"--device npu needs torch_npu, which is not installed ({e}): on a machine with "
                             f"Ascend's CANN toolkit, pip install -e \".[npu]\"") from e
        except (ImportError, OSError) as e:  # installed, but its libraries do not load: CANN is missing
            raise InputError(f"--device npu: torch_npu does not load ({type(e).__name__}: {e}); it needs Ascend's "
                             f"CANN toolkit (libhccl.so and the Ascend runtime; source CANN's set_env.sh)") from e
        return "hccl"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda, but torch sees no CUDA device "
                             f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
        return "nccl"
    if device == "cpu":
        return "gloo"
    raise ValueError(f"device={device!r} is not one of 'npu', 'cuda', 'cpu'")


def launch(entry: Callable, args: tuple | dict = (), *, world_size: int, device: str,
           timeout_s: float, log_dir: str | Path | None = None, sigterm_to_rank0: bool = False) -> int:
    """Run `entry(*args)` (or `entry(**args)`) on every rank; return the job's exit code.

    `entry` is a module-level function (every rank imports its module to find it). Rank 0 keeps
    the console; ranks > 0 write stdout and stderr to `log_dir/rank{R}.log` (default: a new temp dir, removed after
    a success; under torchrun pass one, or every process picks its own), and a failing rank's traceback goes to its
    log file, whose directory the failure's message names.
    sigterm_to_rank0: a SIGTERM to this process is passed on to rank 0 alone, which then ends the job (a
    server draining its requests), and so is a first Ctrl-C (a second stops every rank at once); by default SIGTERM
    ends this process as usual.
    """
    backend_for(device)  # a wrong device fails here, once, not in every rank
    if not under_torchrun() and device != "cpu":
        _check_local_devices(device, world_size)
    own_logs = log_dir is None
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="dsrun-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):  # an earlier job's errors in a reused log_dir must not be reported as ours
        _error_path(log_dir, rank).unlink(missing_ok=True)
    code = 1
    try:
        if under_torchrun():
            code = _run_under_torchrun(entry, args, world_size, device, timeout_s, log_dir)
        else:
            code = _spawn_and_supervise(entry, args, world_size, device, timeout_s, log_dir, sigterm_to_rank0)
    finally:  # a log directory made here goes after a success, or when it is empty (no message named it: logs_note)
        if own_logs and (code == 0 or not any(log_dir.iterdir())):
            shutil.rmtree(log_dir, ignore_errors=True)
    return code


def visible_devices(device: str) -> int:
    """How many devices of this kind this process can see (torch.cuda / torch.npu, the latter from torch_npu)."""
    return getattr(torch, device).device_count()


def _check_local_devices(device: str, world_size: int) -> None:
    count = visible_devices(device)
    if world_size > count:
        raise InputError(f"{world_size} ranks need {world_size} {device} devices, but this machine sees {count}: "
                         f"start one process per device on each node with torchrun (e.g. torchrun --nnodes "
                         f"{-(-world_size // max(count, 1))} --nproc-per-node {count} ...)")


# ---------------------------------------------------------------------------------------------------------
# One rank: redirect output, join the process group, run the entry, record a failure for the supervisor.

def _run_rank(entry, args, rank: int, world_size: int, device: str, timeout_s: float, log_dir: Path,
              store_path: str | None) -> int:
    """Returns 0, or 1 after writing the error to `log_dir` (`_error_path`, and the traceback to the log)."""
    if rank > 0:
        _redirect_output(_log_path(log_dir, rank))
    try:
        backend = backend_for(device)  # imports torch_npu in this process when the device is npu
        local_rank = int(os.environ["LOCAL_RANK"])
        if backend != "gloo" and local_rank >= visible_devices(device):
            raise InputError(f"LOCAL_RANK {local_rank}, but this node has {visible_devices(device)} visible {device} "
                             f"devices: start one process per device (torchrun --nproc-per-node "
                             f"{visible_devices(device)})")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        elif backend == "hccl":
            torch.npu.set_device(local_rank)
        # Ranks on one machine share its cores (those this process may run on), so 16 ranks on a small
        # machine do not each start a full-size thread pool (torchrun's OMP_NUM_THREADS=1 has the same aim). torchrun and we set
        # LOCAL_WORLD_SIZE; a hand-made environment without it is treated as all ranks on this machine.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, usable_cpus() // local_ranks))
        timeout = timedelta(seconds=timeout_s)
        if store_path is None:  # torchrun: rendezvous through MASTER_ADDR / MASTER_PORT from the environment
            dist.init_process_group(backend, timeout=timeout)
        else:  # our launch: meet at the job's file store
            store = dist.FileStore(store_path, world_size)
            store.set_timeout(timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        entry(**args) if isinstance(args, dict) else entry(*args)
        # No rank closes its connections while a peer may still be reading from them.
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # noqa: BLE001  (KeyboardInterrupt and SystemExit are failures of this rank too)
        if isinstance(e, SystemExit) and e.code in (None, 0):
            return 0
        _record_failure(log_dir, rank, e)
        return USER_ERROR_EXIT if isinstance(e, InputError) else 1


def _redirect_output(path: Path) -> None:
    # At the file-descriptor level, so output from C++ (gloo, NCCL warnings) lands in the log too.
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, a cgroup's cpuset), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _log_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.log"


def _error_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.error.json"


def _record_failure(log_dir: Path, rank: int, error: BaseException) -> None:
    with open(_log_path(log_dir, rank), "a") as log:
        traceback.print_exception(error, file=log)
    lines = [line for line in str(error).splitlines() if line.strip()]
    summary = type(error).__name__ + (f": {lines[0].strip()}" if lines else "")
    # The time orders failures: a rank that dies makes its peers fail a moment later, and the supervisor
    # must name the first one, not a peer that merely lost its connection.
    record = {"time": time.time(), "error": summary}
    tmp = _error_path(log_dir, rank).with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(_error_path(log_dir, rank))


# ---------------------------------------------------------------------------------------------------------
# Under torchrun: this process is one rank; torchrun supervises.

def _run_under_torchrun(entry, args, world_size, device, timeout_s, log_dir) -> int:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise InputError(f"torchrun started {env_world} processes but the layout needs world size {world_size}")
    rank = int(os.environ["RANK"])
    console = os.fdopen(os.dup(2), "w")  # the console's stderr, kept before ranks > 0 redirect theirs
    code = _run_rank(entry, args, rank, world_size, device, timeout_s, log_dir, store_path=None)
    if code:
        # No launcher of ours watches these ranks, so each failing rank speaks for itself.
        print(f"rank {rank} failed: {_failure_reason(log_dir, rank, exitcode=code)}{logs_note(log_dir)}",
              file=console, flush=True)
    console.close()
    return code


# ---------------------------------------------------------------------------------------------------------
# Local launch: start `world_size` ranks from a fork server and supervise them.

def _spawn_and_supervise(entry, args, world_size, device, timeout_s, log_dir, sigterm_to_rank0=False) -> int:
    ctx = multiprocessing.get_context("forkserver" if device == "cpu" else "spawn")
    if device == "cpu":
        # Must come before the first forkserver process starts; the server imports these once for every rank. A
        # rank imports its entry's module to find the entry: 16 ranks importing the runner on 2 cores took 3 to 8
        # s a launch, against 0.3 s for a no-op entry (this process's later launches reuse the first's server).
        # A command may have started the server already (forkserver.start_rank_server), with this list.
        ctx.set_forkserver_preload(rank_preload(_modules_of(entry, args)))
    # The ranks meet at a file store in a fresh directory of this job's: no port to pick or race for, and no
    # server to connect to. A TCPStore served from here stalled about one 16-rank start in three on a 2-core
    # machine, one rank's connect taking 5 s with no retransmitted SYN (measured, torch 2.13).
    # The ranks' store removes its file once all have closed it; the directory goes with the job, however it ends.
    with tempfile.TemporaryDirectory(prefix="dsrun-store-", ignore_cleanup_errors=True) as store_dir:
        return _start_and_supervise(ctx, entry, args, world_size, device, timeout_s, log_dir,
                                    os.path.join(store_dir, "store"), sigterm_to_rank0)


def _start_and_supervise(ctx, entry, args, world_size, device, timeout_s, log_dir, store_path,
                         sigterm_to_rank0) -> int:
    # Ranks watch this pipe; it reaches end-of-file when this process dies, even by SIGKILL.
    alive_r, alive_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_process, name=f"rank{rank}",
                         args=(entry, args, rank, world_size, device, timeout_s, log_dir, store_path, alive_r))
             for rank in range(world_size)]
    try:
        with _sigint_held():  # a Ctrl-C during start-up is acted on once every started rank has its pid
            for proc in procs:
                proc.start()
        alive_r.close()
        if sigterm_to_rank0:
            previous = signal.signal(signal.SIGTERM, lambda *_: _to_rank0(procs))
            previous_int = signal.signal(signal.SIGINT, _first_drains(procs))
        try:
            return _supervise(procs, log_dir)
        finally:
            if sigterm_to_rank0:
                signal.signal(signal.SIGTERM, previous)
                signal.signal(signal.SIGINT, previous_int)
    except KeyboardInterrupt:
        print(f"interrupted: stopping {world_size} ranks{logs_note(log_dir)}", file=sys.stderr, flush=True)
        _stop(procs)
        return INTERRUPTED_EXIT_CODE
    except BaseException:  # e.g. an entry that cannot be pickled: stop the ranks already started
        _stop(procs)
        raise
    finally:
        alive_w.close()


def _to_rank0(procs: list) -> None:
    if procs[0].is_alive():
        os.kill(procs[0].pid, signal.SIGTERM)


def _first_drains(procs: list):
    """A SIGINT handler for a job that stops on SIGTERM to rank 0 (a server): the first Ctrl-C stops it as SIGTERM
    does (a drain, then a clean exit), a second one stops every rank at once (KeyboardInterrupt)."""
    seen = []

    def handler(signum, frame) -> None:
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        print("interrupted: stopping as on SIGTERM (Ctrl-C again to stop every rank at once)", file=sys.stderr,
              flush=True)
        _to_rank0(procs)

    return handler


def logs_note(log_dir: Path) -> str:
    """The note " (logs in DIR)" for a message, when DIR has something to read (a directory a message names is kept)."""
    return f" (logs in {log_dir})" if log_dir.is_dir() and any(log_dir.iterdir()) else ""


def _modules_of(entry, args) -> list[str]:
    """The modules a rank imports to unpickle its entry and the functions among its arguments (a wrapper's inner
    entry), in that order; not `__main__`, which multiprocessing prepares in every rank itself."""
    values = args.values() if isinstance(args, dict) else args
    modules = [fn.__module__ for fn in (entry, *values) if callable(fn) and hasattr(fn, "__module__")]
    return [name for name in dict.fromkeys(modules) if name not in (None, "__main__")]


@contextmanager
def _sigint_held() -> Iterator[None]:
    """A SIGINT that arrives inside the block is delivered on leaving it, to the handler the caller had.

    `Process.start()` interrupted after the child is forked but before it records the child's pid leaves a
    rank that `_stop` cannot see, so the supervisor would stop one rank fewer than it says."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; a handler set outside Python cannot be put back
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        signal.raise_signal(signal.SIGINT)


def _rank_process(entry, args, rank, world_size, device, timeout_s, log_dir, store_path, alive_r) -> None:
    # Ctrl-C reaches the whole terminal process group; the supervisor alone decides how ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (comm/rank_server.py); a rank need not
    threading.Thread(target=_exit_when_supervisor_dies, args=(alive_r,), daemon=True).start()
    # torchrun's variables but MASTER_PORT: no rendezvous goes through a port, and a rank is not under torchrun
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=LOCAL_ADDR)
    sys.exit(_run_rank(entry, args, rank, world_size, device, timeout_s, log_dir, store_path=store_path))


def _exit_when_supervisor_dies(alive_r) -> None:
    try:
        alive_r.recv()  # the supervisor never sends: this returns only by EOFError
    except EOFError:
        pass
    os._exit(1)  # a rank with no supervisor must not linger, even if blocked in a collective


def _supervise(procs: list, log_dir: Path) -> int:
    running = {proc.sentinel: proc for proc in procs}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            running.pop(sentinel).join()
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
        if failed:
            _settle(running, procs)
            failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            rank = _first_failure(failed, procs, log_dir)
            reason = _failure_reason(log_dir, rank, procs[rank].exitcode)
            print(f"rank {rank} failed: {reason}{logs_note(log_dir)}", file=sys.stderr, flush=True)
            _stop(procs)
            return USER_ERROR_EXIT if procs[rank].exitcode == USER_ERROR_EXIT else 1
    return 0


def _settle(running: dict, procs: list) -> None:
    """After a failure: while a rank not yet seen to exit is dead (_exited_unseen), wait for its exit to be seen,
    at most FAILURE_SETTLE_S; returns at once when one is seen killed by a signal (which names the failure: a killed
    rank is never collateral damage) or when every rank not seen to exit is alive."""
    deadline = time.monotonic() + FAILURE_SETTLE_S
    while running and not any(proc.exitcode is not None and proc.exitcode < 0 for proc in procs):
        left = deadline - time.monotonic()
        if left <= 0 or not any(_exited_unseen(proc.pid) for proc in running.values()):
            return
        for sentinel in multiprocessing.connection.wait(list(running), timeout=min(left, SETTLE_POLL_S)):
            running.pop(sentinel).join()


def _exited_unseen(pid: int) -> bool:
    """Whether the process `pid` has died though its exit has not reached us: a zombie waiting for its parent (the
    fork server) to reap it, or reaped already. Linux's /proc/PID/stat gives the state after the command's closing
    parenthesis; where /proc is missing, any rank may be dead, so the caller waits its full time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no such process any more (reaped), or no /proc
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _first_failure(failed: list[int], procs: list, log_dir: Path) -> int:
    # A rank killed by a signal is never collateral damage (peers fail with exceptions, and we have not
    # signalled anyone yet), so it comes first; among exceptions the earliest recorded one.
    killed = [rank for rank in failed if procs[rank].exitcode < 0]
    if killed:
        return killed[0]
    times = {rank: _read_error(log_dir, rank).get("time", float("inf")) for rank in failed}
    return min(failed, key=lambda rank: times[rank])


def _failure_reason(log_dir: Path, rank: int, exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    error = _read_error(log_dir, rank).get("error")
    return error if error else f"exited with code {exitcode} without a Python error"


def _read_error(log_dir: Path, rank: int) -> dict:
    path = _error_path(log_dir, rank)
    return json.loads(path.read_text()) if path.exists() else {}


def _stop(procs: list) -> None:
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            proc.kill()
            proc.join()
