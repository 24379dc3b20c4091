"""The data path of ``RingEstimator.fit``: one module per step, each only forward.

1. ``_resolve``: the params become one checked ``FitConfig`` (no job);
2. ``_check``: the DataFrame checked once, a first batch through the model;
3. ``_write``: the data written as balanced Parquet in the store (or reused);
4. ``_launch``: the workers train through the estimator's launcher;
5. ``_build``: the ``RingModel`` from the run's final checkpoint.

``_config`` holds the values they hand on; ``_schema``, ``_cluster`` and ``_cache`` are
parts of steps 1 to 3.
"""
