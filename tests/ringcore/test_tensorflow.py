"""ringcore.tensorflow on 2 Gloo ranks: every op in eager mode and inside
``tf.function`` against the single-process computation, the gradients of the
collectives, ``DistributedGradientTape`` / ``DistributedOptimizer`` against one
full-batch step, and both import orders of TensorFlow and torch.

One launch of 2 ranks runs everything (importing TensorFlow costs seconds per
process); rank 0 imports TensorFlow before torch, rank 1 torch before TensorFlow.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ringcore.testing import run_workers

N = 2
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _battery(hvd, tf, r, n):
    """Every op once; returns {name: tensor}. Runs eagerly or traced in tf.function."""
    x = tf.constant([r + 1, 10 * (r + 1), -r], tf.float32)
    xi = tf.constant([r + 1, 10 * (r + 1), -r - 2], tf.int64)
    out = {
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "avg": hvd.allreduce(x),
        "min": hvd.allreduce(x, op=hvd.Min),
        "max": hvd.allreduce(x, op=hvd.Max),
        "prod": hvd.allreduce(x, op=hvd.Product),
        "int_sum": hvd.allreduce(xi, op=hvd.Sum),
        "int_avg": hvd.allreduce(xi, op=hvd.Average),
        "f64_sum": hvd.allreduce(tf.cast(x, tf.float64), op=hvd.Sum),
        "scaled": hvd.allreduce(
            tf.constant([1.0]), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
        ),
        "fp16": hvd.allreduce(tf.constant([0.1 * (r + 1)]), compression=hvd.Compression.fp16),
        "bool_max": tf.cast(hvd.allreduce(tf.constant([r == 0, False]), op=hvd.Max), tf.int32),
        "gather": hvd.allgather(tf.fill([r + 1, 2], float(r))),
        "gather_int": hvd.allgather(tf.fill([r + 1], r)),
        "bcast": hvd.broadcast(tf.fill([2], 7.0 * r), root_rank=n - 1),
        "rs": hvd.reducescatter(
            tf.transpose(tf.tile(tf.range(2 * n + 1, dtype=tf.float32)[None], [2, 1])),
            op=hvd.Sum,
        ),
    }
    g0, g1 = hvd.grouped_allreduce([x, tf.fill([2, 2], float(r))], op=hvd.Sum)
    out["grouped0"], out["grouped1"] = g0, g1
    a2a, a2a_splits = hvd.alltoall(tf.range(n, dtype=tf.float32) + 100.0 * r, splits=[1] * n)
    out["a2a"], out["a2a_recv"] = a2a, a2a_splits
    splits = [i + 1 for i in range(n)]
    u, u_splits = hvd.alltoall(tf.fill([sum(splits)], float(r)), splits=splits)
    out["a2a_uneven"], out["a2a_uneven_recv"] = u, u_splits
    hvd.barrier()
    return out


def _gradients(hvd, tf, r, n):
    """d(loss)/d(input) through each collective (see the expected values in the tests)."""
    w = float(r + 1)
    x3 = tf.constant([1.0, 2.0, 3.0]) * w
    grads = {}
    with tf.GradientTape(persistent=True) as tape:
        inputs = {
            "allreduce": x3,
            "allgather": tf.fill([r + 1], 1.0),
            "broadcast": x3,
            "alltoall": tf.range(n, dtype=tf.float32) + 10.0 * r,
            "reducescatter": tf.ones([2 * n]),
        }
        for t in inputs.values():
            tape.watch(t)
        total_rows = n * (n + 1) // 2
        losses = {
            "allreduce": tf.reduce_sum(hvd.allreduce(inputs["allreduce"], op=hvd.Sum) * w),
            "allgather": tf.reduce_sum(
                hvd.allgather(inputs["allgather"]) * tf.range(total_rows, dtype=tf.float32) * w
            ),
            "broadcast": tf.reduce_sum(hvd.broadcast(inputs["broadcast"], 0) * w),
            "alltoall": tf.reduce_sum(
                hvd.alltoall(inputs["alltoall"]) * w * tf.constant([1.0, 2.0])
            ),
            "reducescatter": tf.reduce_sum(hvd.reducescatter(inputs["reducescatter"]) * w),
        }
    for k in losses:
        grads[k] = tape.gradient(losses[k], inputs[k])
    return grads


def _regression(hvd, tf, r, n, fn_wrap):
    """Averaged gradients of a half-batch each == the full-batch gradient."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(8, 3)).astype(np.float32)
    target = rng.normal(size=(8, 1)).astype(np.float32)
    mine = slice(4 * r, 4 * r + 4)
    w = tf.Variable(tf.ones([3, 1]))
    emb = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [6, 2]))
    ids = tf.constant([[0, 1], [2, 3]][r])

    def step(sparse_as_dense, compression):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((features[mine] @ w - target[mine]) ** 2)
            loss += tf.reduce_sum(tf.gather(emb, ids) * float(r + 1))
        tape = hvd.DistributedGradientTape(
            tape, sparse_as_dense=sparse_as_dense, compression=compression
        )
        gw, gemb = tape.gradient(loss, [w, emb])
        return gw, tf.convert_to_tensor(gemb), isinstance(gemb, tf.IndexedSlices)

    out = {}
    for label, args in (
        ("sparse", (False, hvd.Compression.none)),
        ("dense", (True, hvd.Compression.none)),
        ("fp16", (False, hvd.Compression.fp16)),
    ):
        gw, gemb, was_sparse = fn_wrap(lambda a=args: step(*a))()
        out[f"tape_w/{label}"], out[f"tape_emb/{label}"] = gw.numpy(), gemb.numpy()
        out[f"tape_sparse/{label}"] = bool(was_sparse)
    return out


def _tf_worker():
    import os
    import sys

    out: dict = {"preloaded": [m for m in ("tensorflow", "torch") if m in sys.modules]}
    rank = int(os.environ["RING_RANK"])
    if rank == 0:
        import tensorflow as tf
        import torch
    else:
        import torch  # noqa: I001  (torch first on this rank, on purpose)
        import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import ringcore.tensorflow as hvd
    import ringcore.torch as hvd_torch

    only_one = hvd.ProcessSet([1])
    hvd.init(process_sets=[only_one])
    r, n = hvd.rank(), hvd.size()
    out["eager"] = {k: v.numpy() for k, v in _battery(hvd, tf, r, n).items()}
    graph = tf.function(lambda: _battery(hvd, tf, r, n))
    out["graph"] = {k: v.numpy() for k, v in graph().items()}
    out["graph_again"] = {k: v.numpy() for k, v in graph().items()}  # the traced graph reruns
    out["grad_eager"] = {k: v.numpy() for k, v in _gradients(hvd, tf, r, n).items()}
    out["grad_graph"] = {
        k: v.numpy() for k, v in tf.function(lambda: _gradients(hvd, tf, r, n))().items()
    }
    out["tape_eager"] = _regression(hvd, tf, r, n, lambda f: f)
    out["tape_graph"] = _regression(hvd, tf, r, n, tf.function)
    # tf.compat.v1 optimizer: one averaged gradient-descent step
    rng = np.random.default_rng(0)
    features = rng.normal(size=(8, 3)).astype(np.float32)
    target = rng.normal(size=(8, 1)).astype(np.float32)
    w = tf.Variable(tf.ones([3, 1]))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    mine = slice(4 * r, 4 * r + 4)
    opt.minimize(lambda: tf.reduce_mean((features[mine] @ w - target[mine]) ** 2), var_list=[w])
    out["v1_step"] = w.numpy()
    # variables, objects, join, process sets, torch beside TensorFlow
    v = tf.Variable([float(r + 1)] * 3)
    hvd.broadcast_variables([v], root_rank=1)
    out["bcast_var"] = v.numpy()
    out["bcast_obj"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["gather_obj"] = hvd.allgather_object(("rank", r))
    out["torch_sum"] = float(hvd_torch.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum))
    try:
        out["ps"] = hvd.allreduce(tf.constant([r + 5.0]), op=hvd.Sum, process_set=only_one).numpy()
    except ValueError as exc:
        out["ps"] = str(exc)
    out["join"] = int(hvd.join())
    try:
        hvd.allreduce(tf.zeros([r + 1]), name="mismatched")
        out["mismatch"] = None
    except hvd.CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    # fresh interpreters (not forked with torch loaded): the worker imports TensorFlow
    # first and torch after it, the order a TensorFlow user's script has
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RING_RANK_START", "spawn")
        return run_workers(_tf_worker, np=N, env=WORKER_ENV, timeout=110)


def _inputs():
    return [np.array([r + 1, 10 * (r + 1), -r], np.float64) for r in range(N)]


def _expected_battery(r):
    xs = _inputs()
    xi = [np.array([q + 1, 10 * (q + 1), -q - 2], np.int64) for q in range(N)]
    rs_full = 2 * np.tile(np.arange(2 * N + 1, dtype=np.float32)[:, None], [1, 2])
    base, extra = divmod(2 * N + 1, N)
    start = r * base + min(r, extra)
    return {
        "sum": sum(xs),
        "avg": sum(xs) / N,
        "min": np.min(xs, axis=0),
        "max": np.max(xs, axis=0),
        "prod": np.prod(xs, axis=0),
        "int_sum": sum(xi),
        "int_avg": np.trunc(sum(xi) / N),
        "f64_sum": sum(xs),
        "scaled": np.array([float(N)]),
        "fp16": np.array([np.mean([0.1 * (q + 1) for q in range(N)])]),
        "bool_max": np.array([1, 0]),
        "gather": np.concatenate([np.full((q + 1, 2), q) for q in range(N)]),
        "gather_int": np.concatenate([np.full(q + 1, q) for q in range(N)]),
        "bcast": np.full(2, 7.0 * (N - 1)),
        "rs": rs_full[start : start + base + (1 if r < extra else 0)],
        "grouped0": sum(xs),
        "grouped1": np.full((2, 2), float(sum(range(N)))),
        "a2a": np.array([r + 100.0 * q for q in range(N)]),
        "a2a_recv": np.array([1] * N),
        "a2a_uneven": np.concatenate([np.full(r + 1, float(q)) for q in range(N)]),
        "a2a_uneven_recv": np.array([r + 1] * N),
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["eager", "graph", "graph_again"])
def test_every_op_on_two_ranks_equals_the_single_process_computation(results, mode):
    for r, res in enumerate(results):
        expected = _expected_battery(r)
        assert sorted(res[mode]) == sorted(expected)
        for name, want in expected.items():
            got = res[mode][name]
            tol = 1e-3 if name == "fp16" else 1e-6
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{mode}/{name}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["grad_eager", "grad_graph"])
def test_collectives_differentiate_with_horovods_gradients(results, mode):
    for r, res in enumerate(results):
        g = res[mode]
        mean_w = np.mean([q + 1.0 for q in range(N)])
        np.testing.assert_allclose(g["allreduce"], np.full(3, sum(q + 1.0 for q in range(N))))
        rows = np.arange(N * (N + 1) // 2) * mean_w
        offset = r * (r + 1) // 2
        np.testing.assert_allclose(g["allgather"], rows[offset : offset + r + 1])
        np.testing.assert_allclose(g["broadcast"], np.full(3, mean_w if r == 0 else 0.0))
        np.testing.assert_allclose(g["alltoall"], (r + 1.0) * np.array([1.0, 2.0]))
        np.testing.assert_allclose(g["reducescatter"], np.repeat(np.arange(1.0, N + 1), 2))


def _full_batch():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(8, 3))
    target = rng.normal(size=(8, 1))
    w = np.ones((3, 1))
    halves = [
        2
        * features[4 * r : 4 * r + 4].T
        @ (features[4 * r : 4 * r + 4] @ w - target[4 * r : 4 * r + 4])
        / 4
        for r in range(N)
    ]
    return w, sum(halves) / N


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["tape_eager", "tape_graph"])
def test_distributed_gradient_tape_gives_the_full_batch_gradient(results, mode):
    _, full = _full_batch()
    emb = np.zeros((6, 2))
    for r in range(N):
        emb[[[0, 1], [2, 3]][r]] += (r + 1.0) / N
    for res in results:
        for label in ("sparse", "dense", "fp16"):
            tol = 2e-3 if label == "fp16" else 1e-5
            np.testing.assert_allclose(res[mode][f"tape_w/{label}"], full, rtol=tol, atol=tol)
            np.testing.assert_allclose(res[mode][f"tape_emb/{label}"], emb, rtol=tol, atol=tol)
        assert res[mode]["tape_sparse/sparse"] is True
        assert res[mode]["tape_sparse/dense"] is False


@pytest.mark.timeout(150)
def test_tf_v1_distributed_optimizer_steps_with_the_averaged_gradient(results):
    w, full = _full_batch()
    for res in results:
        np.testing.assert_allclose(res["v1_step"], w - 0.1 * full, rtol=1e-5)


@pytest.mark.timeout(150)
def test_variables_objects_join_and_torch_in_the_same_process(results):
    for res in results:
        assert res["preloaded"] == []  # so the import order in the worker is the one tested
        np.testing.assert_array_equal(res["bcast_var"], [2.0, 2.0, 2.0])
        assert res["bcast_obj"] == {"from": 1}
        assert res["gather_obj"] == [("rank", 0), ("rank", 1)]
        assert res["torch_sum"] == 3.0
        assert res["join"] in (0, 1)
        assert "mismatched" in res["mismatch"]
    assert "rank 0 is not in" in results[0]["ps"]
    np.testing.assert_array_equal(results[1]["ps"], [6.0])


_NO_TF = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow" or name.startswith("tensorflow."):
                raise ImportError("No module named 'tensorflow'")
    sys.meta_path.insert(0, Block())
    for mod in ("ringcore.tensorflow", "ringcore.keras"):
        try:
            __import__(mod)
        except ImportError as exc:
            print(mod, "|", exc)
    """
)


@pytest.mark.timeout(60)
def test_importing_without_tensorflow_names_the_extra_to_install():
    out = subprocess.run(
        [sys.executable, "-c", _NO_TF], capture_output=True, text=True, timeout=50, check=True
    ).stdout
    lines = out.strip().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["ringcore.tensorflow", "ringcore.keras"]
    assert all("pip install 'ringtrain[tensorflow]'" in line for line in lines)
