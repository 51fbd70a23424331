"""ONNX Runtime implementations of the collectives over MPI.COMM_WORLD (mpi4py). Every rank must run its
sessions in the same order: each op is a matching MPI call on all ranks. Importing registers the ops."""

from __future__ import annotations

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, onnx_op

from plugins import ort_pyop

ort_pyop.install()  # outputs handed back as arrays, not lists

_F = PyCustomOpDef.dt_float


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@onnx_op(op_type="ddtree::AllReduce", inputs=[_F], outputs=[_F])
def _all_reduce(x):
    from mpi4py import MPI

    x = np.ascontiguousarray(x, dtype=np.float32)
    comm = _comm()
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    return x


@onnx_op(op_type="ddtree::AllGather", inputs=[_F], outputs=[_F], attrs={"world_size": PyCustomOpDef.dt_int64})
def _all_gather(x, **attrs):
    comm, world = _comm(), int(attrs["world_size"])
    if comm.Get_size() != world:
        raise RuntimeError(f"AllGather built for world_size={world} runs in an MPI world of {comm.Get_size()}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if world == 1:
        return x
    gathered = np.empty((world, *x.shape), dtype=np.float32)
    comm.Allgather(x, gathered)
    return np.ascontiguousarray(np.moveaxis(gathered, 0, -2).reshape(*x.shape[:-1], world * x.shape[-1]))
