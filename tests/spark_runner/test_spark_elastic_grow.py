"""spark_runner.run_elastic shrinks and grows back: on ``local[3,2]`` (two attempts per
task) one of three workers leaves the ring (its code raised: ``elastic.run`` tells the
driver at once) and the ring re-forms on the two survivors; once they trained committed
steps on their own, the leaver's process is SIGKILLed, so Spark sees its task lost and
retries it; the retried task joins as a new worker and the ring re-forms on three.
Every sample of every epoch is trained exactly once (in committed steps), whichever ring
trained it: each step gathers the sample indices every rank trained.

The task is lost only after the ring of two trained: a SIGKILL alone closes the
worker's connections and fails its task at once, and the task Spark retries can connect
within the driver's grace period, so the survivors would go from three straight to
three again and the shrink would show only sometimes.
"""

from __future__ import annotations

import io

import pytest
from _reliability import record

import spark_runner

pytestmark = pytest.mark.spark

N, BATCH, MIN_EPOCHS, MAX_EPOCHS = 48, 4, 2, 60
SHRUNK_STEPS = 2  # committed steps the ring of two trains before the leaver's task is lost


@pytest.fixture(scope="module")
def spark():
    session = spark_runner.local_session("local[3,2]", app_name="test_spark_elastic_grow")
    try:
        yield session
    finally:
        session.stop()


def _train(leave_at_step, shrunk_marker):
    import os
    import signal
    import time

    import torch
    from pyspark import TaskContext

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    class Leaving(Exception):
        pass

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    sampler = elastic.ElasticSampler(N, shuffle=True, seed=1)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, trained=[], steps=0, sizes=[])
    data = torch.arange(N, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    worker = os.environ["RING_WORKER_ID"]  # <slot>-<Spark task attempt id>
    attempt = TaskContext.get().attemptNumber()  # 0, then 1 for the task Spark retried
    leaver = worker.startswith("2-") and attempt == 0

    def more(state):  # the same answer on every rank: the state is synchronized
        if state.sampler.processed:  # re-formed mid-epoch: finish the epoch
            return True
        grown_back = len(state.sizes) > 1 and state.sizes[-1] == 3
        return state.epoch < MIN_EPOCHS or (not grown_back and state.epoch < MAX_EPOCHS)

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        print(f"ring of {hvd.size()}")
        while more(state):
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                opt.step()
                # the sample indices every rank trained in this step, in rank order
                every = hvd.allgather_object([int(i) for i in chunk], name="chunks")
                state.steps += 1
                if state.steps == leave_at_step and leaver:
                    raise Leaving  # elastic.run tells the driver this worker is out
                state.trained.append((state.epoch, hvd.size(), [i for c in every for i in c]))
                state.sampler.record_indices(chunk)
                time.sleep(0.05)
                state.commit()
                shrunk = sum(1 for _, n, _ in state.trained if n == 2)
                if hvd.rank() == 0 and shrunk >= SHRUNK_STEPS and hvd.size() == 2:
                    open(shrunk_marker, "a").close()  # committed on two: the task may go
            hvd.join()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.trained, state.sizes, hvd.rank(), hvd.size(), worker, attempt

    try:
        return train(state)
    except Leaving:
        hvd.shutdown()  # the survivors' next collective fails: they re-form on two
        deadline = time.monotonic() + 240
        while not os.path.exists(shrunk_marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)  # now Spark sees the task lost and retries it


@pytest.mark.reliability(
    fault="a Spark task lost under run_elastic, retried by Spark (ring grows back)",
    category="fault",
)
@pytest.mark.timeout(300)
def test_run_elastic_grows_back_when_spark_retries_the_lost_task(spark, tmp_path, request):
    out = io.StringIO()
    results = spark_runner.run_elastic(
        _train,
        args=(3, str(tmp_path / "shrunk")),
        num_proc=3,
        min_num_proc=2,
        stdout=out,
        stderr=io.StringIO(),
    )
    assert [r[2] for r in results] == [0, 1, 2]  # the final ring: three again
    workers = {r[4]: r[5] for r in results}  # worker id -> its task's attempt number
    assert sorted(w.split("-")[0] for w in workers) == ["0", "1", "2"]
    retried = next(w for w in workers if w.startswith("2-"))
    assert workers[retried] == 1  # Spark's retry of the lost task, not its first attempt
    assert int(retried.split("-")[1]) >= 3  # a later task than the first three
    for trained, sizes, _, size, _, _ in results:
        assert size == 3
        # formed on 3, re-formed on the 2 survivors, then on 3 with the retried task
        assert sizes[0] == 3 and sizes[-1] == 3 and 2 in sizes[1:-1], sizes
        assert set(sizes) == {2, 3}, sizes
        rings = [n for _, n, _ in trained]  # the ring size of every committed step, in order
        first, shrunk = rings.index(2), rings.count(2)
        # steps on three, then at least SHRUNK_STEPS on two, then on three (none, when the
        # ring grew back at the end of the last epoch)
        assert first >= 1 and shrunk >= SHRUNK_STEPS, rings
        assert rings == [3] * first + [2] * shrunk + [3] * (len(rings) - first - shrunk), rings
        epochs = sorted({e for e, _, _ in trained})
        assert epochs == list(range(len(epochs))) and len(epochs) >= MIN_EPOCHS
        for epoch in epochs:
            indices = sorted(i for e, _, step in trained if e == epoch for i in step)
            assert indices == list(range(N)), (epoch, indices)  # none repeated, none skipped
    assert results[0][0] == results[1][0] == results[2][0]
    lines = out.getvalue().splitlines()
    assert lines.count("[0]<stdout>:ring of 3") >= 2  # the first ring and the grown one
    assert "[0]<stdout>:ring of 2" in lines and "[1]<stdout>:ring of 2" in lines
    record(
        request,
        note=f"sizes {results[0][1]}, {shrunk} steps on 2; the retried task {retried} joined",
    )
