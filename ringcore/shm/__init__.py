"""The shared-memory data plane of one host's ranks, and the layer that puts it in front
of any backend.

``layer`` (the plan, ``join`` and ``ShmBackend``: what the runtime puts in front of the
backend that connected), ``group`` (``ShmGroup``: the collectives), ``rounds``,
``reduce``, ``vote`` (the fast lane's proposals), ``sync``, ``segment``, ``files``,
``handshake``. Internal to ringcore.
"""
