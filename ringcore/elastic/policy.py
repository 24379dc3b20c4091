"""The rules of an elastic job, in one place: when the ring re-forms, grows, or stops.

Every elastic launcher (``ringcore.testing.run_workers(elastic=True)``,
``spark_runner.run_elastic``, ray_runner's elastic group and ``ElasticRayExecutor``)
runs the same policy; what differs is only how it starts processes and how it sees
them. A launcher supplies two things to the :class:`~ringcore.elastic.driver.ElasticDriver`
that applies the policy:

- *who is alive*: a callable returning ``(ids, hosts)`` — the workers still in the job
  (running, or done with a result: done is not lost), members first in rank order,
  then workers that started since and may join — or a :class:`Workers`, which also
  says which of them finished their function;
- *start one more* (optional): a callable that starts the workers a free slot allows
  now and returns their ids (``alive()`` lists them from then on), or ``[]``.

:class:`ElasticPolicy` holds the limits and answers each question with a pure
function, so that a test can check every rule without a store, a clock or a process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from .limits import ElasticNames, check_elastic_limits

__all__ = ["AliveFn", "ElasticPolicy", "StartMoreFn", "Workers"]


@dataclass(frozen=True)
class Workers:
    """A launcher's answer to "who is alive": ids in rank order, their hosts, who is done."""

    ids: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    done: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.hosts):
            raise ValueError(
                f"Workers lists {len(self.ids)} ids but {len(self.hosts)} hosts; "
                "alive() must return one host per worker id"
            )

    @classmethod
    def of(cls, answer: Workers | tuple[Sequence[str], Sequence[str]]) -> Workers:
        """Normalise what ``alive()`` returned: a :class:`Workers` or an ``(ids, hosts)`` pair."""
        if isinstance(answer, Workers):
            return answer
        ids, hosts = answer
        return cls(tuple(ids), tuple(hosts))

    def only(self, keep: Callable[[str], bool]) -> Workers:
        """These workers, less those for which ``keep(id)`` is false."""
        pairs = [(i, h) for i, h in zip(self.ids, self.hosts) if keep(i)]
        return Workers(tuple(i for i, _ in pairs), tuple(h for _, h in pairs), self.done)

    def first(self, count: int) -> Workers:
        return Workers(self.ids[:count], self.hosts[:count], self.done)


AliveFn = Callable[[], Workers | tuple[Sequence[str], Sequence[str]]]
StartMoreFn = Callable[[], list[str]]


_POLICY_NAMES = ElasticNames(owner="ElasticPolicy.")


@dataclass(frozen=True)
class ElasticPolicy:
    """The limits of one elastic job and the decisions they imply.

    - ``min_workers``: a ring of fewer workers is not formed. With
      ``below_min_wait_s=None`` such a generation is published as an abort at once (its
      workers stop with the reason); with a number of seconds the driver publishes
      nothing while below ``min_workers``, waits that long for workers to come back, then
      gives up.
    - ``max_workers``: at most that many workers in a ring (None: no bound); the driver
      asks the launcher to start more only while the ring is smaller.
    - ``reset_limit``: how many times the ring may be re-formed after the first one
      (every generation after the first counts: a loss, a rank's request, a growth);
      the generation that would exceed it stops the job instead (None: no limit).
    - ``grace_s``: after a change is seen, how long to wait before re-forming, so that
      every change of one event (three ranks of a lost node) goes into one generation.
    - ``min_name``: the name the launcher's user knows ``min_workers`` by, for messages.

    No worker is added once a member of the ring has finished its function: the run is
    ending, and an added worker would wait for a ring that never forms.
    """

    min_workers: int = 1
    max_workers: int | None = None
    reset_limit: int | None = None
    grace_s: float = 0.5
    below_min_wait_s: float | None = None
    min_name: str = "min_np"

    def __post_init__(self) -> None:
        check_elastic_limits(
            self.min_workers, self.max_workers, self.reset_limit, names=_POLICY_NAMES
        )
        if self.grace_s < 0:
            raise ValueError(f"ElasticPolicy.grace_s must be >= 0 seconds, got {self.grace_s!r}")
        if self.below_min_wait_s is not None and self.below_min_wait_s <= 0:
            raise ValueError(
                f"ElasticPolicy.below_min_wait_s must be None or > 0 seconds, "
                f"got {self.below_min_wait_s!r}"
            )

    # -- who is in the job ------------------------------------------------------------

    @staticmethod
    def finishing(workers: Workers, members: Collection[str]) -> bool:
        """True once a member of the ring has finished its function (the run is ending)."""
        return any(m in workers.done for m in members)

    def admit(self, workers: Workers, members: Collection[str]) -> Workers:
        """The workers a new generation may hold: no newcomer while the run is ending,
        and no more than ``max_workers`` (the first ones in the launcher's order)."""
        if self.finishing(workers, members):
            workers = workers.only(lambda i: i in members)
        if self.max_workers is not None:
            workers = workers.first(self.max_workers)
        return workers

    @staticmethod
    def changed(workers: Workers, members: Collection[str], asked: bool) -> bool:
        """Re-form the ring: a member was lost, a worker can join, or the ranks asked."""
        return asked or set(workers.ids) != set(members)

    def may_grow(self, workers: Workers, members: Collection[str]) -> bool:
        """Ask the launcher for more workers: below ``max_workers`` and not finishing."""
        if self.finishing(workers, members):
            return False
        return self.max_workers is None or len(members) < self.max_workers

    # -- when to publish, when to give up ---------------------------------------------

    @property
    def waits_below_min(self) -> bool:
        """True when, below ``min_workers``, the driver waits instead of aborting at once."""
        return self.below_min_wait_s is not None

    def may_publish(self, count: int) -> bool:
        """Whether a re-formed ring of ``count`` workers is published now (waiting below
        ``min_workers`` publishes nothing; otherwise a short ring is published as an abort)."""
        return not self.waits_below_min or count >= self.min_workers

    def short_ring(self, count: int) -> str | None:
        """The reason a ring of ``count`` workers must not form, or None."""
        if count < self.min_workers:
            return f"only {count} workers left, fewer than {self.min_name}={self.min_workers}"
        return None

    def give_up_below_min(self, count: int, below_for_s: float) -> str | None:
        """The reason to stop the job after ``below_for_s`` seconds with only ``count``
        workers, or None while it may still wait for workers to come back."""
        if self.below_min_wait_s is None or below_for_s <= self.below_min_wait_s:
            return None
        return (
            f"{self.short_ring(count)}, for longer than "
            f"elastic_timeout={self.below_min_wait_s:.0f} s"
        )

    def over_reset_limit(self, resets: int) -> str | None:
        """The reason to stop instead of re-forming the ring for the ``resets``-th time."""
        if self.reset_limit is None or resets <= self.reset_limit:
            return None
        return (
            f"the ring would be re-formed {resets} times, more than "
            f"reset_limit={self.reset_limit}; raise reset_limit (None: no limit)"
        )
