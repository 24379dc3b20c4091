"""The GPU path: backend choice, device pinning, host staging, and (with CUDA) real runs.

Tests marked ``gpu`` need a CUDA device and skip cleanly without one; the others test
the selection logic and the host-staging seam on CPU, so CI checks them everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

import ringcore.launch
import ringcore.runtime.state
from ringcore._ops import ReduceOp
from ringcore.backends.choice import choose_backend
from ringcore.backends.devices import check_use_gpu, device_index, device_of_type
from ringcore.backends.host_staged import HostStaged
from ringcore.backends.torch_backend import TorchDistBackend, torch_backend
from ringcore.launch import GpuUnavailableError, pin_gpu
from ringcore.testing import run_workers

HAS_CUDA = torch.cuda.is_available()
HAS_NCCL = HAS_CUDA and torch.distributed.is_nccl_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_nccl = pytest.mark.skipif(not HAS_NCCL, reason="needs CUDA and NCCL")


# -- the choice of backend (pure) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "cuda", "nccl", "mpi", "shared", "name", "through_host"),
    [
        (None, False, False, False, False, "gloo", False),
        (None, False, True, False, False, "gloo", False),
        (None, True, True, False, False, "nccl", False),
        (None, True, False, False, False, "gloo", True),
        (None, True, True, False, True, "gloo", True),
        ("gloo", True, True, False, False, "gloo", True),
        ("GLOO", False, False, False, False, "gloo", False),
        ("nccl", True, True, False, False, "nccl", False),
        (None, True, True, True, False, "mpi", True),
        ("mpi", False, False, True, False, "mpi", False),
        ("gloo", True, True, True, False, "gloo", True),
        ("", True, True, False, False, "nccl", False),
    ],
)
def test_choose_backend_follows_cuda_nccl_and_ring_backend(
    requested, cuda, nccl, mpi, shared, name, through_host
):
    choice = choose_backend(
        requested,
        cuda_available=cuda,
        nccl_available=nccl,
        mpi_launched=mpi,
        shared_gpu=shared,
    )
    assert (choice.name, choice.cuda_through_host) == (name, through_host)
    assert (
        choice.process_group
        == {
            "nccl": "cpu:gloo,cuda:nccl",
            "gloo": "gloo",
            "mpi": None,
        }[name]
    )
    assert choice.reason


@pytest.mark.parametrize(
    ("cuda", "nccl", "shared", "cause"),
    [
        (False, True, False, "torch.cuda.is_available() is False"),
        (True, False, False, "is_nccl_available() is False"),
        (True, True, True, "share one GPU"),
    ],
)
def test_ring_backend_nccl_without_what_nccl_needs_names_the_cause_and_fix(
    cuda, nccl, shared, cause
):
    with pytest.raises(GpuUnavailableError) as info:
        choose_backend("nccl", cuda_available=cuda, nccl_available=nccl, shared_gpu=shared)
    msg = str(info.value)
    assert "RING_BACKEND=nccl" in msg and cause in msg and "RING_BACKEND=gloo" in msg


def test_unknown_ring_backend_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"RING_BACKEND='ucx'.*gloo, nccl, mpi"):
        choose_backend("ucx", cuda_available=False, nccl_available=False)


@pytest.mark.parametrize(
    ("local_rank", "local_size", "count", "visible", "expected"),
    [
        (0, 1, 1, False, 0),
        (3, 4, 8, False, 3),  # torchrun on an 8-GPU host: local rank
        (3, 4, 4, True, 3),  # CUDA_VISIBLE_DEVICES listing every GPU of the host
        (1, 2, 1, True, 0),  # Ray / Spark gave this process its own GPU
        (1, 2, 1, False, 0),  # two ranks share one GPU
        (3, 4, 2, False, 1),  # round-robin over the GPUs there are
    ],
)
def test_device_index_pins_the_assigned_gpu_else_the_local_rank(
    local_rank, local_size, count, visible, expected
):
    assert device_index(local_rank, local_size, count, visible) == expected


def test_device_index_without_a_device_raises():
    with pytest.raises(GpuUnavailableError, match="no CUDA device"):
        device_index(0, 1, 0, False)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message where CUDA is absent")
def test_use_gpu_true_without_cuda_names_option_value_and_fix():
    with pytest.raises(GpuUnavailableError) as info:
        check_use_gpu(True, "RingTrainer")
    msg = str(info.value)
    assert "RingTrainer: use_gpu=True" in msg
    assert "CUDA build of torch" in msg and "use_gpu=False" in msg
    with pytest.raises(GpuUnavailableError, match="pin_gpu: use_gpu=True"):
        pin_gpu(0, 1)
    assert check_use_gpu(None, "x") is False and check_use_gpu(False, "x") is False
    assert device_of_type("cuda") == "cpu"  # a joined rank's zeros stay on the CPU here


def test_use_gpu_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match=r"est: use_gpu must be None, True or False, got 'yes'"):
        check_use_gpu("yes", "est")


# -- the host-staging seam on CPU ---------------------------------------------------------


class _Recorder:
    """A stand-in inner backend that records the devices it was handed (our own seam)."""

    name = "gloo"

    def __init__(self) -> None:
        self.devices: list[str] = []

    def allreduce(self, t, op, group):
        self.devices.append(t.device.type)
        t.mul_(2)

    def allgather(self, t, dims, group):
        self.devices.append(t.device.type)
        return torch.cat([t, t])


def test_host_staged_passes_cpu_tensors_through_untouched():
    inner = _Recorder()
    staged = HostStaged(inner)
    t = torch.ones(4)
    ptr = t.data_ptr()
    staged.allreduce(t, ReduceOp.Sum, None)
    assert t.data_ptr() == ptr and t.tolist() == [2.0] * 4
    assert staged.allgather(t, [4, 4], None).shape == (8,)
    assert inner.devices == ["cpu", "cpu"] and staged.name == "gloo"


@pytest.mark.gpu
@needs_cuda
def test_host_staged_moves_cuda_tensors_through_host_memory_and_back():
    inner = _Recorder()
    staged = HostStaged(inner)
    t = torch.ones(4, device="cuda")
    staged.allreduce(t, ReduceOp.Sum, None)
    out = staged.allgather(t, [4, 4], None)
    assert inner.devices == ["cpu", "cpu"]
    assert t.is_cuda and t.tolist() == [2.0] * 4
    assert out.is_cuda and out.shape == (8,)


# -- real rings ----------------------------------------------------------------------------


def _ring_facts() -> dict:
    """On 2 CPU ranks: the backend the ring chose and collectives through it."""
    import ringcore.torch as hvd

    hvd.init()
    try:
        eng_backend = ringcore.runtime.state.engine().backend
        x = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
        many = hvd.grouped_allreduce([torch.ones(3) * hvd.rank(), torch.ones(2)], op=hvd.Sum)
        layers, layer = [], eng_backend  # outermost first: shm (CPU), then the network's
        while layer is not None:
            layers.append(layer)
            layer = getattr(layer, "inner", None)
        return {
            "name": ringcore.launch.backend_name(),
            "staged": any(isinstance(b, HostStaged) for b in layers),
            "layers": [type(b).__name__ for b in layers],
            "sum": x.item(),
            "grouped": [t.tolist() for t in many],
        }
    finally:
        hvd.shutdown()


@pytest.mark.timeout(90)
def test_cpu_ring_without_cuda_is_gloo_with_cuda_staged_through_host():
    facts = run_workers(_ring_facts, np=2)
    for f in facts:
        assert f["name"] == "gloo"
        assert f["staged"] is True  # CUDA tensors, if any, would go via host memory
        # CPU tensors of 2 ranks on one host: the shared-memory plane over that
        assert f["layers"] == ["ShmBackend", "HostStaged", "TorchDistBackend"], f
        assert f["sum"] == 3.0
        assert f["grouped"] == [[1.0, 1.0, 1.0], [2.0, 2.0]]


@pytest.mark.timeout(30)
def test_torch_backend_of_a_gloo_group_stages_cuda_and_keeps_cpu_native():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backend = torch_backend()
        assert isinstance(backend, HostStaged) and isinstance(backend.inner, TorchDistBackend)
        assert backend.inner.cuda_native is False
        t = torch.arange(3.0)
        backend.allreduce(t, ReduceOp.Sum, None)
        assert t.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(30)
def test_adopted_group_without_a_cpu_backend_gets_a_gloo_side_group_for_cpu_tensors():
    # init_process_group("nccl") leaves no CPU backend; "cuda:gloo" stands in for it here.
    import torch.distributed as dist

    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="cpu"):
            dist.all_reduce(torch.ones(2))  # the adopted group itself cannot move CPU tensors
        backend = torch_backend()
        t = torch.ones(2)
        backend.allreduce(t, ReduceOp.Sum, None)
        sub = backend.new_group([0], 2)
        backend.allreduce(t, ReduceOp.Sum, sub)
        assert t.tolist() == [1.0, 1.0]
        assert set(backend.inner._cpu_groups) == {None, sub}
    finally:
        dist.destroy_process_group()


def _gpu_facts(steps: int) -> dict:
    """CUDA tensors through the ring the job chose, and training steps on the GPU."""
    import ringcore.torch as hvd

    hvd.init()
    try:
        dev = pin_gpu()
        r, n = hvd.rank(), hvd.size()
        x = hvd.allreduce(torch.full((1000,), float(r + 1), device=dev), op=hvd.Sum)
        grouped = hvd.grouped_allreduce(
            [torch.ones(5, device=dev) * r, torch.ones(7, device=dev)], op=hvd.Sum
        )
        gathered = hvd.allgather(torch.full((r + 1, 2), float(r), device=dev))
        b = hvd.broadcast(torch.full((3,), float(r), device=dev), root_rank=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        ).to(dev)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        gen = torch.Generator(device="cpu").manual_seed(r)
        losses = []
        for _ in range(steps):
            xb = torch.randn(64, 32, generator=gen).to(dev)
            yb = torch.randint(0, 4, (64,), generator=gen).to(dev)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {
            "backend": ringcore.launch.backend_name(),
            "device": str(x.device),
            "sum": x[0].item(),
            "expected_sum": float(n * (n + 1) / 2),
            "grouped": [t.sum().item() for t in grouped],
            "gathered_rows": gathered.shape[0],
            "gathered_cuda": gathered.is_cuda,
            "broadcast": b.tolist(),
            "weights": hvd.allgather(weights.unsqueeze(0)).cpu(),
            "losses": losses,
            "n": n,
        }
    finally:
        hvd.shutdown()


def _check_gpu_facts(facts: list[dict], backend: str) -> None:
    n = len(facts)
    for f in facts:
        assert f["backend"] == backend
        assert f["device"].startswith("cuda")
        assert f["sum"] == f["expected_sum"]
        assert f["grouped"] == [5.0 * sum(range(n)), 7.0 * n]
        assert f["gathered_rows"] == n * (n + 1) // 2 and f["gathered_cuda"]
        assert f["broadcast"] == [0.0, 0.0, 0.0]
        # every rank holds the same weights after the averaged steps
        w = f["weights"]
        assert torch.allclose(w[0], w[-1])
        assert all(loss == loss for loss in f["losses"])  # no NaN


@pytest.mark.gpu
@needs_nccl
@pytest.mark.timeout(120)
def test_size_one_nccl_ring_runs_cuda_collectives_and_training_steps():
    facts = run_workers(_gpu_facts, np=1, args=(5,), env={"RING_BACKEND": "nccl"})
    _check_gpu_facts(facts, "nccl")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_two_processes_sharing_a_gpu_move_cuda_tensors_through_gloo():
    # NCCL refuses two ranks on one device: with RING_BACKEND unset, init() sees (by
    # device UUID) that the two ranks pinned the same GPU and chooses Gloo, copying
    # every CUDA tensor to host memory and back.
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    facts = run_workers(_gpu_facts, np=2, args=(5,), env={"CUDA_VISIBLE_DEVICES": first})
    _check_gpu_facts(facts, "gloo")
