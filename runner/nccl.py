"""NCCL collectives for the torch backend on GPUs, set up from the MPI ranks (one process, one GPU per rank).

Rank 0 picks a free TCP port and broadcasts it over MPI; every rank then joins torch.distributed's NCCL group.
Both collectives are CUDA-graph capturable.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def init_nccl(comm, device: torch.device) -> None:
    if dist.is_initialized():
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=comm.Get_rank(), world_size=comm.Get_size(), device_id=device)


def leave_nccl(comm) -> None:
    """Every rank leaves the NCCL group before its process exits (else torch warns that destroy_process_group was not
    called, and a rank still watching the group warns when rank 0, which serves its store, exits first): all ranks
    arrive, leave, and wait for each other before any exits. A no-op where no group was set up (CPU ranks, TP-1)."""
    if dist.is_initialized():
        comm.Barrier()
        dist.destroy_process_group()
        comm.Barrier()


class NcclCollectives:
    def __init__(self, comm, device: torch.device):
        self.world_size = comm.Get_size()
        if self.world_size > 1:
            init_nccl(comm, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        gathered = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x.contiguous())
        return gathered.movedim(0, -2).reshape(*x.shape[:-1], -1)
