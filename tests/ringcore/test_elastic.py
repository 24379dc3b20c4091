"""Elastic training under ringcore.testing.run_workers: a rank SIGKILLed mid-epoch, the
survivors restore the last commit, re-form the ring and finish — every sample of every
epoch trained exactly once (in committed steps)."""

from __future__ import annotations

import pytest

from ringcore import WorkerError
from ringcore.testing import run_workers

N, BATCH, EPOCHS = 48, 4, 2


def _elastic_worker(kill_rank, kill_at_step, step_sleep=0.02, fault="kill"):
    import os
    import signal
    import time

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    sampler = elastic.ElasticSampler(N, shuffle=True, seed=1)
    state = elastic.TorchState(
        model, opt, sampler=sampler, epoch=0, trained=[], steps=0, ranks_seen=[]
    )
    data = torch.arange(N, dtype=torch.float32).view(-1, 1).repeat(1, 3)

    @elastic.run
    def train(state):
        state.ranks_seen.append(hvd.size())
        while state.epoch < EPOCHS:
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                opt.step()
                # every rank learns how many samples the ring trained in this step
                count = int(
                    hvd.allreduce(torch.tensor([len(chunk)]), op=hvd.Sum, name="count").item()
                )
                state.steps += 1
                if (
                    state.steps == kill_at_step
                    and hvd.rank() == kill_rank
                    and os.environ["RING_WORKER_ID"] == str(kill_rank)
                ):
                    if fault == "raise":
                        raise RuntimeError("a bug in user code on one rank")
                    os.kill(os.getpid(), signal.SIGKILL)
                state.trained.append((state.epoch, count))
                state.sampler.record_indices(chunk)
                time.sleep(step_sleep)
                state.commit()
            hvd.join()  # ranks may hold one batch more than others after a re-shard
            assert sorted(state.sampler.processed) == list(range(N)), (
                "an epoch must cover every sample"
            )
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.trained, state.ranks_seen, hvd.size()

    return train(state)


def test_a_killed_rank_is_dropped_and_training_finishes_from_the_last_commit():
    res = run_workers(_elastic_worker, np=3, args=(2, 3), timeout=180, elastic=True)
    assert isinstance(res[2], WorkerError) and res[2].error_type == "ProcessExit"
    for trained, ranks_seen, final_size in res[:2]:
        assert final_size == 2
        assert ranks_seen == [3, 2]  # started on 3 ranks, re-formed on 2
        for epoch in range(EPOCHS):
            assert sum(c for e, c in trained if e == epoch) == N  # none repeated, none skipped
    assert res[0][0] == res[1][0]


def test_an_added_worker_gets_the_state_from_rank_0_and_training_goes_on_on_3_ranks():
    # the two ranks train for ~3 s (12 steps of 0.25 s) once started (~0.5 s from the
    # fork server); the third worker comes 1.5 s after the start, in the middle of that
    res = run_workers(
        _elastic_worker, np=2, args=(-1, -1, 0.25), timeout=180, elastic=True, grow=[(1.5, 1)]
    )
    assert len(res) == 3
    for trained, ranks_seen, final_size in res:
        assert final_size == 3
        assert ranks_seen == [2, 3]  # the added worker received the list from rank 0
        for epoch in range(EPOCHS):
            assert sum(c for e, c in trained if e == epoch) == N
    assert res[0][0] == res[1][0] == res[2][0]


def test_without_an_elastic_launcher_a_failure_is_raised():
    def worker():
        import ringcore.torch as hvd
        from ringcore.torch import elastic

        hvd.init()
        state = elastic.ObjectState(x=1)

        @elastic.run
        def f(state):
            raise hvd.RingInternalError("boom")

        try:
            f(state)
        except hvd.RingInternalError as exc:
            return str(exc)

    assert run_workers(worker, np=2, timeout=60) == ["boom", "boom"]


@pytest.mark.parametrize("np_", [2])
def test_object_state_commit_restore_sync(np_):
    def worker():
        import ringcore.torch as hvd
        from ringcore.torch import elastic

        hvd.init()
        state = elastic.ObjectState(epoch=hvd.rank(), items=[hvd.rank()])
        state.sync()  # everyone gets rank 0's
        synced = (state.epoch, list(state.items))
        state.epoch, state.items = 5, [9]
        state.commit()
        state.epoch, state.items = 7, [1, 2]
        state.restore()
        return synced, (state.epoch, state.items)

    assert run_workers(worker, np=np_, timeout=60) == [((0, [0]), (5, [9]))] * np_


@pytest.mark.reliability(
    fault="a rank raising in user code inside an elastic job", category="fault"
)
def test_a_rank_whose_code_raises_leaves_and_the_others_re_form_without_waiting_for_it(request):
    import time

    from _reliability import record

    started = time.monotonic()
    res = run_workers(
        _elastic_worker,
        np=3,
        args=(2, 3, 0.02, "raise"),
        timeout=120,
        elastic=True,
        env={"RING_START_TIMEOUT": "60"},
    )
    elapsed = time.monotonic() - started
    assert isinstance(res[2], WorkerError) and res[2].error_type == "RuntimeError"
    for _trained, ranks_seen, final_size in res[:2]:
        assert (ranks_seen, final_size) == ([3, 2], 2)
    # the leaver said so: the next ring did not wait RING_START_TIMEOUT (60 s) for it
    assert elapsed < 45, elapsed
    record(request, recover_s=elapsed)


@pytest.fixture
def launcher_store(monkeypatch):
    """An elastic job's launcher store on 127.0.0.1 at generation 1 (its port), with this
    process set up as an elastic worker of it; the worker's elastic state forgotten after."""
    import torch.distributed as dist

    from ringcore.elastic import worker as _elastic

    launcher = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    monkeypatch.setenv("RING_ELASTIC", "1")
    monkeypatch.setenv("RING_STORE_ADDR", "127.0.0.1")
    monkeypatch.setenv("RING_STORE_PORT", str(launcher.port))
    monkeypatch.setenv("RING_WORKER_ID", "w1")
    _elastic.forget_job()
    launcher.add(_elastic.GEN_KEY, 1)
    try:
        yield launcher
    finally:
        _elastic.forget_job()


def _ring_client(port: int, prefix: str):
    import torch.distributed as dist

    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))


def test_a_rank_waiting_at_a_superseded_generations_rendezvous_leaves_it_at_once(
    monkeypatch, launcher_store
):
    """A rank at generation 1's rendezvous whose peer moved on to a newer generation
    (the launcher published generation 2) stops waiting within a poll, not at the start
    timeout: the peer never arrives at a superseded rendezvous."""
    import datetime
    import threading
    import time

    from ringcore import topology_from_hosts
    from ringcore._errors import RendezvousError
    from ringcore.backends import torch_ring as _torch_ring
    from ringcore.elastic import worker as _elastic
    from ringcore.rendezvous.environment import Rendezvous
    from ringcore.runtime import lifecycle

    port = launcher_store.port
    monkeypatch.setattr(_elastic, "_my_generation", 1)  # this worker joined generation 1
    monkeypatch.setattr(_elastic, "_rejoining", True)  # inside rejoin()
    rdv = lifecycle._joining(
        Rendezvous(topology_from_hosts(["a", "a"], 1), "127.0.0.1", port, False, "test")
    )
    ring = _ring_client(port, "elastic/ring/1")
    threading.Timer(1.0, launcher_store.add, (_elastic.GEN_KEY, 1)).start()  # generation 2
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="generation 1 of the ring was superseded"):
        _torch_ring._await_ranks(ring, rdv, datetime.timedelta(seconds=60))
    assert time.monotonic() - start < 10
    # without a newer generation the wait ends at the timeout, naming the missing rank
    monkeypatch.setattr(_elastic, "_my_generation", 2)
    ring2 = _ring_client(port, "elastic/ring/2")
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"ranks \[0\] did not arrive"):
        _torch_ring._await_ranks(ring2, rdv, datetime.timedelta(seconds=2.5))
    assert 2.0 < time.monotonic() - start < 10


def test_the_first_rings_rendezvous_waits_for_its_members_even_after_a_newer_generation(
    launcher_store,
):
    """Every member of the first ring comes to it (it grows afterwards, from inside the
    ring), as a late worker comes to the ring it was added to: outside rejoin() a newer
    generation published meanwhile does not make a rank leave."""
    import datetime
    import threading

    from ringcore import topology_from_hosts
    from ringcore.backends import torch_ring as _torch_ring
    from ringcore.rendezvous.environment import Rendezvous
    from ringcore.runtime import lifecycle

    port = launcher_store.port  # generation 1 is published before rank 0 arrives
    rdv = lifecycle._joining(  # outside rejoin(): nothing makes this rendezvous moot
        Rendezvous(topology_from_hosts(["a", "a"], 1), "127.0.0.1", port, False, "test")
    )
    ring, late = _ring_client(port, "ring0"), _ring_client(port, "ring0")
    threading.Timer(2.5, late.set, ("arrived/0", "1")).start()  # rank 0, late
    _torch_ring._await_ranks(ring, rdv, datetime.timedelta(seconds=30))
