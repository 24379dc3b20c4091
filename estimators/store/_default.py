"""Where a fit keeps its data when it is given no store."""

from __future__ import annotations

import os
import posixpath
import tempfile
import uuid

from ._databricks import DATABRICKS_ENV_VAR, DEFAULT_VOLUME, DEFAULT_VOLUME_ENV_VAR
from ._store import Store, VolumeStore

__all__ = ["default_store"]


def default_store() -> Store:
    """The store of a fit given none: a new temporary directory here; on Databricks a
    new folder in the volume ``RING_DATABRICKS_VOLUME`` names, else in
    ``/Volumes/main/default/ringtrain`` when that volume exists. A ValueError saying how
    to give one when neither is there (a driver's temporary directory is not on the
    executors of a multi-node cluster, and the DBFS root is deprecated)."""
    if not os.environ.get(DATABRICKS_ENV_VAR):
        return Store.create(tempfile.mkdtemp(prefix="ringtrain-store-"))
    named = os.environ.get(DEFAULT_VOLUME_ENV_VAR)
    volume = named or DEFAULT_VOLUME
    store = Store.create(volume)
    if not isinstance(store, VolumeStore) or not os.path.isdir(store.prefix_path):
        source = f"{DEFAULT_VOLUME_ENV_VAR}={named!r}" if named else f"the default {volume}"
        raise ValueError(
            f"RingEstimator has no store and {source} is not a Unity Catalog volume this "
            "cluster mounts. Pass one every node reaches: store=Store.create('/Volumes/"
            "<catalog>/<schema>/<volume>/<folder>') (CREATE VOLUME <catalog>.<schema>."
            f"<volume> makes one), or set {DEFAULT_VOLUME_ENV_VAR} to a volume path."
        )
    return Store.create(posixpath.join(volume, f"store-{uuid.uuid4().hex[:12]}"))
