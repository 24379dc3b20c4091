"""spark_runner.run_elastic grows back: on ``local[3,2]`` (two attempts per task) one of
three workers is SIGKILLed; the ring re-forms without it, Spark retries the lost task, the
retried task joins as a new worker and the ring re-forms on three. Every sample of every
epoch is trained exactly once, whichever ring trained it."""

from __future__ import annotations

import io

import pytest
from _reliability import record

import spark_runner

pytestmark = pytest.mark.spark

N, BATCH, MIN_EPOCHS, MAX_EPOCHS = 48, 4, 2, 60


@pytest.fixture(scope="module")
def spark():
    session = spark_runner.local_session("local[3,2]", app_name="test_spark_elastic_grow")
    try:
        yield session
    finally:
        session.stop()


def _train(kill_at_step):
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
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, trained=[], steps=0, sizes=[])
    data = torch.arange(N, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    worker = os.environ["RING_WORKER_ID"]

    def grown_back(sizes):  # the same answer on every rank: sizes is synchronized state
        return len(sizes) > 1 and sizes[-1] == 3

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        print(f"ring of {hvd.size()}")
        while state.epoch < MIN_EPOCHS or (
            not grown_back(state.sizes) and state.epoch < MAX_EPOCHS
        ):
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                opt.step()
                count = int(hvd.allreduce(torch.tensor([len(chunk)]), op=hvd.Sum, name="n").item())
                state.steps += 1
                first_ring = len(state.sizes) == 1  # only there: the retried task lives on
                if state.steps == kill_at_step and worker.startswith("2-") and first_ring:
                    os.kill(os.getpid(), signal.SIGKILL)
                state.trained.append((state.epoch, count))
                state.sampler.record_indices(chunk)
                time.sleep(0.05)
                state.commit()
            hvd.join()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.trained, state.sizes, hvd.rank(), hvd.size(), worker

    return train(state)


@pytest.mark.reliability(
    fault="a Spark task lost under run_elastic, retried by Spark (ring grows back)",
    category="fault",
)
@pytest.mark.timeout(180)
def test_run_elastic_grows_back_when_spark_retries_the_lost_task(spark, request):
    out = io.StringIO()
    results = spark_runner.run_elastic(
        _train, args=(3,), num_proc=3, min_num_proc=2, stdout=out, stderr=io.StringIO()
    )
    assert [rank for _, _, rank, _, _ in results] == [0, 1, 2]  # the final ring: three again
    workers = sorted(w for *_, w in results)
    assert [w.split("-")[0] for w in workers] == ["0", "1", "2"]
    retried = next(w for w in workers if w.startswith("2-"))
    assert int(retried.split("-")[1]) >= 3  # a later task attempt than the first three
    for trained, sizes, _, size, _ in results:
        assert size == 3
        # formed on 3, re-formed on the 2 survivors and then on 3 with the retried task —
        # or straight on 3 when the death and the retry fell in one grace period
        assert sizes[0] == 3 and sizes[-1] == 3 and len(sizes) >= 2 and set(sizes) <= {2, 3}
        epochs = sorted({e for e, _ in trained})
        assert epochs == list(range(len(epochs))) and len(epochs) >= 2
        for epoch in epochs:
            assert sum(c for e, c in trained if e == epoch) == N  # none repeated or skipped
    assert results[0][0] == results[1][0] == results[2][0]
    lines = out.getvalue().splitlines()
    assert lines.count("[0]<stdout>:ring of 3") >= 2  # the first ring and the grown one
    record(request, note=f"sizes {results[0][1]}; the retried task {retried} joined")
