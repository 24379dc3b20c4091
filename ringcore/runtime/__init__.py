"""This process in a job: ``init()`` and ``shutdown()``, the running job's state, process
sets, the collector's view of the heap, and the capability queries.

``lifecycle`` (``init``/``shutdown``: join through the registered backend, put the
shared-memory layer in front of it, start the coordinator and the engine), ``state``
(what every layer above reads of the running job), ``process_sets``, ``heap``,
``capabilities``. The top room of the core: it imports the others, none imports it
but the public modules and the bindings.
"""
