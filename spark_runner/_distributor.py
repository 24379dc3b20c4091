"""``TorchDistributor``: PySpark's ``pyspark.ml.torch.distributor.TorchDistributor``,
launched by ringtrain.

The same constructor and ``run(train_object, *args, **kwargs)``: a function (rank 0's
return value comes back) or the path of a Python file run with its string arguments
(None comes back). Every rank gets torchrun's environment as under PySpark's torchrun
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, ...), so a
program written for PySpark's runs unchanged.

``local_mode=True`` runs ``num_processes`` processes on the driver, with no Spark job
(``spark_runner._local``); ``local_mode=False`` runs one barrier stage of
``num_processes`` tasks, one rank each, through :func:`spark_runner.run` (classic or
Spark Connect), so a failed rank is raised as ``WorkerError`` with its traceback and
every rank's output reaches the driver live. What differs from PySpark's is in
docs/migrating-from-torchdistributor.md.
"""

from __future__ import annotations

from typing import Any

from ringcore import RingError, cuda_built
from ringcore.launch import GpuUnavailableError, check_use_gpu, is_script

from ._local import run_local
from ._script import as_program

__all__ = ["TORCH_SSL_CONF", "TorchDistributor"]

#: PySpark's conf that lets TorchDistributor run on a cluster with TLS enabled
TORCH_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"TorchDistributor: {name} must be True or False, got {value!r}")
    return value


class TorchDistributor:
    """Distributed PyTorch on Spark with PySpark's interface (``num_processes``,
    ``local_mode``, ``use_gpu``; ``run(train_object, *args, **kwargs)``).

    ``use_gpu`` defaults to True, as PySpark's: on a machine without CUDA pass
    ``use_gpu=False``. With ``local_mode=False`` it is ``spark_runner.run``'s
    ``use_gpu`` (each task's ``CUDA_VISIBLE_DEVICES``: the GPUs Spark assigned it, else
    its local rank's); with ``local_mode=True`` each process gets the GPU of its local
    rank among the driver's ``CUDA_VISIBLE_DEVICES`` (all devices when unset)."""

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        _ssl_conf: str = TORCH_SSL_CONF,
    ):
        if (
            isinstance(num_processes, bool)
            or not isinstance(num_processes, int)
            or num_processes < 1
        ):
            raise ValueError(
                f"num_processes has to be a positive integer, got {num_processes!r}: the number "
                "of ranks (one Spark task each, or one driver process each with local_mode=True)"
            )
        self.num_processes = num_processes
        self.local_mode = _check_flag("local_mode", local_mode)
        self.use_gpu = _check_flag("use_gpu", use_gpu)
        self.ssl_conf = _ssl_conf
        self.num_tasks = 0 if local_mode else num_processes
        if use_gpu and local_mode:
            check_use_gpu(True, "TorchDistributor(local_mode=True)")  # the driver's GPUs
        elif use_gpu and not cuda_built():
            raise GpuUnavailableError(
                "TorchDistributor: use_gpu=True (the default, as in PySpark) but this torch "
                "has no CUDA (torch.version.cuda is None). Pass use_gpu=False to train on "
                "CPU, or install a CUDA build of torch."
            )

    def run(self, train_object: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every rank and return rank 0's result,
        or run the Python file ``train_object`` with the string arguments ``args`` on every
        rank and return None. Everything is checked before any job starts."""
        if is_script(train_object) and kwargs:
            raise ValueError(
                f"TorchDistributor.run({train_object!r}, ..., {', '.join(kwargs)}=...): a "
                "Python file takes only its command-line arguments, as strings in *args "
                "(e.g. '--lr=0.1'); keyword arguments are for a function"
            )
        if not is_script(train_object) and not callable(train_object):
            raise TypeError(
                "TorchDistributor.run takes a function or the path of a Python file, got "
                f"{type(train_object).__name__}"
            )
        program, args, kwargs = as_program(train_object, args, kwargs)
        if self.local_mode:
            return run_local(program, args, kwargs, self.num_processes, self.use_gpu)[0]
        from ._run import run

        self._check_encryption()
        # use_gpu=True: one GPU per task through the stage's ResourceProfile where the
        # cluster has stage-level scheduling (spark_runner._resources), as PySpark's
        # spark.task.resource.gpu.amount would give every stage of the application
        return run(program, args, kwargs, num_proc=self.num_processes, use_gpu=self.use_gpu)[0]

    def _check_encryption(self) -> None:
        """PySpark's refusal: the ranks' traffic is not encrypted, so a cluster with
        ``spark.ssl.enabled`` needs ``self.ssl_conf`` set to true to run anyway."""
        from ._run import _active_session

        conf = _active_session().conf
        if str(conf.get("spark.ssl.enabled", "false")).lower() != "true":
            return
        if str(conf.get(self.ssl_conf, "false")).lower() == "true":
            return
        raise RingError(
            "TorchDistributor: this cluster has TLS enabled (spark.ssl.enabled=true) but the "
            "ranks' tensors travel unencrypted between tasks (Gloo/NCCL, as under PySpark's "
            f"TorchDistributor). Set {self.ssl_conf}=true in the Spark configuration to run "
            "anyway, or use local_mode=True."
        )
