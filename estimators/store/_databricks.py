"""Databricks' FUSE mounts: the variables that move them, and what a volume path names.

A Unity Catalog volume is ``/Volumes/<catalog>/<schema>/<volume>/...`` on the driver and
every executor (Spark names it ``dbfs:/Volumes/...``); the DBFS root is ``/dbfs``
(``dbfs:/``). ``RING_VOLUMES_ROOT`` and ``RING_DBFS_ROOT`` move the mounts (tests
emulate Databricks that way).
"""

from __future__ import annotations

import posixpath

__all__ = [
    "DATABRICKS_ENV_VAR",
    "DBFS_ROOT_ENV_VAR",
    "DEFAULT_DBFS_ROOT",
    "DEFAULT_VOLUME",
    "DEFAULT_VOLUMES_ROOT",
    "DEFAULT_VOLUME_ENV_VAR",
    "VOLUMES_ROOT_ENV_VAR",
    "is_volume_path",
    "volume_parts",
]

DBFS_ROOT_ENV_VAR = "RING_DBFS_ROOT"
DEFAULT_DBFS_ROOT = "/dbfs"
DATABRICKS_ENV_VAR = "DATABRICKS_RUNTIME_VERSION"
VOLUMES_ROOT_ENV_VAR = "RING_VOLUMES_ROOT"
DEFAULT_VOLUMES_ROOT = "/Volumes"
DEFAULT_VOLUME_ENV_VAR = "RING_DATABRICKS_VOLUME"
DEFAULT_VOLUME = "/Volumes/main/default/ringtrain"


def is_volume_path(path: str) -> bool:
    return path.rstrip("/") == DEFAULT_VOLUMES_ROOT or path.startswith(DEFAULT_VOLUMES_ROOT + "/")


def volume_parts(path: str) -> list[str]:
    """``/Volumes/<catalog>/<schema>/<volume>/...`` → its parts after ``/Volumes``; a
    ValueError naming the form when the path does not name a volume (Databricks allows
    files only inside a volume, never in ``/Volumes/<catalog>/<schema>`` itself)."""
    parts = [p for p in posixpath.normpath(path).split("/")[2:] if p]
    if len(parts) < 3 or ".." in parts:
        raise ValueError(
            f"Store.create({path!r}): a Unity Catalog volume path is "
            "/Volumes/<catalog>/<schema>/<volume>/<folder>, and this one names "
            f"{'/'.join(['<catalog>', '<schema>', '<volume>'][: len(parts)]) or 'no catalog'}"
            " only. Create a volume (CREATE VOLUME <catalog>.<schema>.<volume>) and give a "
            "folder inside it, e.g. /Volumes/main/default/ringtrain/my_run."
        )
    return parts
