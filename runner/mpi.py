"""MPI discipline: every rank runs the same entry point; rank 0 drives, the others execute what it broadcasts.

- `MpiRanks` (rank 0): each call is sent to every other rank, then run locally; the engines' own collectives pair
  the ranks up.
- `worker_loop` (ranks > 0): receive a call, run it, until "stop". A rank waiting for a call polls for it, and
  sleeps between polls once it has waited longer than a step takes: an idle server's ranks use almost no CPU (a
  blocking MPI receive busy-polls a core per rank), while calls during a request still arrive within microseconds.
- `run_on_all_ranks`: an exception on any rank prints its traceback once, rank-prefixed, and aborts the whole job
  (`COMM_WORLD.Abort`), so mpirun exits non-zero promptly instead of hanging in a collective.
- `MpiCollectives`: all-reduce / all-gather of CPU tensors through mpi4py (the torch backend on CPUs).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from runner.ranks import Ranks

STOP = "stop"
CALL_TAG = 17
SPIN_SECONDS = 0.02  # poll without sleeping this long after the last call (a step is 1 to 10 ms)
SLEEP_SECONDS = 0.002  # then sleep this long between polls: an idle rank's cost, and the first call's extra latency


def comm_world():
    """MPI's world communicator, once every rank has attached MPI's shared memory (see `release_shared_memory`)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() > 1:
        comm.Barrier()
        release_shared_memory()
    return comm


def release_shared_memory() -> list[str]:
    """Unlinks the names of the shared-memory segments this process has mapped from MPICH (/dev/shm/mpich_shm_*).

    Every rank of a node attaches them during MPI's start-up, so after a barrier the names are no longer needed: the
    mappings stay valid until the processes exit. MPICH removes them at a clean finalize, but a job that aborts or is
    killed left one behind for good (2 MB at np 2, 8.5 MB at np 8) every time."""
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.startswith("/dev/shm/mpich_shm_"):
                names.add(path)
    for name in names:
        try:
            os.unlink(name)
        except FileNotFoundError:  # another rank of the node got there first
            pass
    return sorted(names)


def exit_rank(code) -> None:
    """Ends this rank's process with `code` (an int, None for 0, or a message for 1, as `sys.exit` takes) once its
    output is flushed and MPI is finalized, without the interpreter's teardown: freeing torch's modules and tensors
    one by one took 5.5 s for 8 ranks on two cores (a bare `import torch` job), which a server restart or a CLI run
    paid on every exit. Nothing is left to clean: every file the runner writes is closed where it is written.

    The process ends through the C library's exit(), which still runs the C exit handlers: MPICH's launcher (hydra
    5) takes a rank that skips them (os._exit) after the others have finalized for a dead one and kills the ranks
    still finalizing with signal 9, so a job whose ranks end at different times failed about half the time."""
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    code = 0 if code is None else int(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    try:
        libc_exit = ctypes.CDLL(None).exit
    except (OSError, AttributeError):  # no C library to call: the bare system call
        os._exit(code)
    libc_exit.argtypes = [ctypes.c_int]
    libc_exit(code)


def setup_logging(rank: int, level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=f"[rank {rank}] %(message)s", stream=sys.stderr, force=True)


class MpiRanks(Ranks):
    def __init__(self, worker, comm):
        self.worker, self.comm, self.lead = worker, comm, worker

    def call(self, method: str, *args):
        _send_all(self.comm, (method, args))
        return getattr(self.worker, method)(*args)

    def close(self) -> None:
        _send_all(self.comm, (STOP, ()))
        _close(self.worker, self.comm)


def _send_all(comm, message) -> None:
    for rank in range(1, comm.Get_size()):
        comm.send(message, dest=rank, tag=CALL_TAG)


def receive_call(comm):
    """The next call from rank 0: polled, then polled with sleeps once no call has come for SPIN_SECONDS."""
    started = time.monotonic()
    while not comm.iprobe(source=0, tag=CALL_TAG):
        if time.monotonic() - started > SPIN_SECONDS:
            time.sleep(SLEEP_SECONDS)
    return comm.recv(source=0, tag=CALL_TAG)


def worker_loop(worker, comm) -> None:
    while True:
        method, args = receive_call(comm)
        if method == STOP:
            _close(worker, comm)
            return
        getattr(worker, method)(*args)


def _close(worker, comm) -> None:
    from runner.nccl import leave_nccl

    worker.close()
    leave_nccl(comm)


def run_on_all_ranks(main: Callable[[object], int]) -> int:
    """Runs main(comm) on this rank; any exception aborts every rank after printing its traceback once."""
    comm = comm_world()
    try:
        return main(comm)
    except SystemExit:
        raise
    except BaseException:
        rank = comm.Get_rank()
        text = "".join(traceback.format_exc())
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.write(f"[rank {rank}] aborting all {comm.Get_size()} ranks\n")
        sys.stdout.flush()
        sys.stderr.flush()
        wait_until_read((1, 2))
        comm.Abort(1)
        return 1


def wait_until_read(fds, limit_s: float = 5.0, settle_s: float = 0.2) -> None:
    """Waits until the launcher has read what this rank wrote to `fds` (pipes: nothing left unread in them), then
    `settle_s` for the launcher to pass it on. MPI_Abort has the launcher kill every rank at once, and MPICH's hydra
    then dropped a traceback still in the pipe (a CI run under load printed no output at all for a failing rank)."""
    import fcntl
    import stat
    import struct
    import termios

    deadline = time.monotonic() + limit_s
    for fd in fds:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        # bytes the reader has not taken yet: FIONREAD on a pipe (either end), the send queue on a socket
        request = termios.FIONREAD if stat.S_ISFIFO(mode) else termios.TIOCOUTQ if stat.S_ISSOCK(mode) else None
        while request is not None and time.monotonic() < deadline:
            try:
                unread = struct.unpack("i", fcntl.ioctl(fd, request, b"\0" * 4))[0]
            except OSError:
                break
            if unread == 0:
                break
            time.sleep(0.01)
    time.sleep(settle_s)


class MpiCollectives:
    """Collectives of the torch backend on CPU ranks (float tensors, through numpy buffers)."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm, self.sum, self.world_size = comm, MPI.SUM, comm.Get_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buffer = np.ascontiguousarray(x.detach().cpu().numpy()).copy()
        self.comm.Allreduce(self._in_place(), buffer, op=self.sum)
        return torch.from_numpy(buffer)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        local = np.ascontiguousarray(x.detach().cpu().numpy())
        gathered = np.empty((self.world_size, *local.shape), dtype=local.dtype)
        self.comm.Allgather(local, gathered)
        return torch.from_numpy(np.moveaxis(gathered, 0, -2).reshape(*local.shape[:-1], -1).copy())

    @staticmethod
    def _in_place():
        from mpi4py import MPI

        return MPI.IN_PLACE
