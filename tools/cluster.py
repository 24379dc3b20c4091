"""Make (or remove) hosts out of network namespaces, to try ringtrain across hosts by hand.

    python tools/cluster.py up [--hosts 2] [--subnet 0]   # make cluster-up
    python tools/cluster.py status
    python tools/cluster.py down                          # make cluster-down

``up`` makes a bridge ``rtb0`` with 198.18.<subnet>.1 and one namespace per host
(``rt0h0``, ``rt0h1``, ...; eth0 = 198.18.<subnet>.11, .12, ...), whose hostname resolves
to 127.0.0.1 as on many real clusters (see ``tests/_netns.py``, which the tests use
too). What was made is written to ``build/cluster.json``; ``down`` removes exactly that.
Needs root and ``ip netns``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the project's root before tests/: tests/ringcore, tests/spark_runner, ... would else be
# found as namespace packages ahead of the real ones
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from _netns import Cluster, unavailable  # noqa: E402

STATE = os.path.join(ROOT, "build", "cluster.json")
TAG = "0"


def up(hosts: int, subnet: int) -> int:
    if os.path.exists(STATE):
        print(f"a cluster is already up ({STATE}); run `make cluster-down` first", file=sys.stderr)
        return 1
    why = unavailable()
    if why:
        print(f"cannot make hosts here: {why}", file=sys.stderr)
        return 1
    cluster = Cluster(hosts, tag=TAG, subnet=subnet).up()
    os.makedirs(os.path.dirname(STATE), exist_ok=True)
    state = {
        "hosts": hosts,
        "bridge": cluster.bridge,
        "bridge_addr": cluster.bridge_addr,
        "namespaces": [{"ns": h.ns, "addr": h.addr, "hostname": h.hostname} for h in cluster.hosts],
    }
    with open(STATE, "w") as f:
        json.dump(state, f, indent=2)
    _show(state)
    first = cluster.hosts[0]
    print("\nrun a command on a host (its own hostname, resolving to 127.0.0.1):")
    print("  " + shlex.join(first.wrap(["hostname"])))
    print("a Spark master on the bridge and a worker on each host:")
    home = "$(.venv/bin/python -c 'import pyspark, os; print(os.path.dirname(pyspark.__file__))')"
    print(
        f"  SPARK_LOCAL_IP={cluster.bridge_addr} {home}/bin/spark-class "
        f"org.apache.spark.deploy.master.Master --host {cluster.bridge_addr} --port 7077"
    )
    for h in cluster.hosts:
        print(
            f"  ip netns exec {h.ns} env SPARK_LOCAL_IP={h.addr} {home}/bin/spark-class "
            f"org.apache.spark.deploy.worker.Worker --host {h.addr} --cores 2 "
            f"spark://{cluster.bridge_addr}:7077"
        )
    return 0


def _show(state: dict) -> None:
    print(f"bridge {state['bridge']} {state['bridge_addr']}/24")
    for h in state["namespaces"]:
        print(f"host {h['ns']}: eth0 {h['addr']}, hostname {h['hostname']} -> 127.0.0.1")


def down() -> int:
    if not os.path.exists(STATE):
        print("no cluster is up (no build/cluster.json)")
        return 0
    with open(STATE) as f:
        state = json.load(f)
    Cluster(int(state["hosts"]), tag=TAG).down()
    os.remove(STATE)
    print(f"removed {state['bridge']} and {len(state['namespaces'])} hosts")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    make = sub.add_parser("up", help="make the bridge and the hosts")
    make.add_argument("--hosts", type=int, default=2)
    make.add_argument("--subnet", type=int, default=0, help="the third octet of 198.18.n.0/24")
    sub.add_parser("down", help="remove what `up` made")
    sub.add_parser("status", help="show what `up` made")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        if not 0 <= args.subnet <= 255 or not 1 <= args.hosts <= 200:
            parser.error("--subnet must be in 0..255 and --hosts in 1..200")
        return up(args.hosts, args.subnet)
    if args.cmd == "down":
        return down()
    if os.path.exists(STATE):
        with open(STATE) as f:
            _show(json.load(f))
    else:
        print("no cluster is up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
