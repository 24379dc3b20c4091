"""The programs of tests/_torch_programs.py as a plain script, for the launchers' file
forms (and torchrun itself):

    python tests/_torch_programs_main.py OUT_DIR [names...] [--rank-1-exits=N]

runs the named programs (default: all) and writes their results to
``OUT_DIR/rank<RANK>.json`` (written to a temporary file, then renamed into place);
with ``--rank-1-exits=N`` rank 1 then exits with status N (a launcher's exit status).
"""

from __future__ import annotations

import json
import os
import sys

from _torch_programs import PROGRAMS, run_all


def main(argv: list[str]) -> int:
    if not argv:
        print(f"usage: {sys.argv[0]} OUT_DIR [{' '.join(PROGRAMS)}]", file=sys.stderr)
        return 2
    exits = [a for a in argv if a.startswith("--rank-1-exits=")]
    argv = [a for a in argv if a not in exits]
    out_dir, names = argv[0], argv[1:] or None
    results = run_all(names)
    rank = os.environ.get("RANK", "0")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(f"{path}.tmp", path)
    print(f"rank {rank} ran {', '.join(results)}", flush=True)
    return int(exits[0].split("=", 1)[1]) if exits and rank == "1" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
