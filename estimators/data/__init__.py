"""The data's way from a DataFrame to a worker's batches.

``_columns``: which columns a fit trains on and how they become Parquet types;
``_parquet_writer``: who writes the Parquet into the store; ``_spec``: the data half of
what a worker gets from the driver (:class:`~._spec.DataSpec`); ``_readers``: how a
worker reads its shard, in place and streamed; ``_batches``: its batches of an epoch.
"""
