"""A ``torch.distributed`` process group whose CPU collectives go through one host's
shared-memory data plane: the backend ``"ring"`` (registered by ``ringcore.dist_backend``).

torch 2.13 lets a Python backend be only a whole ``ProcessGroup`` subclass: c10d's
``Backend`` cannot be subclassed from Python (``TypeError: No constructor defined``), and
when a creator returns a ``ProcessGroup``, ``init_process_group`` uses that object for
every device and registers no other backend — ``"cpu:ring,cuda:nccl"`` never makes the
NCCL group itself. So :class:`RingProcessGroup` routes each op on its own:

- **CPU tensors** of a dtype the :class:`~ringcore.shm.group.ShmGroup` carries, with an
  operator it implements (sum, avg, min, max, product), when the group's ranks share one
  host: through the segment (allreduce, coalesced allreduce, broadcast, allgather,
  all_gather_single, reduce_scatter_single, reduce_scatter, the coalesced forms of the
  single-tensor ones, barrier);
- **CUDA tensors**: the NCCL group it holds when torch has NCCL and a GPU (made with it,
  as torch makes NCCL's: constructing one does not communicate), else Gloo;
- **everything else** (alltoall, send/recv, gather, scatter, reduce, PREMUL_SUM and the
  bitwise operators, other dtypes, sparse tensors, ranks on several hosts): the Gloo group
  it holds over the same store. Gloo (and NCCL) are also registered as the group's
  backends for their devices, so an op this class does not define (gather, scatter,
  reduce, the list alltoall) reaches them through torch's own dispatch: a program never
  fails for using ``"ring"`` where it would run on ``"gloo"``.

The route depends only on facts equal on every rank of a correct program (device type,
dtype, operator, the sizes torch requires equal), so the ranks never split between the
two paths. A shared-memory op runs to completion on the calling thread and returns a
completed work whose ``get_future()`` holds the op's output tensors, as DDP's comm hooks
expect (across hosts, on the group's thread: the work completes when the op did).

Ranks on several hosts with the same number of ranks each, numbered host by host, run
the same ops in two levels (:class:`~ringcore.shm.torch_hier.Hierarchy`: the host's
segment, then Gloo across the hosts between the ranks of one local rank) for the
element types Gloo carries across (:data:`~ringcore.shm.torch_hier.CROSS_DTYPES`);
any other layout of hosts uses Gloo for every op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d

from .._ops import ReduceOp
from .group import ShmGroup
from .reduce import DTYPES
from .torch_hier import CROSS_DTYPES, Hierarchy, OpThread
from .torch_name import BACKEND_NAME

__all__ = ["RingProcessGroup"]

c10d: Any = _distributed_c10d  # its stubs lack the private helpers used here

_RED: Any = dist.ReduceOp.RedOpType
_SHM_OPS = {
    _RED.SUM: ReduceOp.Sum,
    _RED.AVG: ReduceOp.Average,
    _RED.MIN: ReduceOp.Min,
    _RED.MAX: ReduceOp.Max,
    _RED.PRODUCT: ReduceOp.Product,
}


# torch's stubs type each collective of ProcessGroup with overloads that one method
# serving every form cannot match: the class is checked as a subclass of Any.
_ProcessGroup: Any = dist.ProcessGroup


def _shm_op(op: Any) -> ReduceOp | None:
    """The shared-memory group's operator for torch's ``op``; None: Gloo's to run."""
    kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType
    return _SHM_OPS.get(kind)


def _done(result: list[torch.Tensor]) -> Any:
    """A completed work whose future holds ``result``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return c10d._create_work_from_future(fut)


def _dense_cpu(ts: list[torch.Tensor], dtypes: tuple[torch.dtype, ...]) -> bool:
    return bool(ts) and all(
        t.device.type == "cpu" and t.layout == torch.strided and t.dtype in dtypes for t in ts
    )


def _in_place(fn: Callable[[torch.Tensor], Any], t: torch.Tensor) -> None:
    """``fn`` on a contiguous ``t`` (a copy when it is not, written back after)."""
    x = t if t.is_contiguous() else t.contiguous()
    fn(x)
    if x is not t:
        t.copy_(x)


class RingProcessGroup(_ProcessGroup):
    """One group of ``torch.distributed`` ranks: ``shm`` (None: shared memory off, or
    hosts laid out so that no plan uses it) for the CPU collectives it implements, with
    ``hier`` (None: every rank on one host) when its ranks span several hosts, ``gloo``
    for the rest, ``cuda`` (None without NCCL) for CUDA tensors. ``reason`` says, in
    words, why the shared-memory path is on or off. ``stats`` counts the ops each path
    carried (``shm`` counts the hierarchical ones too)."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        gloo: Any,
        shm: ShmGroup | None,
        cuda: Any = None,
        hier: Hierarchy | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(rank, size)  # the (store, rank, size) form makes no trampoline
        self._rank, self._size = rank, size
        self.gloo, self.shm, self.cuda, self.reason = gloo, shm, cuda, reason
        self.hier = hier
        # across hosts, ops run on a thread of the group (see ringcore.shm.torch_hier)
        self._thread = OpThread(f"ring-pg-{rank}") if hier is not None else None
        self._dtypes = DTYPES if hier is None else CROSS_DTYPES
        self.stats = {"shm": 0, "gloo": 0, "cuda": 0}
        self._lock = threading.Lock()  # one op at a time in the segment
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        if cuda is not None:
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, cuda)

    # ---- identity -----------------------------------------------------------------------

    def getBackendName(self) -> str:  # the name torch's trampoline looks up
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ---- routing ------------------------------------------------------------------------

    def _other(self, ts: list[torch.Tensor]) -> Any:
        """The group that runs an op on ``ts`` that is not ours: NCCL for CUDA tensors
        when we hold it, else Gloo."""
        if self.cuda is not None and ts and ts[0].device.type == "cuda":
            self.stats["cuda"] += 1
            return self.cuda
        self.stats["gloo"] += 1
        return self.gloo

    def _ours(self, ts: list[torch.Tensor], op: Any = None) -> bool:
        if self.shm is None or not _dense_cpu(ts, self._dtypes):
            return False
        return op is None or _shm_op(op) is not None

    def _run(self, fn: Callable[[], Any], result: list[torch.Tensor]) -> Any:
        def run() -> None:
            with self._lock:
                self.stats["shm"] += 1
                fn()

        if self._thread is not None:
            return self._thread.submit(run, result)
        run()
        return _done(result)

    # ---- collectives --------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        if isinstance(opts, dist.ReduceOp):  # allreduce(tensors, op) of older callers
            opts, op = dist.AllreduceOptions(), opts
            opts.reduceOp = op
        if not self._ours(tensors, opts.reduceOp) or len({t.dtype for t in tensors}) != 1:
            return self._other(tensors).allreduce(tensors, opts)
        return self._run(lambda: self._allreduce(tensors, _shm_op(opts.reduceOp)), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        if not self._ours(tensors, opts.reduceOp):
            return self._other(tensors).allreduce_coalesced(tensors, opts)
        op = _shm_op(opts.reduceOp)

        def run() -> None:
            for dtype in dict.fromkeys(t.dtype for t in tensors):  # in order of appearance
                self._allreduce([t for t in tensors if t.dtype == dtype], op)

        return self._run(run, tensors)

    def _allreduce(self, tensors: list[torch.Tensor], op: Any) -> None:
        """One fused allreduce of ``tensors`` (one dtype) through the segment's slot (or,
        across hosts, the two levels)."""
        shm, hier = self.shm, self.hier
        assert shm is not None
        if hier is not None and len(tensors) == 1:  # reduced in two levels
            _in_place(lambda x: hier.allreduce_(x.view(-1), op), tensors[0])
            return
        if hier is not None:  # one flat buffer of them all
            flat = torch.cat([t.reshape(-1) for t in tensors])
            hier.allreduce_(flat, op)
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view(t.shape))
            return
        if len(tensors) == 1:
            _in_place(lambda x: shm.allreduce_(x, op), tensors[0])
            return
        xs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        shm.allreduce_list_(xs, xs, op)
        for t, x in zip(tensors, xs):
            if x is not t:
                t.copy_(x)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        if not self._ours(tensors):
            return self._other(tensors).broadcast(tensors, opts)
        root = opts.rootRank

        def run() -> None:
            # one host: the group's rank is the local rank; across hosts: the two levels
            group: Any = self.hier or self.shm
            for t in tensors:
                _in_place(lambda x: group.broadcast_(x, root), t)

        return self._run(run, tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        outs = outputs[0] if len(outputs) == 1 else []
        if (
            len(inputs) != 1
            or not self._ours(inputs + outs)
            or len(outs) != self._size
            or any(o.numel() != inputs[0].numel() or o.dtype != inputs[0].dtype for o in outs)
        ):
            return self._other(inputs).allgather(outputs, inputs, opts)

        def run() -> None:
            rows = self._gather_rows(inputs[0])
            for j, o in enumerate(outs):
                o.copy_(rows[j].view(o.shape))

        return self._run(run, outs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if (
            not self._ours([output, input])
            or output.dtype != input.dtype
            or output.numel() != self._size * input.numel()
        ):
            return self._other([input])._allgather_base(output, input, opts)

        return self._run(lambda: self._gather_into(input, output), [output])

    _allgather_base = all_gather_single

    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` flattened, one row per rank."""
        assert self.shm is not None
        if self.hier is not None:
            out = torch.empty(self._size * t.numel(), dtype=t.dtype)
            self.hier.gather_into(t, out)
            return out.view(self._size, -1)
        return self.shm.allgather(t.contiguous().view(1, -1))

    def _gather_into(self, t: torch.Tensor, output: torch.Tensor) -> None:
        """Every rank's ``t`` into ``output`` (``size`` times its elements): written in
        place when ``output`` is contiguous (FSDP2's all-gather buffer), so that no second
        buffer of the gathered size is made per op."""
        assert self.shm is not None
        if output.is_contiguous() and self.hier is not None:
            self.hier.gather_into(t, output)
        elif output.is_contiguous():
            self.shm.allgather(t.contiguous().view(1, -1), out=output.view(self._size, -1))
        else:
            output.copy_(self._gather_rows(t).view(output.shape))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if (
            not self._ours([output, input], opts.reduceOp)
            or output.dtype != input.dtype
            or input.numel() != self._size * output.numel()
        ):
            return self._other([input])._reduce_scatter_base(output, input, opts)
        return self._run(lambda: self._scatter(input, output, opts.reduceOp), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        ins = inputs[0] if len(inputs) == 1 else []
        if (
            len(outputs) != 1
            or len(ins) != self._size
            or not self._ours(outputs + ins, opts.reduceOp)
            or any(t.numel() != outputs[0].numel() or t.dtype != outputs[0].dtype for t in ins)
        ):
            return self._other(outputs).reduce_scatter(outputs, inputs, opts)

        def run() -> None:
            self._scatter(torch.cat([t.reshape(-1) for t in ins]), outputs[0], opts.reduceOp)

        return self._run(run, outputs)

    def _scatter(self, input: torch.Tensor, output: torch.Tensor, op: Any) -> None:
        """This rank's 1/size of the reduction of ``input`` (one row per rank) into ``output``."""
        rop = _shm_op(op)
        assert self.shm is not None and rop is not None
        rows = input.contiguous().view(self._size, -1)
        if self.hier is not None:
            _in_place(lambda x: self.hier.scatter_into(rows, x, rop), output)  # type: ignore[union-attr]
        elif output.is_contiguous():  # in place: no buffer of this rank's share per op
            self.shm.reducescatter(rows, rop, out=output.view(1, -1))
        else:
            output.copy_(self.shm.reducescatter(rows, rop).view(output.shape))

    def barrier(self, opts: Any = None) -> Any:
        if self.hier is not None:  # after the ops before it, on the group's thread
            return self._run(self.hier.barrier, [])
        if self.shm is None:
            self.stats["gloo"] += 1
            return self.gloo.barrier(opts if opts is not None else dist.BarrierOptions())
        return self._run(self.shm.barrier, [])

    # ---- the coalesced forms (DTensor's functional collectives call them) ---------------
    # torch's trampoline holds the GIL while it falls through to the C++ default of a
    # method Python does not override; Gloo's worker thread then needed the GIL to free a
    # finished work while holding its queue's lock, and the rank hung (pytorch 2.13, seen
    # with DTensor.full_tensor()). Every method the trampoline intercepts is therefore
    # defined here, and what goes to Gloo goes through its bindings, which release the GIL.

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if len(outputs) != len(inputs) or not all(
            self._ours([o, i]) and o.dtype == i.dtype and o.numel() == self._size * i.numel()
            for o, i in zip(outputs, inputs)
        ):
            works = [self._other([i])._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
            return self._all(works, outputs)

        def run() -> None:
            for o, i in zip(outputs, inputs):
                self._gather_into(i, o)

        return self._run(run, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(outputs) != len(inputs) or not all(
            self._ours([o, i], opts.reduceOp)
            and o.dtype == i.dtype
            and i.numel() == self._size * o.numel()
            for o, i in zip(outputs, inputs)
        ):
            works = [
                self._other([i])._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)
            ]
            return self._all(works, outputs)

        def run() -> None:
            for o, i in zip(outputs, inputs):
                self._scatter(i, o, opts.reduceOp)

        return self._run(run, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @staticmethod
    def _all(works: list[Any], result: list[torch.Tensor]) -> Any:
        """One completed work for ``works``, waited for here (the fallback of a coalesced
        op: Gloo's backend binds no coalesced form of it)."""
        for w in works:
            w.wait()
        return _done(result)

    # ---- the rest: Gloo's -------------------------------------------------------------

    def alltoall_base(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._other([input]).alltoall_base(output, input, out_splits, in_splits, opts)

    all_to_all_single = alltoall_base

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._other(tensors).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._other(tensors).recv(tensors, src, tag)

    # ---- leaving ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Run the ops still queued, leave the segment, then Gloo's (and NCCL's) groups,
        as torch's destroy does."""
        if self._thread is not None:
            self._thread.close()
        if self.shm is not None:
            self.shm.close()
        super().shutdown()

    def abort(self) -> None:
        if self._thread is not None:
            self._thread.close(timeout_s=0.0)
        if self.shm is not None:
            self.shm.close()
        super().abort()
