"""``python -m spark_runner._local_rank PAYLOAD RESULT``: one rank of a function that
``TorchDistributor(local_mode=True)`` runs (``spark_runner._local``).

Loads ``(fn, args, kwargs)`` from the file ``PAYLOAD``, installs the guard on
``init_process_group`` (one process group per job), calls ``fn`` and writes
``("ok", result)`` or ``("error", WorkerError)`` to the file ``RESULT`` (through a
temporary name, then renamed: the driver never reads half a file); exits 1 on an error
(its ``exit_code`` when it ended by one).
"""

from __future__ import annotations

import os
import sys

import cloudpickle


def main(payload_path: str, result_path: str) -> int:
    import ringcore
    from ringcore import WorkerError
    from ringcore.launch import install_init_guard

    rank = int(os.environ.get("RANK", "0"))
    try:
        install_init_guard()
        with open(payload_path, "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        outcome: tuple[str, object] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:
        outcome = ("error", WorkerError.from_exception(rank, "127.0.0.1", exc))
    finally:
        ringcore.shutdown()
    try:
        blob = cloudpickle.dumps(outcome)
    except Exception as exc:  # a result that does not pickle: the rank's error
        outcome = ("error", WorkerError.from_exception(rank, "127.0.0.1", exc))
        blob = cloudpickle.dumps(outcome)
    with open(f"{result_path}.tmp", "wb") as f:
        f.write(blob)
    os.replace(f"{result_path}.tmp", result_path)
    if outcome[0] == "ok":
        return 0
    code = getattr(outcome[1], "exit_code", None)
    return code if isinstance(code, int) and code != 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
