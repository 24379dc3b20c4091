"""torch.distributed programs, written as for torchrun, run unchanged on spark_runner:
``spark_runner.run`` of a function and of a Python file, and ``TorchDistributor`` (PySpark's
interface) on the shared local[2] session and on the driver (``local_mode=True``).

Each launch runs the four programs of tests/_torch_programs.py (DDP on env://, FSDP2,
Lightning's DDPStrategy, the Hugging Face Trainer) one after another in each rank's
process; every rank must report world size 2 and the digest of the other rank for each
(one launch per launcher form, not one per program: each launch costs seconds). A file
form runs the DDP program alone: what differs there is how the file runs, not the
program."""

from __future__ import annotations

import json
import os

import _spark
import _torch_programs  # beside _spark.py, as the file form imports it
import pytest

import spark_runner
from ringcore import WorkerError

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
pytestmark = pytest.mark.spark

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(TESTS, "_torch_programs_main.py")


@pytest.fixture(scope="module")
def spark():
    return _spark.shared_session()  # never stopped here: see tests/_spark.py


PROGRAMS = list(_torch_programs.PROGRAMS)


def _in_step(per_rank: list[dict], names: list[str] = PROGRAMS) -> None:
    """Every rank ran the programs in one group of 2 and ended with the same parameters."""
    for name in names:
        results = [r[name] for r in per_rank]
        assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)], name
        assert results[0]["digest"] == results[1]["digest"], name


def _files(out: str) -> list[dict]:
    with open(os.path.join(out, "rank0.json")) as f0, open(os.path.join(out, "rank1.json")) as f1:
        return [json.load(f0), json.load(f1)]


def test_spark_runner_run_runs_a_torchrun_function_unchanged(spark):
    _in_step(spark_runner.run(_torch_programs.run_all, num_proc=2))


def test_spark_runner_run_runs_a_python_file_with_its_arguments(spark, tmp_path):
    # the file form's own path (shipped, run by the task as python would): one program
    assert spark_runner.run(MAIN, args=[str(tmp_path), "ddp"], num_proc=2) == [None, None]
    _in_step(_files(str(tmp_path)), ["ddp"])


def test_torch_distributor_on_spark_returns_rank_0s_result(spark):
    """(Its file form on Spark is spark_runner.run's, tested above; local_mode's below.)"""
    distributor = spark_runner.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    result = distributor.run(_torch_programs.run_all)
    assert {(r["rank"], r["world_size"]) for r in result.values()} == {(0, 2)}
    assert set(result) == set(PROGRAMS)


def test_torch_distributor_local_mode_runs_on_the_driver_without_a_spark_job(spark, tmp_path):
    """Local mode starts fresh processes on the driver: it runs the two programs that
    call torch.distributed themselves. The Lightning and Trainer programs read the same
    variables, set by the same code; they run on Spark above and on every launcher,
    and their imports in fresh processes would cost this test the most."""
    sc = spark.sparkContext
    jobs = len(sc.statusTracker().getJobIdsForGroup(None))
    distributor = spark_runner.TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    result = distributor.run(_torch_programs.run_all, ["ddp", "fsdp2"])
    assert {(r["rank"], r["world_size"]) for r in result.values()} == {(0, 2)}
    assert set(result) == {"ddp", "fsdp2"}
    assert distributor.run(MAIN, str(tmp_path), "ddp") is None
    _in_step(_files(str(tmp_path)), ["ddp"])
    assert len(sc.statusTracker().getJobIdsForGroup(None)) == jobs


def _exits(code):
    raise SystemExit(code)


def test_a_failed_rank_reports_its_exit_code(spark, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(WorkerError) as spark_err:
        spark_runner.run(str(script), num_proc=2, verbose=0)
    assert (spark_err.value.rank, spark_err.value.exit_code) == (1, 3)
    local = spark_runner.TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    with pytest.raises(WorkerError) as local_err:
        local.run(str(script))
    assert (local_err.value.rank, local_err.value.exit_code) == (1, 3)


def test_bad_programs_and_arguments_fail_before_any_job(spark, tmp_path):
    sc = spark.sparkContext
    jobs = len(sc.statusTracker().getJobIdsForGroup(None))
    not_python = tmp_path / "train.sh"
    not_python.write_text("echo hi\n")
    with pytest.raises(FileNotFoundError, match=r"missing\.py.* does not exist"):
        spark_runner.run(str(tmp_path / "missing.py"), num_proc=2)
    with pytest.raises(ValueError, match=r"train\.sh.* is not a Python file"):
        spark_runner.run(str(not_python), num_proc=2)
    with pytest.raises(TypeError, match=r"argument 1 .* is 0\.1 \(float\).*str\(0\.1\)"):
        spark_runner.run(MAIN, args=["--lr", 0.1], num_proc=2)
    with pytest.raises(ValueError, match=r"num_processes has to be a positive integer, got 0"):
        spark_runner.TorchDistributor(num_processes=0, use_gpu=False)
    distributor = spark_runner.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(TypeError, match=r"argument 0 .* is 3 \(int\)"):
        distributor.run(MAIN, 3)
    with pytest.raises(ValueError, match=r"keyword arguments are for a function"):
        distributor.run(MAIN, lr="0.1")
    assert len(sc.statusTracker().getJobIdsForGroup(None)) == jobs
