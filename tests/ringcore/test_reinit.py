"""init() -> shutdown() -> init() when rank 0 hosts the job's store itself (Horovod's
``test_horovod_reinit``; ``horovodrun``-style variables, no launcher store): the ranks
leave one ring and join the next in no particular order, and every ring still forms.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _servers import free_port

from ringcore.rendezvous.store_server import host_store, hosted_store, stop_store_server

ROOT = Path(__file__).resolve().parents[2]

# Each cycle: init, a sum over the ring, then the rank named by LINGER[cycle] (if any)
# stays a second in the ring the other rank has already left before it shuts down.
_SCRIPT = """
import sys, time, torch
import ringcore.torch as hvd

LINGER = {0: 0, 1: 1}
for cycle in range(3):
    hvd.init()
    total = hvd.allreduce(torch.ones(4) * (hvd.rank() + 1), op=hvd.Sum, name=f"c{cycle}")
    assert total.tolist() == [3.0] * 4, total
    if LINGER.get(cycle) == hvd.rank():
        time.sleep(1.0)
    hvd.shutdown()
print("cycles done")
"""


def _launch(script: Path, port: int) -> list[subprocess.Popen]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    procs = []
    for rank in range(2):
        env = dict(
            base,
            PYTHONPATH=str(ROOT),
            HOROVOD_RANK=str(rank),
            HOROVOD_SIZE="2",
            HOROVOD_LOCAL_RANK=str(rank),
            HOROVOD_LOCAL_SIZE="2",
            HOROVOD_CROSS_RANK="0",
            HOROVOD_CROSS_SIZE="1",
            HOROVOD_HOSTNAME="localhost",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RING_START_TIMEOUT="30",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _wait_all_or_first_failure(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each rank's output once all exited, or once one failed (the others are killed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if None not in codes or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.communicate()[0] for p in procs]


@pytest.mark.reliability(
    fault="ranks leaving a ring and joining the next one at different times", category="fault"
)
@pytest.mark.timeout(120)
def test_init_after_shutdown_forms_every_ring_while_the_other_rank_still_lingers(tmp_path):
    script = tmp_path / "reinit.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    procs = _launch(script, free_port())
    outputs = _wait_all_or_first_failure(procs, timeout_s=100)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    assert all("cycles done" in o for o in outputs)


def test_the_store_rank_0_hosts_on_a_port_is_kept_until_another_port_replaces_it():
    seconds = 5.0
    first, second = free_port(), free_port()
    try:
        store = host_store("127.0.0.1", first, 2, seconds)
        store.set("formed", "1")  # type: ignore[attr-defined]
        assert host_store("127.0.0.1", first, 2, seconds) is store
        assert hosted_store(first) is store
        host_store("127.0.0.1", second, 2, seconds)
        assert hosted_store(first) is None and hosted_store(second) is not None
    finally:
        stop_store_server()
