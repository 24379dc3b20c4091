"""``python -m ringcore.launch.script PATH ARGS...``: run the Python file ``PATH`` as
``python PATH ARGS...`` would (``sys.argv``, its folder first on ``sys.path``,
``__name__ == "__main__"``), with the launcher's guard on
``torch.distributed.init_process_group`` installed first (``torch_guard``). The
launchers run a user's script through it (``script_command``)."""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m ringcore.launch.script PATH [ARGS...]")
    from . import install_init_guard

    install_init_guard()
    path = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
