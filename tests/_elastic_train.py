"""The training function of the ``spark_runner.run_elastic`` tests that lose a worker
(tests/spark_runner/test_spark_elastic.py on classic Spark, test_spark_connect.py on
Spark Connect), and what they check of its results.

Every step gathers the sample indices every rank trained in it; the state keeps them
with the ring's size, so each epoch's gathered indices show whether every sample was
trained exactly once (in committed steps), whichever ring trained it.
"""

from __future__ import annotations

N, BATCH, EPOCHS = 48, 4, 2


def train_losing_one_worker(kill_at_step, victim_slot, full_size):
    """An elastic job whose worker of slot ``victim_slot`` SIGKILLs its own process at
    committed step ``kill_at_step`` of a ring of ``full_size`` — only on its task's
    first attempt, so a task Spark retries joins and stays. Returns ``(trained, sizes,
    rank, size, worker id, task attempt)``."""
    import os
    import signal
    import time

    import torch
    from pyspark import TaskContext

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
    worker = os.environ["RING_WORKER_ID"]  # <slot>-<Spark task attempt id>
    attempt = TaskContext.get().attemptNumber()  # 1 for a task Spark retried
    victim = worker.startswith(f"{victim_slot}-") and attempt == 0

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        print(f"ring of {hvd.size()}")
        while state.epoch < EPOCHS:
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                opt.step()
                # the sample indices every rank trained in this step, in rank order
                every = hvd.allgather_object([int(i) for i in chunk], name="chunks")
                state.steps += 1
                if state.steps == kill_at_step and victim and hvd.size() == full_size:
                    os.kill(os.getpid(), signal.SIGKILL)
                state.trained.append((state.epoch, hvd.size(), [i for c in every for i in c]))
                state.sampler.record_indices(chunk)
                time.sleep(0.02)
                state.commit()
            hvd.join()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.trained, state.sizes, hvd.rank(), hvd.size(), worker, attempt

    return train(state)


def assert_every_sample_trained_once_per_epoch(trained) -> None:
    """Each of the :data:`EPOCHS` epochs trained every sample exactly once."""
    assert {e for e, _, _ in trained} == set(range(EPOCHS))
    for epoch in range(EPOCHS):
        indices = sorted(i for e, _, step in trained if e == epoch for i in step)
        assert indices == list(range(N)), (epoch, indices)  # none repeated, none skipped
