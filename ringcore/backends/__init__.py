"""The data plane's libraries behind one small protocol, in an open registry.

``protocol`` (``Backend``, ``Connection``), ``registry`` (a factory per
``RING_BACKEND`` name; public as ``ringcore.launch.register_backend``), ``torch_ring``
and ``torch_backend`` (Gloo and NCCL through ``torch.distributed``), ``choice`` (which
of them carries CUDA tensors), ``devices`` (which GPU a rank owns), ``mpi``,
``host_staged``. Internal to ringcore.
"""
