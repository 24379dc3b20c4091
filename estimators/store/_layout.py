"""Where a store keeps what: the paths under its prefix, derived from the prefix alone.

Layout under the prefix (as Horovod's)::

    <prefix>/intermediate_train_data.<i>/          Parquet, one file per process (row groups ~32 MiB)
    <prefix>/intermediate_val_data.<i>/
    <prefix>/.intermediate_data_claim.<i>          the marker by which one fit owns index <i>
    <prefix>/runs/<run_id>/...                     the runs: checkpoint/, logs/ (ringcore.runs.layout)

The runs' paths (``get_run_path``, ``get_checkpoint_path``, ``get_history_path``, ...)
are the run-services layer's :class:`ringcore.runs.RunLayout`, shared with its checkpoint
keepers; this adds the data's.
"""

from __future__ import annotations

import posixpath

from ringcore.runs import RunLayout

__all__ = ["DATA_CLAIM", "TRAIN_DATA", "VAL_DATA", "StoreLayout"]

TRAIN_DATA = "intermediate_train_data"
VAL_DATA = "intermediate_val_data"
DATA_CLAIM = ".intermediate_data_claim"  # hidden: not data itself


class StoreLayout(RunLayout):
    """The paths of a store (see the module docstring); ``prefix_path`` is the store's."""

    prefix_path: str

    def get_train_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{TRAIN_DATA}.{idx}")

    def get_val_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{VAL_DATA}.{idx}")

    def get_data_claim_path(self, idx: int) -> str:
        """The marker a fit creates, exclusively, to own data index ``idx``."""
        return posixpath.join(self.prefix_path, f"{DATA_CLAIM}.{idx}")
