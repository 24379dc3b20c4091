"""Where every rank sits: one frozen value computed from the list of every rank's host."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology", "host_major_order", "topology_from_hosts"]


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local_rank must be in [0, {self.local_size}), got {self.local_rank}")
        if not 0 <= self.cross_rank < self.cross_size:
            raise ValueError(f"cross_rank must be in [0, {self.cross_size}), got {self.cross_rank}")
        if self.hosts and len(self.hosts) != self.size:
            raise ValueError(f"hosts lists {len(self.hosts)} ranks but size is {self.size}")

    @property
    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of ranks."""
        if not self.hosts:
            return self.size % self.local_size == 0
        counts = {h: self.hosts.count(h) for h in self.hosts}
        return len(set(counts.values())) == 1


def topology_from_hosts(hosts: list[str] | tuple[str, ...], rank: int) -> Topology:
    """Derive local and cross ranks from the host of every rank (index = rank).

    Ranks on one host get local ranks 0..k-1 in rank order. ``cross_rank`` is the index
    of this rank's host among the hosts that have a rank with this local rank (Horovod's
    definition), ordered by first appearance.
    """
    hosts = tuple(hosts)
    if not hosts:
        raise ValueError("hosts is empty; pass the host of every rank")
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside the {len(hosts)} hosts given")
    me = hosts[rank]
    same_host = [r for r, h in enumerate(hosts) if h == me]
    local_rank = same_host.index(rank)
    local_size = len(same_host)
    # Hosts ordered by first appearance; cross group = hosts having this local rank.
    order: list[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    per_host = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    cross_hosts = [h for h in order if len(per_host[h]) > local_rank]
    return Topology(
        rank=rank,
        size=len(hosts),
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_hosts.index(me),
        cross_size=len(cross_hosts),
        hosts=hosts,
    )


def host_major_order(hosts: list[str] | tuple[str, ...]) -> list[int]:
    """The slots (indexes into ``hosts``) in rank order: the slots of one host
    consecutive, hosts in order of first appearance, slots of a host in index order.

    A launcher whose slots come interleaved across hosts (a Spark barrier stage, Ray
    actors) gives rank ``r`` to slot ``host_major_order(hosts)[r]``; then
    ``topology_from_hosts`` yields Horovod's local and cross ranks.
    """
    first = {h: i for i, h in reversed(list(enumerate(hosts)))}
    return sorted(range(len(hosts)), key=lambda i: (first[hosts[i]], i))
