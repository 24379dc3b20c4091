"""How the ranks of a job find each other: the environment contract a launcher sets,
the topology read from it, the store they meet at and the interface they use.

``environment`` (``Rendezvous``, ``read_environment``, ``worker_env``), ``topology``,
``store_server``, ``iface``. Below the backends and the shared-memory plane, which meet
through it; internal to ringcore (its public names are in ``ringcore`` and
``ringcore.launch``).
"""
