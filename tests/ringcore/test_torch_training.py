"""ringcore.torch for training: DistributedOptimizer (hooks overlapping backward,
accumulation, compression, groups, skip_synchronize), state broadcasts, sparse
gradients — each checked against one process on the concatenated batch."""

from __future__ import annotations

import pytest

from ringcore.testing import run_workers

CONFIGS = [
    {"id": "sgd", "opt": "sgd"},
    {"id": "adam", "opt": "adam"},
    {"id": "sgd-bpps2", "opt": "sgd", "bpps": 2},
    {"id": "adam-bpps2", "opt": "adam", "bpps": 2},
    {"id": "sgd-fp16", "opt": "sgd", "fp16": True},
    {"id": "adam-groups2", "opt": "adam", "num_groups": 2},
    {"id": "sgd-clip-skip-sync", "opt": "sgd", "clip": True},
    {"id": "sgd-predivide", "opt": "sgd", "predivide": 2.0},
]


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _optimizer(name, params):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.05)


def _train_both(cfg, rank, size, steps=4, batch=8):
    import torch

    import ringcore.torch as hvd

    bpps = cfg.get("bpps", 1)
    dist_model, ref_model = _model(), _model()
    opt = hvd.DistributedOptimizer(
        _optimizer(cfg["opt"], dist_model.parameters()),
        named_parameters=dist_model.named_parameters(),
        backward_passes_per_step=bpps,
        compression=hvd.Compression.fp16 if cfg.get("fp16") else hvd.Compression.none,
        num_groups=cfg.get("num_groups", 0),
        gradient_predivide_factor=cfg.get("predivide", 1.0),
    )
    ref_opt = _optimizer(cfg["opt"], ref_model.parameters())
    gen = torch.Generator().manual_seed(42)
    per = batch // size
    overlapped = []
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for _ in range(bpps):
            x, y = torch.randn(batch, 6, generator=gen), torch.randn(batch, 3, generator=gen)
            mine = slice(rank * per, (rank + 1) * per)
            torch.nn.functional.mse_loss(dist_model(x[mine]), y[mine]).backward()
            torch.nn.functional.mse_loss(ref_model(x), y).backward()
        overlapped.append(len(opt._handles) > 0 or size == 1)  # hooks started the allreduces
        if cfg.get("clip"):
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(dist_model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.step()
    diff = max(
        float((a - b).abs().max()) for a, b in zip(dist_model.parameters(), ref_model.parameters())
    )
    return diff, all(overlapped), [p.detach().clone() for p in dist_model.parameters()]


def _training_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for cfg in CONFIGS:
        out[cfg["id"]] = _train_both(cfg, r, n)
    # too many backward passes before step()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(2, 6)).sum().backward()
    try:
        model(torch.ones(2, 6)).sum().backward()
        out["too_many"] = None
    except AssertionError as exc:
        out["too_many"] = str(exc)
    opt.synchronize()
    # duplicate names
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[("w", p) for p in model.parameters()],
        )
        out["dupes"] = None
    except ValueError as exc:
        out["dupes"] = str(exc)
    # broadcast of parameters and optimizer state (Adam after steps; SGD before any step)
    model = _model()
    for p in model.parameters():
        p.data.add_(float(r))
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:
        model(torch.ones(3, 6)).sum().backward()
        adam.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5 if r == 0 else 0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    state = adam.state_dict()
    out["bcast"] = (
        [p.detach().clone() for p in model.parameters()],
        state["param_groups"][0]["lr"],
        [state["state"][k]["exp_avg"].clone() for k in sorted(state["state"])],
        sgd.param_groups[0]["lr"],
    )
    # sparse gradients (nn.Embedding(sparse=True)), as sparse and as dense
    emb = torch.nn.Embedding(10, 4, sparse=True)
    torch.manual_seed(1)
    emb.weight.data.normal_()
    ids = torch.tensor([r, 5, 9 - r])
    emb(ids).sum().backward()
    handle = hvd.sparse_allreduce_async(emb.weight.grad, name="emb", op=hvd.Average)
    out["sparse"] = hvd.synchronize(handle).to_dense()
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_training_worker, np=2, timeout=240)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["id"] for c in CONFIGS])
def test_two_ranks_match_one_process_on_the_concatenated_batch(results, cfg):
    tolerance = 2e-3 if cfg.get("fp16") else 1e-5
    for res in results:
        diff, overlapped, _ = res[cfg["id"]]
        assert diff < tolerance
        assert overlapped, "the allreduces should start during backward, before step()"
    # and every rank ends with the same parameters
    import torch

    assert all(
        torch.equal(a, b) for a, b in zip(results[0][cfg["id"]][2], results[1][cfg["id"]][2])
    )


def test_too_many_backward_passes_before_step_says_how_to_fix_it(results):
    assert all("Increase backward_passes_per_step" in r["too_many"] for r in results)


def test_duplicate_parameter_names_are_rejected(results):
    assert all("Found duplicates: w" in r["dupes"] for r in results)


def test_broadcast_makes_parameters_and_optimizer_state_identical(results):
    import torch

    (p0, lr0, m0, sgd0), (p1, lr1, m1, sgd1) = (r["bcast"] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert lr0 == lr1 == 0.01
    assert len(m0) == len(m1) > 0 and all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert sgd0 == sgd1 == 0.5  # a scalar hyper-parameter, before any step


def test_sparse_allreduce_averages_embedding_gradients(results):
    import torch

    expected = torch.zeros(10, 4)
    for r in range(2):
        for i in (r, 5, 9 - r):
            expected[i] += 1.0 / 2
    for res in results:
        assert torch.allclose(res["sparse"], expected)


def _sync_bn_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(4 * n, 3, 5, 5, generator=gen) * 2 + 1
    coef = torch.randn(4 * n, 3, 5, 5, generator=gen)
    mine = slice(4 * r, 4 * (r + 1))
    sbn, bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            m.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    x = full[mine].clone().requires_grad_(True)
    out = sbn(x)
    (out * coef[mine]).sum().backward()
    xf = full.clone().requires_grad_(True)
    ref = bn(xf)
    (ref * coef).sum().backward()
    return {
        "out": float((out - ref[mine]).abs().max()),
        "dx": float((x.grad - xf.grad[mine]).abs().max()),
        "running": float(
            (sbn.running_var - bn.running_var).abs().max()
            + (sbn.running_mean - bn.running_mean).abs().max()
        ),
        # weight grads are local sums; their sum over ranks is the full-batch gradient
        "dw": hvd.allreduce(sbn.weight.grad, op=hvd.Sum),
        "dw_ref": bn.weight.grad,
        "eval": float((sbn.eval()(full[mine]) - bn.eval()(full[mine])).abs().max()),
    }


@pytest.mark.parametrize("np_", [2, 3])
def test_sync_batch_norm_equals_batch_norm_on_the_full_batch(np_):
    import torch

    for res in run_workers(_sync_bn_worker, np=np_, timeout=120):
        assert (
            res["out"] < 1e-5 and res["dx"] < 1e-4 and res["running"] < 1e-5 and res["eval"] < 1e-5
        )
        assert torch.allclose(res["dw"], res["dw_ref"], atol=1e-4)


def _autograd_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    gen = torch.Generator().manual_seed(11)
    ws = [torch.randn(n * 2, 3, generator=gen) for _ in range(n)]  # every rank's upstream weights
    w = ws[r]
    out = {}

    def grad_of(fn, x):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y = y[0] if isinstance(y, tuple) else y
        (y * w[: y.shape[0]]).sum().backward()
        return x.grad

    x = torch.randn(n * 2, 3, generator=gen) + r
    out["allreduce_sum"] = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x)
    out["allreduce_avg"] = grad_of(lambda t: hvd.allreduce(t), x)
    out["allgather"] = grad_of(lambda t: hvd.allgather(t), x[:2])
    out["broadcast"] = grad_of(lambda t: hvd.broadcast(t, root_rank=1), x)
    out["alltoall"] = grad_of(lambda t: hvd.alltoall(t), x)
    out["reducescatter"] = grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum), x)
    return ws, out


def test_collectives_differentiate_as_horovod_defines():
    import torch

    res = run_workers(_autograd_worker, np=2, timeout=120)
    ws = res[0][0]
    total, mean = ws[0] + ws[1], (ws[0] + ws[1]) / 2
    for r, (_, g) in enumerate(res):
        assert torch.allclose(g["allreduce_sum"], total)
        assert torch.allclose(g["allreduce_avg"], mean)
        assert torch.allclose(g["allgather"], mean[:4][2 * r : 2 * r + 2])
        assert torch.allclose(g["broadcast"], mean if r == 1 else torch.zeros_like(mean))
        # alltoall: row block j of my input went to rank j, which weighted it by its first rows
        assert torch.allclose(
            g["alltoall"], torch.cat([ws[j][2 * r : 2 * r + 2] for j in range(2)])
        )
        # reducescatter (Sum): my input rows for rank j's slice get rank j's weights, times
        # the number of ranks (Horovod's definition: allgather(grad) * size for Sum)
        assert torch.allclose(g["reducescatter"], 2 * torch.cat([ws[j][:2] for j in range(2)]))


def _optimizer_after_a_dead_peer_worker():
    import os
    import signal

    import torch

    import ringcore.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x = torch.ones(2, 4)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before the second step's allreduce
    opt.zero_grad()
    model(x).sum().backward()  # the hooks submit allreduces the dead peer never joins
    try:
        opt.step()
    except hvd.RingInternalError:
        pass
    else:
        return "step() did not fail"
    pending = len(opt._handles)
    opt.zero_grad()  # an elastic reset does this next: it must not say "still being reduced"
    return pending


@pytest.mark.timeout(120)
def test_a_failed_step_leaves_no_pending_handles_so_zero_grad_works_after_it(monkeypatch):
    from ringcore import WorkerError

    monkeypatch.setenv("RING_GLOO_TIMEOUT_SECONDS", "10")
    res = run_workers(_optimizer_after_a_dead_peer_worker, np=2, timeout=90, return_exceptions=True)
    assert isinstance(res[1], WorkerError) and res[1].error_type == "ProcessExit"
    assert res[0] == 0
