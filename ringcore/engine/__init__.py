"""The op engine: how named ops become ordered collectives on every rank.

``engine`` (one rank: submission and the sender, the fast lane, the receive loop,
op execution), ``coordinator`` and ``negotiation`` (rank 0's ordering of every rank's
ops, with the stall inspector and ``autotune``), ``protocol`` and ``messages`` (the
typed control protocol), ``wire`` (its authenticated framing), ``handle``, ``fusion``,
``reduction``, ``cuda_streams``, ``timeline``. Internal to ringcore: the public names
are in ``ringcore``, its bindings and ``ringcore.launch``.
"""
