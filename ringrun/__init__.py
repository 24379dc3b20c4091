"""ringrun: ringtrain's command-line launcher (as ``horovodrun`` / ``torchrun``).

``ringrun -np 4 python train.py ARGS`` runs the command on 4 ranks of this host;
``ringrun -np 8 -H a:4,b:4 python train.py`` across hosts over ssh; ``ringrun --spark
[--master URL] -np 4 ...`` in one barrier stage of a Spark cluster (classic or ``sc://``
Connect); ``ringrun --ray [--address auto] -np 4 ...`` on a Ray cluster; ``ringrun --mpi``
through mpiexec; ``ringrun --min-np 2 --max-np 8 --host-discovery-script S ...`` an
elastic job, the ring re-formed as the hosts ``S`` prints and the workers come and go. Every rank gets the ``RING_*`` variables and torchrun's (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``...), so ``hvd.init()``
and ``torch.distributed.init_process_group()`` need nothing else. Output lines come
prefixed ``[rank]<stdout>:``; ringrun exits with the first failing rank's own status
after ending the others; Ctrl-C ends every rank's process group. Flags: docs/guide.md.

The package is the top of ringtrain's layers: it imports ``ringcore``'s public modules
and, when asked for, ``spark_runner`` and ``ray_runner``; nothing imports it.
"""

from ._args import UsageError
from ._cli import main

__all__ = ["UsageError", "main"]
