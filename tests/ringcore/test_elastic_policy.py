"""The elastic policy on its own: ``ElasticDriver`` over a fake launcher and a dict store.

The launcher is our own seam (who is alive, start one more), so faking it is fair: the
store is a dict with TCPStore's three calls, and time is a counter the test moves.
"""

from __future__ import annotations

import json

import pytest

from ringcore.launch import ElasticDriver, ElasticPolicy, Workers


class _Store:
    """The three calls of ``torch.distributed.TCPStore`` the driver uses."""

    def __init__(self):
        self.data: dict[str, object] = {}

    def add(self, key: str, n: int) -> int:
        self.data[key] = int(self.data.get(key, 0)) + n  # type: ignore[call-overload]
        return int(self.data[key])  # type: ignore[call-overload]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> str:
        return str(self.data[key])

    def world(self, g: int) -> dict:
        return json.loads(self.get(f"elastic/world/{g}"))


class _Launcher:
    """Workers by id; ``slots`` is how many more could start now."""

    def __init__(self, ids: list[str], slots: int = 0):
        self.ids, self.slots = list(ids), slots
        self.done: set[str] = set()
        self.started = 0

    def alive(self) -> Workers:
        return Workers(tuple(self.ids), tuple("h" for _ in self.ids), frozenset(self.done))

    def start_more(self) -> list[str]:
        if not self.slots:
            return []
        self.slots -= 1
        wid = f"new{self.started}"
        self.started += 1
        self.ids.append(wid)
        return [wid]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _driver(launcher: _Launcher, store: _Store, clock: _Clock | None = None, **rules):
    clock = clock or _Clock()
    driver = ElasticDriver(
        store,
        launcher.alive,
        ElasticPolicy(**rules),
        start_more=launcher.start_more,
        clock=clock,
        sleep=clock.sleep,
    )
    driver.start(list(launcher.ids))
    return driver


def test_it_grows_to_max_workers_one_generation_per_started_worker_when_slots_appear():
    store, launcher = _Store(), _Launcher(["a", "b"])
    driver = _driver(launcher, store, max_workers=4)
    assert driver.poll() is False and driver.generation == 0  # no slot yet
    launcher.slots = 5
    assert driver.poll() is True
    assert driver.members == ["a", "b", "new0", "new1"] and driver.generation == 2
    assert store.world(2)["workers"] == ["a", "b", "new0", "new1"]
    assert launcher.slots == 3  # never asked beyond max_workers
    assert driver.poll() is False


def test_it_adds_no_worker_once_a_member_has_finished():
    store, launcher = _Store(), _Launcher(["a", "b"], slots=1)
    launcher.done.add("a")
    driver = _driver(launcher, store, max_workers=3)
    assert driver.poll() is False and launcher.slots == 1


def test_a_lost_member_re_forms_the_ring_on_the_survivors_after_the_grace_period():
    store, clock, launcher = _Store(), _Clock(), _Launcher(["a", "b", "c"])
    driver = _driver(launcher, store, clock, grace_s=0.5)
    launcher.ids.remove("b")
    assert driver.poll() is True
    assert clock.now == 0.5
    assert store.world(1) == {"workers": ["a", "c"], "hosts": ["h", "h"]}


def test_a_ranks_request_re_forms_the_ring_with_the_same_workers_after_a_recheck():
    store, launcher = _Store(), _Launcher(["a", "b"])
    rechecked = []
    driver = ElasticDriver(store, launcher.alive, recheck=lambda: rechecked.append(1), grace_s=0)
    driver.start(["a", "b"])
    assert driver.poll() is False and rechecked == []
    store.add("elastic/reset/0", 1)
    assert driver.poll() is True and rechecked == [1]
    assert store.world(1)["workers"] == ["a", "b"]


def test_below_min_without_a_wait_publishes_an_abort_at_once():
    store, launcher = _Store(), _Launcher(["a", "b"])
    driver = _driver(launcher, store, min_workers=2, grace_s=0)
    launcher.ids.remove("a")
    assert driver.poll() is True
    assert store.world(1) == {"abort": "only 1 workers left, fewer than min_np=2"}
    assert driver.stopped is None  # the workers stop; the launcher's loop goes on


def test_below_min_it_waits_then_gives_up_after_the_wait():
    store, clock, launcher = _Store(), _Clock(), _Launcher(["a", "b"])
    driver = _driver(
        launcher, store, clock, min_workers=2, below_min_wait_s=10.0, min_name="min_num_proc"
    )
    launcher.ids.remove("a")
    assert driver.poll() is False and driver.generation == 0  # waits: publishes nothing
    clock.now = 10.0
    assert driver.poll() is False and driver.stopped is None
    clock.now = 10.5
    driver.poll()
    assert driver.stopped == (
        "only 1 workers left, fewer than min_num_proc=2, for longer than elastic_timeout=10 s"
    )
    assert store.world(1) == {"abort": driver.stopped}


def test_below_min_a_worker_that_comes_back_in_time_re_forms_the_ring():
    store, clock, launcher = _Store(), _Clock(), _Launcher(["a", "b"])
    driver = _driver(launcher, store, clock, min_workers=2, below_min_wait_s=10.0, grace_s=0)
    launcher.ids.remove("a")
    driver.poll()
    clock.now = 5.0
    launcher.ids.append("c")
    assert driver.poll() is True and driver.stopped is None
    assert store.world(1)["workers"] == ["b", "c"]


def test_it_stops_at_the_reset_limit_and_publishes_nothing_after():
    store, launcher = _Store(), _Launcher(["a", "b", "c"])
    driver = _driver(launcher, store, reset_limit=1, grace_s=0)
    launcher.ids.remove("c")
    assert driver.poll() is True and store.world(1)["workers"] == ["a", "b"]
    launcher.ids.remove("b")
    driver.poll()
    assert (
        driver.stopped is not None
        and "re-formed 2 times, more than reset_limit=1" in (store.world(2)["abort"])
    )
    launcher.ids.remove("a")
    assert driver.poll() is False and driver.generation == 2


def test_a_first_ring_published_by_the_launcher_is_not_a_re_formation():
    store, launcher = _Store(), _Launcher(["a", "b"])
    driver = ElasticDriver(store, launcher.alive, reset_limit=0)
    driver.start([])
    driver.publish(["a", "b"], ["h", "h"])  # the first ring (Spark forms it this way)
    assert store.world(1)["workers"] == ["a", "b"] and driver.stopped is None
    driver.publish(["a"], ["h"])
    assert "more than reset_limit=0" in store.world(2)["abort"]


def test_a_published_ring_numbers_ranks_host_by_host_and_keeps_the_first_member_at_rank_0():
    store, launcher = _Store(), _Launcher(["a", "b", "c", "d", "e"])
    driver = ElasticDriver(store, launcher.alive)
    driver.start([])
    driver.publish(["a", "b", "c", "d", "e"], ["h2", "h1", "h2", "h1", "h3"])  # interleaved
    world = store.world(1)
    assert world["workers"] == ["a", "c", "b", "d", "e"]
    assert world["hosts"] == ["h2", "h2", "h1", "h1", "h3"]
    assert driver.members == ["a", "c", "b", "d", "e"]
    assert driver.poll() is False  # the same workers in another order are no change


def test_newcomers_are_admitted_up_to_max_workers_and_not_while_finishing():
    policy = ElasticPolicy(min_workers=1, max_workers=3)
    live = Workers(("a", "b", "x", "y"), ("h1", "h2", "h3", "h4"))
    assert policy.admit(live, ["a", "b"]).ids == ("a", "b", "x")
    finishing = Workers(live.ids, live.hosts, frozenset({"a"}))
    assert policy.admit(finishing, ["a", "b"]).hosts == ("h1", "h2")


def test_alive_may_answer_a_plain_pair_of_ids_and_hosts():
    assert Workers.of((["a"], ["h"])) == Workers(("a",), ("h",))
    with pytest.raises(ValueError, match="2 ids but 1 hosts"):
        Workers.of((["a", "b"], ["h"]))


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"min_workers": 0}, r"min_workers must be an integer >= 1, got 0"),
        ({"min_workers": 3, "max_workers": 2}, r"max_workers must be None .* >= min_workers=3"),
        ({"reset_limit": -1}, r"reset_limit must be None or an integer >= 0, got -1"),
        ({"grace_s": -1.0}, r"grace_s must be >= 0"),
        ({"below_min_wait_s": 0}, r"below_min_wait_s must be None or > 0"),
    ],
)
def test_the_policy_checks_its_limits_on_construction(rules, message):
    with pytest.raises(ValueError, match=message):
        ElasticPolicy(**rules)


def test_the_driver_takes_a_policy_or_its_fields_not_both():
    with pytest.raises(TypeError, match="not both"):
        ElasticDriver(_Store(), lambda: ([], []), ElasticPolicy(), min_workers=2)
