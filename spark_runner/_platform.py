"""Defaults that depend on where the driver runs: plain Spark, or a Databricks cluster.

Databricks sets ``DATABRICKS_RUNTIME_VERSION`` in the driver (and executors). There the
notebook already holds the cluster's SparkSession (``spark``), executors run on other
machines than the driver, and autoscaling clusters take minutes to add workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DATABRICKS_ENV_VAR = "DATABRICKS_RUNTIME_VERSION"
DEFAULT_START_TIMEOUT_S = 600.0
DATABRICKS_START_TIMEOUT_S = 900.0  # an autoscaling cluster adds workers in 5-10 min


@dataclass(frozen=True)
class Defaults:
    platform: str
    #: seconds to wait for task slots when neither start_timeout nor the variable is set
    start_timeout_s: float
    #: where the driver's log server listens when spark.driver.bindAddress is unset
    log_bind_host: str | None
    #: True: spark_runner.local_session() returns the notebook's session, never a new one
    use_active_session: bool


def defaults() -> Defaults:
    if os.environ.get(DATABRICKS_ENV_VAR):
        return Defaults(
            platform=f"Databricks Runtime {os.environ[DATABRICKS_ENV_VAR]}",
            start_timeout_s=DATABRICKS_START_TIMEOUT_S,
            log_bind_host="0.0.0.0",  # executors are other machines: listen on every address
            use_active_session=True,
        )
    return Defaults(
        platform="Spark",
        start_timeout_s=DEFAULT_START_TIMEOUT_S,
        log_bind_host=None,  # spark.driver.host
        use_active_session=False,
    )
