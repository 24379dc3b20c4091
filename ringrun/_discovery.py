"""The hosts of an elastic job: what ``--host-discovery-script`` prints, or a fixed list.

As horovodrun's: the script prints the hosts available now, one a line, ``host:slots``
or ``host`` (then ``--slots-per-host`` slots); blank lines are skipped and a host
printed twice counts once (its last line). ringrun runs it at the start and then every
:data:`DISCOVER_EVERY_S` seconds; the first run must succeed, a later failure keeps the
hosts of the last good run (and says so once on stderr). Without a script (``-H``,
``--hostfile``, or none: this host) the hosts never change.
"""

from __future__ import annotations

import subprocess

from ringcore import RingError

__all__ = ["DISCOVER_EVERY_S", "Discovery", "DiscoveryError", "parse_hosts"]

#: how often the discovery script runs while the job does (horovodrun: every second)
DISCOVER_EVERY_S = 1.0
#: how long one run of the script may take
SCRIPT_TIMEOUT_S = 30.0


class DiscoveryError(RingError):
    """The discovery script failed, or printed a line that is not ``host[:slots]``."""


def parse_hosts(text: str, default_slots: int | None, script: str) -> list[tuple[str, int]]:
    """The script's output as ``[(host, slots)]`` in the order printed."""
    hosts: dict[str, int] = {}
    for line in (raw.strip() for raw in text.splitlines()):
        if not line:
            continue
        host, sep, raw = line.partition(":")
        if not sep:
            if default_slots is None:
                raise DiscoveryError(
                    f"the discovery script {script} printed {line!r} without slots; print "
                    "host:slots lines, or pass --slots-per-host N"
                )
            slots = default_slots
        else:
            try:
                slots = int(raw)
            except ValueError:
                slots = 0
        if not host or any(c.isspace() for c in host) or slots < 1:
            raise DiscoveryError(
                f"the discovery script {script} printed {line!r}; each line is host:slots "
                "with slots >= 1 (e.g. node1:4), or host with --slots-per-host"
            )
        hosts.pop(host, None)
        hosts[host] = slots
    return list(hosts.items())


class Discovery:
    """Where workers may run now: ``find()`` runs the script (or returns the fixed hosts)."""

    def __init__(
        self,
        argv: tuple[str, ...] = (),
        default_slots: int | None = None,
        fixed: tuple[tuple[str, int], ...] = (),
    ):
        self.argv, self.default_slots, self.fixed = argv, default_slots, list(fixed)
        self.script = " ".join(argv)

    @property
    def changes(self) -> bool:
        """True when the hosts may change (a script says them)."""
        return bool(self.argv)

    def find(self) -> list[tuple[str, int]]:
        """The hosts and their slots now, or :class:`DiscoveryError`."""
        if not self.argv:
            return list(self.fixed)
        try:
            done = subprocess.run(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=SCRIPT_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DiscoveryError(
                f"the discovery script {self.script} could not run: {exc}"
            ) from None
        if done.returncode != 0:
            raise DiscoveryError(
                f"the discovery script {self.script} exited with code {done.returncode}: "
                f"{done.stderr.strip()[-500:]}"
            )
        return parse_hosts(done.stdout, self.default_slots, self.script)
