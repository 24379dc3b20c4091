"""Bad input, table-driven: every case raises a ValueError/TypeError of ours that names the
thing, the value and the fix, before the data is written and with the store as it was.

Estimator cases run on a real ``local[2]`` session. Cases decided from the params and the
schema start no Spark job at all (checked with a job group and the status tracker); cases
that only the data can decide (nulls, NaNs, too few rows, a first batch through the model
and the loss) run exactly one job — the aggregation of ``estimators.fit._check.check_data`` —
and write nothing. Ring-core cases (ranks disagreeing in a collective) run on two real
Gloo ranks in one launch.
"""

from __future__ import annotations

import datetime
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import _spark
import pytest
import torch
from _reliability import record
from pyspark.ml.linalg import Vectors
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

import spark_runner
from estimators import RingEstimator, Store
from ringcore import RingError
from ringcore.testing import run_workers

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = tuple(os.path.join(ROOT, pkg) + os.sep for pkg in ("estimators", "spark_runner", "ringcore"))
ROWS = 64


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


SCHEMA = StructType(
    [
        StructField("features", ArrayType(DoubleType())),
        StructField("x", DoubleType()),
        StructField("label", LongType()),
        StructField("target", DoubleType()),
        StructField("is_val", BooleanType()),
        StructField("w", DoubleType()),
        StructField("text", StringType()),
        StructField("m", MapType(StringType(), DoubleType())),
        StructField(
            "s", StructType([StructField("a", DoubleType()), StructField("b", DoubleType())])
        ),
        StructField("nested", ArrayType(ArrayType(DoubleType()))),
        StructField("words", ArrayType(StringType())),
        StructField("ts", TimestampType()),
    ]
)


def _row(i: int) -> dict[str, Any]:
    return {
        "features": [float(i % 5), 1.0, -1.0, float(i % 3)],
        "x": float(i),
        "label": i % 2,
        "target": float(i % 7),
        "is_val": i % 4 == 0,
        "w": 1.0,
        "text": f"t{i}",
        "m": {"k": 1.0},
        "s": {"a": 1.0, "b": 2.0},
        "nested": [[1.0], [2.0]],
        "words": ["a"],
        "ts": datetime.datetime(2026, 1, 1),
    }


def _with(changes: dict[int, dict[str, Any]], rows: int = ROWS) -> list[tuple]:
    out = []
    for i in range(rows):
        row = _row(i)
        row.update(changes.get(i, {}))
        out.append(tuple(row[f.name] for f in SCHEMA.fields))
    return out


FRAMES = {
    "good": {},
    "null_feature": {3: {"x": None}, 9: {"x": None}, 20: {"x": None}},
    "null_label": {5: {"label": None}},
    "null_element": {7: {"features": [1.0, None, 1.0, 1.0]}},
    "nan_feature": {2: {"x": float("nan")}, 30: {"x": float("nan")}},
    "nan_element": {11: {"features": [1.0, float("nan"), 1.0, 1.0]}},
    "nan_label": {4: {"target": float("nan")}},
    "ragged": {6: {"features": [1.0, 2.0, 3.0]}},
}


@pytest.fixture(scope="module")
def frames(spark):
    built = {
        name: spark.createDataFrame(_with(changes), SCHEMA) for name, changes in FRAMES.items()
    }
    built["empty"] = spark.createDataFrame([], SCHEMA)
    built["few"] = spark.createDataFrame(_with({}, rows=10), SCHEMA)
    built["vectors"] = spark.createDataFrame(
        [(Vectors.dense([1.0, 2.0, 3.0, 4.0]), i % 2) for i in range(ROWS)], ["vec", "label"]
    )
    return built


class LockedNet(torch.nn.Module):
    """A model holding a lock: it cannot be pickled."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.linear(x)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x), self.linear(x)


def _model(out: int = 2, inp: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(inp, out)


def _unpicklable_loss():
    lock = threading.Lock()

    def loss(output, target):
        with lock:
            return torch.nn.functional.cross_entropy(output, target)

    return loss


def _unpicklable_transform():
    lock = threading.Lock()

    def transform(batch):
        with lock:
            return batch

    return transform


def _previous_run(store: Store) -> None:
    """A checkpoint of run 'r1' trained on a Linear(4, 3)."""
    path = store.get_checkpoint_path("r1")
    state = {"model": torch.nn.Linear(4, 3).state_dict(), "optimizer": {}, "epoch": 1}
    store.write_atomic(path, lambda f: torch.save(state, f))


@dataclass
class Case:
    id: str
    params: dict[str, Any]
    needles: tuple[str, str, str]  # the thing, the value, the fix
    frame: str = "good"
    jobs: int = 0  # Spark queries before the error (0, or 1: the data check's aggregation)
    error: type = ValueError
    setup: Any = None  # fn(store) run before the fit (its files are the "before")
    extra: dict[str, Any] = field(default_factory=dict)


def _memory_store():
    return {"store": Store.create("memory://ringtrain-bad-input")}


CASES = [
    # --- columns: missing or misspelled, with the close name suggested
    Case("misspelled-feature", {"feature_cols": ["featurs"]},
         ("feature column 'featurs'", "is not in the DataFrame", "Did you mean 'features'?")),
    Case("misspelled-label", {"label_cols": ["lable"]},
         ("label column 'lable'", "is not in the DataFrame", "Did you mean 'label'?")),
    Case("feature-of-other-case", {"feature_cols": ["Features"]},
         ("feature column 'Features'", "its columns are: features, x, label", "Did you mean 'features'?")),
    Case("missing-feature", {"feature_cols": ["pixels"]},
         ("feature column 'pixels'", "is not in the DataFrame", "setFeatureCols(")),
    Case("feature-cols-unset", {"feature_cols": None},
         ("feature_cols", "is not set", "setFeatureCols([...])")),
    Case("feature-and-label", {"feature_cols": ["label"]},
         ("label", "in both feature_cols and label_cols", "use each once")),
    Case("missing-weight", {"sample_weight_col": "weight"},
         ("sample weight column 'weight'", "is not in the DataFrame", "setSampleWeightCol(")),
    # --- wrong column types
    Case("string-feature", {"feature_cols": ["text"]},
         ("feature column 'text'", "has type string", "VectorAssembler")),
    Case("string-label", {"label_cols": ["text"]},
         ("label column 'text'", "has type string", "StringIndexer")),
    Case("map-feature", {"feature_cols": ["m"]},
         ("feature column 'm'", "has type map<string,double>", "F.col('m')['key']")),
    Case("struct-feature", {"feature_cols": ["s"]},
         ("feature column 's'", "has type struct<a:double,b:double>", "df.select('*', 's.*')")),
    Case("nested-array-feature", {"feature_cols": ["nested"]},
         ("feature column 'nested'", "has type array<array<double>>", "F.flatten")),
    Case("string-array-feature", {"feature_cols": ["words"]},
         ("feature column 'words'", "has type array<string>", "array of numbers")),
    Case("timestamp-feature", {"feature_cols": ["ts"]},
         ("feature column 'ts'", "has type timestamp", "F.unix_timestamp('ts')")),
    Case("string-weight", {"sample_weight_col": "text"},
         ("sample weight column 'text'", "has type string", "setSampleWeightCol")),
    # --- numbers
    Case("num-proc-zero", {"num_proc": 0}, ("num_proc", "got 0", "setNumProc(")),
    Case("num-proc-negative", {"num_proc": -2}, ("num_proc", "got -2", "setNumProc(")),
    Case("num-proc-over-slots", {"num_proc": 3},
         ("needs 3 task slots", "the cluster has 2", "Lower num_proc to 2")),
    Case("batch-size-zero", {"batch_size": 0}, ("batch_size", "got 0", "setBatchSize(")),
    Case("batch-size-negative", {"batch_size": -8}, ("batch_size", "got -8", "setBatchSize(")),
    Case("epochs-zero", {"epochs": 0}, ("epochs", "got 0", "setEpochs(")),
    Case("epochs-negative", {"epochs": -1}, ("epochs", "got -1", "setEpochs(")),
    Case("val-batch-size-zero", {"val_batch_size": 0}, ("val_batch_size", "got 0", "setValBatchSize(")),
    # --- validation
    Case("validation-one", {"validation": 1.0}, ("validation", "got 1.0", "setValidation(0.1)")),
    Case("validation-negative", {"validation": -0.1}, ("validation", "got -0.1", "setValidation(0.1)")),
    Case("validation-above-one", {"validation": 1.5}, ("validation", "got 1.5", "setValidation(0.1)")),
    Case("validation-missing-column", {"validation": "is_vall"},
         ("validation column 'is_vall'", "is not in the DataFrame", "Did you mean 'is_val'?")),
    Case("validation-string-column", {"validation": "text"},
         ("validation column 'text'", "has type string", "setValidation(")),
    # --- model, loss, objects that must travel to the workers
    Case("model-not-a-module", {"model": "resnet"}, ("model", "got str", "setModel(")),
    Case("model-does-not-pickle", {"model": "locked"},
         ("model (LockedNet)", "cannot pickle '_thread.lock'", "__getstate__")),
    Case("loss-does-not-pickle", {"loss": "locked"},
         ("loss (function)", "cannot pickle '_thread.lock'", "setLoss(")),
    Case("transform-does-not-pickle", {"transformation_fn": "locked"},
         ("transformation_fn (function)", "cannot pickle '_thread.lock'", "setTransformationFn(")),
    Case("loss-not-callable", {"loss": 3}, ("loss", "got int", "setLoss(")),
    Case("optimizer-of-another-model", {"optimizer": "foreign"},
         ("optimizer", "not in the model", "model.parameters()")),
    Case("unknown-reader", {"reader": "csv"}, ("reader", "got 'csv'", "petastorm")),
    Case("run-id-reused-with-another-model", {"run_id": "r1"},
         ("run_id 'r1'", "shape [3, 4] in the checkpoint but [2, 4] in this model", "setRunId("),
         setup=_previous_run),
    Case("store-in-driver-memory", {"store": "memory"},
         ("the store memory://ringtrain-bad-input", "lives in the driver's memory", "shared directory")),
    # --- the data itself: one aggregation job, nothing written
    Case("null-in-feature", {"feature_cols": ["x"]},
         ("feature column 'x'", "has 3 null value(s)", "df.na.drop(subset=['x'])"),
         frame="null_feature", jobs=1),
    Case("null-in-label", {},
         ("label column 'label'", "has 1 null value(s)", "df.na.fill"), frame="null_label", jobs=1),
    Case("null-array-element", {},
         ("feature column 'features'", "has 1 null value(s)", "~F.exists('features'"),
         frame="null_element", jobs=1),
    Case("nan-in-feature", {"feature_cols": ["x"]},
         ("feature column 'x'", "2 row(s) holding NaN", "df.na.fill(0.0, subset=['x'])"),
         frame="nan_feature", jobs=1),
    Case("nan-array-element", {},
         ("feature column 'features'", "1 row(s) holding NaN", "replace the NaNs"),
         frame="nan_element", jobs=1),
    Case("nan-in-label", {"label_cols": ["target"], "loss": "mse", "model": "one-output"},
         ("label column 'target'", "1 row(s) holding NaN", "Drop those rows"),
         frame="nan_label", jobs=1),
    Case("ragged-arrays", {},
         ("feature column 'features'", "arrays of different lengths (3 to 4)", "Pad or cut"),
         frame="ragged", jobs=1),
    Case("empty-dataframe", {},
         ("the DataFrame", "is empty (0 rows)", "Check the filter"), frame="empty", jobs=1),
    Case("fewer-rows-than-num-proc-times-batch", {"batch_size": 8},
         ("the training data", "has 10 rows, fewer than num_proc=2 * batch_size=8 = 16",
          "Lower batch_size"), frame="few", jobs=1),
    Case("validation-column-leaves-too-few", {"validation": "is_val", "batch_size": 32},
         ("the training data", "has 48 rows, fewer than num_proc=2 * batch_size=32 = 64",
          "setNumProc"), jobs=1),
    Case("loss-does-not-fit-label-shape", {"label_cols": ["target"], "loss": "mse", "model": "three-outputs"},
         ("the loss MSELoss does not fit the label", "output of shape (2, 3)", "setLoss("), jobs=1),
    Case("loss-returns-one-value-per-row", {"loss": "no-reduction"},
         ("the loss CrossEntropyLoss", "returned (2,)", "reduction='mean'"), jobs=1),
    Case("model-input-does-not-fit-features", {"model": "five-inputs"},
         ("the model Linear failed on a first batch", "of shape (2, 4)", "setFeatureCols"), jobs=1),
    Case("model-returns-two-outputs-for-one-label", {"model": "two-heads"},
         ("the model returned 2 output(s)", "label_cols names 1", "one tensor per label column"),
         jobs=1),
    Case("vector-features-on-a-missing-label", {"feature_cols": ["vec"], "label_cols": ["labels"]},
         ("label column 'labels'", "is not in the DataFrame", "Did you mean 'label'?"),
         frame="vectors"),
]  # fmt: skip


def _resolve(name: str, value: Any) -> Any:
    """Table values that must be built per test (models, unpicklable objects)."""
    named = {
        ("model", "locked"): LockedNet,
        ("model", "one-output"): lambda: _model(out=1),
        ("model", "three-outputs"): lambda: _model(out=3),
        ("model", "five-inputs"): lambda: _model(inp=5),
        ("model", "two-heads"): TwoHeads,
        ("loss", "locked"): _unpicklable_loss,
        ("loss", "mse"): torch.nn.MSELoss,
        ("loss", "no-reduction"): lambda: torch.nn.CrossEntropyLoss(reduction="none"),
        ("transformation_fn", "locked"): _unpicklable_transform,
        ("store", "memory"): lambda: _memory_store()["store"],
    }
    maker = named.get((name, value)) if isinstance(value, str) else None
    return maker() if maker is not None else value


def _estimator(store: Store, params: dict[str, Any]) -> RingEstimator:
    resolved = {k: _resolve(k, v) for k, v in params.items() if k != "optimizer"}
    model = resolved.pop("model", None) or _model()
    if isinstance(model, torch.nn.Module):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    if params.get("optimizer") == "foreign":
        optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    base = {
        "model": model,
        "optimizer": optimizer,
        "loss": torch.nn.CrossEntropyLoss(),
        "feature_cols": ["features"],
        "label_cols": ["label"],
        "batch_size": 8,
        "epochs": 1,
        "num_proc": 2,
        "verbose": 0,
        "store": store,
        "random_seed": 1,
    }
    base.update(resolved)
    unset = [k for k, v in base.items() if v is None]
    est = RingEstimator(**{k: v for k, v in base.items() if v is not None})
    for name in unset:
        est.clear(est.getParam(name))
    return est


def _files(root: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names
    } | {os.path.relpath(d, root) + os.sep for d, _, _ in os.walk(root)}


def _raised_in_our_code(exc: BaseException) -> str:
    """The file of the innermost frame that raised ``exc``."""
    return traceback.extract_tb(exc.__traceback__)[-1].filename


@pytest.mark.spark
@pytest.mark.reliability(fault="bad estimator input (params, columns, data)", category="bad-input")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_naming_thing_value_and_fix_before_writing(
    spark, frames, tmp_path, case, request
):
    store = Store.create(str(tmp_path / "store"))
    os.makedirs(store.prefix_path)
    if case.setup is not None:
        case.setup(store)
    before = _files(store.prefix_path)
    estimator = _estimator(store, case.params)
    sc = spark.sparkContext
    group = f"bad-input-{case.id}"
    sc.setJobGroup(group, "bad input: at most the data check may run")
    try:
        with pytest.raises((ValueError, TypeError)) as info:
            estimator.fit(frames[case.frame])
        jobs = sc.statusTracker().getJobIdsForGroup(group)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    message = str(info.value)
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert isinstance(info.value, case.error)
    assert _raised_in_our_code(info.value).startswith(OURS), traceback.format_exception(info.value)
    # One aggregation query is two jobs under adaptive query execution (its shuffle map
    # stage is submitted as a job of its own), one without.
    per_query = 2 if spark.conf.get("spark.sql.adaptive.enabled") == "true" else 1
    assert len(jobs) == case.jobs * per_query, f"{len(jobs)} Spark jobs ran before: {message}"
    assert _files(store.prefix_path) == before, "the failed fit left files in the store"
    record(request, note=type(info.value).__name__)


# --- ring core: ranks that disagree in a collective ----------------------------------------------


def _disagreeing_ranks():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r = hvd.rank()
    f32, f64 = torch.float32, torch.float64
    other = f64 if r else f32
    calls = {
        "allreduce-shape": lambda: hvd.allreduce(torch.zeros(2 + r), name="ar.shape"),
        "allreduce-dtype": lambda: hvd.allreduce(torch.zeros(2, dtype=other), name="ar.dtype"),
        "grouped-allreduce-shape": lambda: hvd.grouped_allreduce(
            [torch.zeros(2), torch.zeros(1 + r)], name="gar.shape"
        ),
        "allgather-dtype": lambda: hvd.allgather(torch.zeros(2, 3, dtype=other), name="ag.dtype"),
        "allgather-second-dim": lambda: hvd.allgather(torch.zeros(2, 3 + r), name="ag.dim1"),
        "allgather-rank": lambda: hvd.allgather(torch.zeros((2, 3) if r else (2,)), name="ag.ndim"),
        "broadcast-shape": lambda: hvd.broadcast(torch.zeros(3, 1 + r), 0, name="bc.shape"),
        "broadcast-dtype": lambda: hvd.broadcast(torch.zeros(3, dtype=other), 0, name="bc.dtype"),
        "broadcast-root": lambda: hvd.broadcast(torch.zeros(3), root_rank=r, name="bc.root"),
        "alltoall-dtype": lambda: hvd.alltoall(torch.zeros(2, 2, dtype=other), name="a2a.dtype"),
        "alltoall-second-dim": lambda: hvd.alltoall(torch.zeros(2, 2 + r), name="a2a.dim1"),
        "reducescatter-shape": lambda: hvd.reducescatter(torch.zeros(4, 1 + r), name="rs.shape"),
        "reducescatter-dtype": lambda: hvd.reducescatter(
            torch.zeros(4, dtype=other), name="rs.dtype"
        ),
        "allreduce-device": lambda: hvd.allreduce(
            torch.zeros(2, device="meta" if r else "cpu"), name="ar.device"
        ),
        "broadcast-object-root": lambda: hvd.broadcast_object(
            {"r": r}, root_rank=r, name="bo.root"
        ),
    }
    out: dict[str, Any] = {}
    for label, call in calls.items():
        try:
            call()
            out[label] = None
        except Exception as exc:
            out[label] = (type(exc).__name__, str(exc))
    out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after").item()
    return out


@pytest.fixture(scope="module")
def disagreements():
    return run_workers(_disagreeing_ranks, np=2, timeout=120)


RING_CASES = [
    ("allreduce-shape", ("'ar.shape'", "rank 0: (2,), rank 1: (3,)", "same shape")),
    ("allreduce-dtype", ("'ar.dtype'", "rank 0: float32, rank 1: float64", "same dtype")),
    ("grouped-allreduce-shape", ("gar.shape", "rank 0: (1,), rank 1: (2,)", "same shape")),
    ("allgather-dtype", ("'ag.dtype'", "rank 0: float32, rank 1: float64", "same dtype")),
    ("allgather-second-dim", ("'ag.dim1'", "rank 0: (2, 3), rank 1: (2, 4)", "every dimension after the first")),
    ("allgather-rank", ("'ag.ndim'", "rank 0: (2,), rank 1: (2, 3)", "every dimension after the first")),
    ("broadcast-shape", ("'bc.shape'", "rank 0: (3, 1), rank 1: (3, 2)", "same shape")),
    ("broadcast-dtype", ("'bc.dtype'", "rank 0: float32, rank 1: float64", "same dtype")),
    ("broadcast-root", ("'bc.root'", "rank 0: 0, rank 1: 1", "same root rank")),
    ("alltoall-dtype", ("'a2a.dtype'", "rank 0: float32, rank 1: float64", "same dtype")),
    ("alltoall-second-dim", ("'a2a.dim1'", "rank 0: (2, 2), rank 1: (2, 3)", "every dimension after the first")),
    ("reducescatter-shape", ("'rs.shape'", "rank 0: (4, 1), rank 1: (4, 2)", "same shape")),
    ("reducescatter-dtype", ("'rs.dtype'", "rank 0: float32, rank 1: float64", "same dtype")),
    ("allreduce-device", ("'ar.device'", "rank 0: cpu, rank 1: meta", "same device")),
    ("broadcast-object-root", ("bo.root", "rank 0: 0, rank 1: 1", "same root rank")),
]  # fmt: skip


@pytest.mark.reliability(fault="ranks disagreeing in a collective", category="bad-input")
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("label", "needles"), RING_CASES, ids=[c[0] for c in RING_CASES])
def test_ranks_disagreeing_in_a_collective_raise_on_every_rank_naming_it(
    disagreements, label, needles
):
    for rank, res in enumerate(disagreements):
        assert res[label] is not None, f"rank {rank} did not raise for {label}"
        kind, message = res[label]
        assert kind == "CollectiveMismatchError", (rank, kind, message)
        for needle in needles:
            assert needle in message, f"rank {rank}: {needle!r} not in {message!r}"


def test_the_ring_goes_on_after_every_disagreement(disagreements):
    assert [res["after"] for res in disagreements] == [2.0, 2.0]


@pytest.mark.spark
def test_local_session_refuses_a_running_session_of_other_start_up_settings(spark):
    """getOrCreate would hand back the running session and drop the asked master or
    start-up setting without a word; local_session names them instead. Runtime SQL
    settings and the same master still get the running session."""
    with pytest.raises(
        RingError, match=r"spark\.master is 'local\[2\]', asked 'local\[3\]'.*spark\.stop\(\)"
    ):
        spark_runner.local_session("local[3]")
    with pytest.raises(RingError, match=r"spark\.executorEnv\.RING_X is None, asked '1'"):
        spark_runner.local_session("local[2]", conf={"spark.executorEnv.RING_X": "1"})
    same = spark_runner.local_session("local[2]", conf={"spark.sql.shuffle.partitions": "2"})
    assert same is spark and spark.sparkContext._jsc is not None
