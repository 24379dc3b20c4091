"""Collectives through mpi4py, for jobs launched by ``mpirun``."""

from __future__ import annotations

from typing import Any

import torch

from .. import _config as cfg
from .._errors import RendezvousError
from .._ops import ReduceOp
from ..rendezvous.environment import Rendezvous
from .host_staged import HostStaged
from .protocol import Connection

__all__ = ["MPIBackend", "connect"]


def connect(rdv: Rendezvous) -> Connection:
    """The ``mpi`` backend's factory: MPI's own world, CUDA tensors through host memory."""
    if rdv.source != "mpi":
        raise RendezvousError(
            f"{cfg.BACKEND_ENV_VAR}=mpi needs the job to be launched by mpirun (no MPI environment found)"
        )
    return Connection(HostStaged(MPIBackend()), rdv)


class MPIBackend:
    """Collectives through mpi4py on CPU tensors (numpy views, no copies except for
    float16/bfloat16, which MPI lacks and which travel as float32)."""

    name = "mpi"

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self._ops = {
            ReduceOp.Sum: MPI.SUM,
            ReduceOp.Average: MPI.SUM,
            ReduceOp.Min: MPI.MIN,
            ReduceOp.Max: MPI.MAX,
            ReduceOp.Product: MPI.PROD,
        }

    def _comm(self, group: Any) -> Any:
        return self.world if group is None else group

    @staticmethod
    def _np(t: torch.Tensor):
        if t.device.type != "cpu":
            raise TypeError(f"the MPI backend moves CPU tensors only, got a tensor on {t.device}")
        return t.numpy()

    def _run_wide(self, t: torch.Tensor, fn) -> None:
        if t.dtype in (torch.float16, torch.bfloat16):
            wide = t.to(torch.float32)
            fn(wide)
            t.copy_(wide)
        else:
            fn(t)

    def allreduce(self, t: torch.Tensor, op: ReduceOp, group: Any) -> None:
        self._run_wide(
            t,
            lambda x: self._comm(group).Allreduce(self.MPI.IN_PLACE, self._np(x), op=self._ops[op]),
        )

    def allgather(self, t: torch.Tensor, dims: list[int], group: Any) -> torch.Tensor:
        row = int(torch.tensor(t.shape[1:]).prod().item()) if t.dim() > 1 else 1
        wide = t.to(torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t
        out = wide.new_empty((sum(dims), *t.shape[1:]))
        counts = [d * row for d in dims]
        self._comm(group).Allgatherv(self._np(wide.contiguous()), [self._np(out), counts])
        return out.to(t.dtype)

    def broadcast(self, t: torch.Tensor, root: int, members: list[int], group: Any) -> None:
        local_root = members.index(root)
        self._run_wide(t, lambda x: self._comm(group).Bcast(self._np(x), root=local_root))

    def alltoall(
        self, t: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor:
        row = int(torch.tensor(t.shape[1:]).prod().item()) if t.dim() > 1 else 1
        wide = t.to(torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t
        out = wide.new_empty((sum(recv), *t.shape[1:]))
        sc, rc = [s * row for s in send], [r * row for r in recv]
        self._comm(group).Alltoallv([self._np(wide.contiguous()), sc], [self._np(out), rc])
        return out.to(t.dtype)

    def barrier(self, group: Any) -> None:
        self._comm(group).Barrier()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> None:
        self.world.Sendrecv(
            self._np(send.contiguous()), dest=peer, recvbuf=self._np(recv), source=peer
        )

    def new_group(self, ranks: list[int], size: int) -> Any:
        if len(ranks) == size:
            return None
        comm = self.world.Create(self.world.Get_group().Incl(ranks))
        return comm if comm != self.MPI.COMM_NULL else None

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.world.bcast(obj, root=root)
