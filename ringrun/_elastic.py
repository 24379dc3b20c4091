"""``ringrun --min-np N [--max-np M] [--host-discovery-script S] command``: an elastic job.

As horovodrun's elastic mode. ringrun hosts the job's store and runs the launcher kit's
elastic loop (``ringcore.launch.ElasticJob`` over an ``ElasticDriver`` and one
``ElasticPolicy``), which publishes the generations of the ring; the training script's
``ringcore.torch.elastic.run`` (``hvd.elastic.run``) re-forms the ring from them. This
module is what only the launcher knows: where workers may run (:mod:`ringrun._discovery`:
the script, run every second, or ``-H`` / this host), starting them (here, or through
ssh: :func:`ringrun._hosts_run.start_rank`) and watching their processes.

- Start: once the hosts have ``-np`` slots (``-np`` defaults to ``--min-np``), a worker
  in every slot, host by host, up to ``--max-np``: the first ring, ranks in that order.
- A host that appears (or a host's slots that grow): the driver asks for more workers,
  ringrun starts one in each free slot (up to ``--max-np``) with ``late_worker_env``,
  and the running ranks take them in at their next ``state.commit()``.
- A host that disappears (or loses slots): its workers are ended (SIGTERM, SIGKILL after
  the grace) and the ring re-forms without them.
- A worker that exits non-zero is dropped, and its slot is not used again while its
  host stays listed (horovodrun blacklists the host); the others restore their last
  commit and re-form. Once a member of the ring has exited 0 (the run is ending), a
  member that fails instead is the job's failure.
- Below ``--min-np`` workers for longer than ``--elastic-timeout`` (600 s), or past
  ``--reset-limit`` re-formations, the job stops: every worker is told, ringrun says
  why and exits 1. Every worker failed and no slot left to start one: ringrun exits
  with the last failure's status.

Exit status: 0 when every member of the final ring exits 0, else the failing member's
own status. Output lines are prefixed ``[id]<stdout>:`` by worker id (the first ring's
ids are its ranks; added workers count on).
"""

from __future__ import annotations

import signal
import sys
import time
import uuid
from collections import Counter

from ringcore import RingError, topology_from_hosts
from ringcore.launch import (
    DEFAULT_ELASTIC_TIMEOUT_S,
    ELASTIC_ENV_VAR,
    TERM_GRACE_S,
    WORKER_ID_ENV_VAR,
    ElasticJob,
    ElasticPolicy,
    Workers,
    free_port,
    hosted_store,
    late_worker_env,
    new_secret,
    torchrun_env,
    worker_env,
)

from ._args import Options, rank_hosts
from ._discovery import DISCOVER_EVERY_S, Discovery, DiscoveryError
from ._hosts_run import base_env, check_command, guarded, say, start_rank
from ._ranks import Job
from ._remote import exit_status
from ._ssh import interface_address, is_local, remote_free_port, route_address

__all__ = ["run_elastic"]

_LOOPBACK = "127.0.0.1"
RUNNING, DONE, FAILED, ENDING, ENDED = "running", "done", "failed", "ending", "ended"


def _tell(text: str) -> None:
    print(f"ringrun: {text}", file=sys.stderr, flush=True)


def _how(code: int) -> str:
    return f"was ended by signal {-code}" if code < 0 else f"exited with code {code}"


def _listed(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{n}" for h, n in hosts) or "none"


class _Worker:
    def __init__(self, wid: int, host: str, rank):
        self.id, self.host, self.rank = wid, host, rank
        self.state = RUNNING
        self.deadline = 0.0  # ENDING: when SIGKILL follows the SIGTERM


class ElasticRun:
    """The workers of one elastic ringrun job (see the module docstring)."""

    def __init__(self, opts: Options, discovery: Discovery, hosts: list[tuple[str, int]]):
        self.opts, self.discovery, self.hosts = opts, discovery, hosts
        self.job = Job()
        self.workers: dict[int, _Worker] = {}
        self.spent: Counter[str] = Counter()  # slots of a host whose worker failed
        self.failure: tuple[_Worker, int] | None = None  # the job's failing worker
        self.last_loss: tuple[_Worker, int] | None = None
        self.local: dict[str, bool] = {}
        self.addrs: dict[str, str] = {}
        self.secret, self.run_id = new_secret(), uuid.uuid4().hex
        self.port = 0
        self.elastic: ElasticJob | None = None
        self.next_discovery = time.monotonic() + DISCOVER_EVERY_S
        self.discovery_error = ""

    # -- the job ----------------------------------------------------------------------

    def run(self, port: int) -> int:
        self.port = port
        self._wait_for_slots()
        total = sum(n for _, n in self.hosts)
        placed = rank_hosts(tuple(self.hosts), min(total, self.opts.max_np or total))
        master = self._master(placed[0])
        for r in range(len(placed)):
            self._start(placed[r], self._first_env(placed, r, master))
        policy = ElasticPolicy(
            min_workers=self.opts.min_np,
            max_workers=self.opts.max_np,
            reset_limit=self.opts.reset_limit,
            below_min_wait_s=self.opts.elastic_timeout or DEFAULT_ELASTIC_TIMEOUT_S,
            min_name="--min-np",
        )
        job = ElasticJob(hosted_store(port), self.alive, policy, wait=self.wait,
                         finished=self.finished, start_more=self.start_more,
                         name="the elastic job", on_generation=self._generation)  # fmt: skip
        with job:
            self.elastic = job
            job.start([str(w) for w in self.workers])
            try:
                job.watch()
            except RingError as exc:
                _tell(f"{exc}. Add hosts (the discovery script's) or lower --min-np")
                self.job.end(signal.SIGTERM)
                return 1
        self.job.end(signal.SIGTERM)  # a worker started but never in the ring
        if self.failure is None:
            return 0
        worker, code = self.failure
        _tell(f"worker {worker.id} on {worker.host} {_how(code)}: the job failed")
        return exit_status(code)

    def _generation(self, generation: int, count: int) -> None:
        say(self.opts, f"generation {generation} of the ring: {count} workers")

    def _wait_for_slots(self) -> None:
        """Until the hosts have ``-np`` slots (``--elastic-timeout``, as horovodrun)."""
        timeout = self.opts.elastic_timeout or DEFAULT_ELASTIC_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while sum(n for _, n in self.hosts) < self.opts.np:
            if time.monotonic() > deadline:
                raise RingError(
                    f"the hosts ({_listed(self.hosts)}) had fewer than -np {self.opts.np} "
                    f"slots for {timeout:g} s (--elastic-timeout); add hosts or lower -np"
                )
            time.sleep(DISCOVER_EVERY_S)
            self._rediscover()

    # -- what the elastic loop asks of the launcher -----------------------------------

    def _members(self) -> list[str]:
        return list(self.elastic.driver.members) if self.elastic is not None else []

    def alive(self) -> Workers:
        """Running or done workers: the ring's members in rank order, then the others."""
        members = [int(m) for m in self._members()]
        order = members + sorted(set(self.workers) - set(members))
        keep = [self.workers[i] for i in order if self.workers[i].state in (RUNNING, DONE)]
        return Workers(
            tuple(str(w.id) for w in keep),
            tuple(w.host for w in keep),
            frozenset(str(w.id) for w in keep if w.state == DONE),
        )

    def wait(self, timeout_s: float) -> None:
        """Take in the workers that exited, end the overdue, run the discovery script."""
        for wid, code in self.job.exited(timeout_s):
            self._exited(self.workers[wid], code)
        now = time.monotonic()
        for w in self.workers.values():
            if w.state == ENDING and now > w.deadline:
                w.rank.kill()
        if self.discovery.changes and now >= self.next_discovery:
            self.next_discovery = now + DISCOVER_EVERY_S
            self._rediscover()
        if len(self.alive().ids) < self.opts.min_np:
            self.start_more()  # the driver asks for more only from a ring of --min-np

    def finished(self) -> bool:
        members = [self.workers[int(m)] for m in self._members()]
        if any(w.state == DONE for w in members):
            return not any(w.state == RUNNING for w in members)
        alive = any(w.state in (RUNNING, DONE) for w in self.workers.values())
        if self.last_loss is not None and not alive and not self._free():
            _tell("every worker failed and no slot is left to start another")
            self.failure = self.failure or self.last_loss
            return True
        return False

    def start_more(self) -> list[str]:
        """A late worker in each free slot, host by host, up to ``--max-np``; their ids."""
        live = len(self.alive().ids)
        room = self.opts.max_np - live if self.opts.max_np else sum(n for _, n in self.hosts)
        if self.elastic is not None and self.elastic.driver.stopped:
            return []
        new: list[str] = []
        for host, free in self._free():
            for _ in range(min(free, room - len(new))):
                wid = len(self.job.ranks)
                try:
                    self._start(host, self._late_env(host, wid))
                except (OSError, RingError) as exc:
                    _tell(f"could not start a worker on {host}: {exc}")
                    self.spent[host] += 1
                    break
                _tell(f"worker {wid} on {host} starts and joins the ring")
                new.append(str(wid))
        return new

    # -- workers ----------------------------------------------------------------------

    def _exited(self, w: _Worker, code: int) -> None:
        if w.state == ENDING:
            w.state = ENDED
            return
        if code == 0:
            w.state = DONE
            return
        w.state = FAILED
        self.spent[w.host] += 1
        self.last_loss = (w, code)
        members = [self.workers[int(m)] for m in self._members()]
        if any(m.state == DONE for m in members):  # the run is ending: no re-forming
            self.failure = self.failure or (w, code)
            _tell(f"worker {w.id} on {w.host} {_how(code)} as the job was ending")
        else:
            _tell(f"worker {w.id} on {w.host} {_how(code)}; the ring re-forms without it")

    def _end(self, w: _Worker, why: str) -> None:
        _tell(f"ending worker {w.id} on {w.host}: {why}")
        w.state, w.deadline = ENDING, time.monotonic() + TERM_GRACE_S
        w.rank.signal(signal.SIGTERM)

    def _free(self) -> list[tuple[str, int]]:
        """``(host, free slots)`` of every host with a slot no worker holds or spent."""
        used = Counter(w.host for w in self.workers.values() if w.state in (RUNNING, DONE, ENDING))
        free = [(h, n - used[h] - self.spent[h]) for h, n in self.hosts]
        return [(h, n) for h, n in free if n > 0]

    def _rediscover(self) -> None:
        """Run the discovery script; end the workers of hosts (or slots) gone."""
        try:
            hosts = self.discovery.find()
        except DiscoveryError as exc:
            if str(exc) != self.discovery_error:
                _tell(f"{exc}; keeping the hosts {_listed(self.hosts)}")
            self.discovery_error = str(exc)
            return
        self.discovery_error = ""
        if hosts == self.hosts:
            return
        _tell(f"the hosts are now {_listed(hosts)} (were {_listed(self.hosts)})")
        slots = dict(hosts)
        for gone in {h for h, _ in self.hosts} - set(slots):
            self.spent.pop(gone, None)  # a host that comes back starts afresh
        self.hosts = hosts
        running: dict[str, list[_Worker]] = {}
        for w in sorted(self.workers.values(), key=lambda w: w.id):
            if w.state == RUNNING:
                running.setdefault(w.host, []).append(w)
        for host, ws in running.items():
            for w in ws[slots.get(host, 0) :]:
                self._end(w, "the discovery script no longer lists its slot")

    # -- starting one -----------------------------------------------------------------

    def _is_local(self, host: str) -> bool:
        if host not in self.local:
            self.local[host] = is_local(host)
        return self.local[host]

    def _store_addr(self, host: str) -> str:
        """The address a worker on ``host`` reaches the store on."""
        if host not in self.addrs:
            own = [a for a in map(interface_address, self.opts.nics) if a]
            if own:
                self.addrs[host] = own[0]
            else:
                self.addrs[host] = _LOOPBACK if self._is_local(host) else route_address(host)
        return self.addrs[host]

    def _master(self, host: str) -> tuple[str, int]:
        """The first ring's ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 on ``host``)."""
        if self._is_local(host):
            return self._store_addr(host), free_port()
        opts = self.opts
        timeout = opts.start_timeout or 60.0
        return host, remote_free_port(host, opts.ssh_port, opts.ssh_identity_file, timeout)

    def _first_env(self, placed: list[str], r: int, master: tuple[str, int]) -> dict[str, str]:
        topology = topology_from_hosts(placed, r)
        env = base_env(self.opts)
        env.update(worker_env(topology, self._store_addr(placed[r]), self.port,
                              external_store=True, secret=self.secret))  # fmt: skip
        env.update(torchrun_env(topology, master[0], master[1], self.run_id))
        env.update({ELASTIC_ENV_VAR: "1", WORKER_ID_ENV_VAR: str(len(self.job.ranks))})
        return env

    def _late_env(self, host: str, wid: int) -> dict[str, str]:
        env = base_env(self.opts)
        env.update(late_worker_env(self._store_addr(host), self.port, str(wid),
                                   secret=self.secret, host=host))  # fmt: skip
        env["TORCHELASTIC_RUN_ID"] = self.run_id
        return env

    def _start(self, host: str, env: dict[str, str]) -> None:
        wid = len(self.job.ranks)
        rank = start_rank(self.opts, wid, host, self._is_local(host), env)
        self.job.add(rank)
        self.workers[wid] = _Worker(wid, host, rank)


def run_elastic(opts: Options) -> int:
    """Run the elastic job; ringrun's exit status."""
    fixed = opts.hosts or ((_LOOPBACK, opts.max_np or opts.np),)
    discovery = Discovery(opts.discovery, opts.slots_per_host, fixed)
    hosts = discovery.find()  # a script that fails now fails the job before it starts
    if any(is_local(h) for h, _ in hosts) or not hosts:
        check_command(opts.command)
    run = ElasticRun(opts, discovery, hosts)
    return guarded(opts, run.job, run.run)
