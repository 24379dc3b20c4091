"""What Horovod's own TensorFlow and Keras suites rely on, as our specifications, on 2
Gloo ranks: the error classes of the TensorFlow ops, ``alltoall``'s return shape,
the topology ops, in-place and grouped ops, local (model-parallel) gradients,
gradients computed by the optimizer itself, the elastic states and callbacks, and the
static shapes of the ops' outputs inside a ``tf.function``.

One launch of 2 ranks runs every check (importing TensorFlow costs seconds per
process); each check records a plain value the tests below assert on.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.testing import run_workers

N = 2
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _raises(fn, *kinds):
    """The names of ``kinds`` the exception of ``fn()`` is an instance of (None if none)."""
    try:
        fn()
    except Exception as exc:
        return sorted(k.__name__ for k in kinds if isinstance(exc, k)) or type(exc).__name__
    return None


def _op_errors(hvd, tf, r, out):
    mismatch = (tf.errors.FailedPreconditionError, hvd.CollectiveMismatchError)
    out["shape_mismatch_eager"] = _raises(lambda: hvd.allreduce(tf.ones([r + 1])), *mismatch)
    graph_kinds = (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError)
    out["dtype_mismatch_graph"] = _raises(
        tf.function(lambda: hvd.allgather(tf.ones([2], tf.int32 if r else tf.float32))),
        *graph_kinds,
    )
    try:
        tf.function(lambda: hvd.allreduce(tf.ones([r + 1]), name="graph.shape"))()
    except tf.errors.FailedPreconditionError as exc:
        out["shape_mismatch_graph_message"] = exc.message
    total = tf.function(lambda: hvd.allreduce(tf.ones([2]) * r, op=hvd.Sum))()
    out["in_step_after_graph_error"] = float(total[0])
    with tf.Graph().as_default():  # a TF1 session graph fails the same way
        bad = hvd.broadcast(tf.ones([2]), root_rank=r, name="graph.root")
        with tf.compat.v1.Session() as sess:
            out["root_mismatch_session"] = _raises(lambda: sess.run(bad), *graph_kinds)
    out["root_mismatch"] = _raises(lambda: hvd.broadcast(tf.ones([2]), root_rank=r), *mismatch)
    invalid = tf.errors.InvalidArgumentError
    out["a2a_uneven_no_splits"] = _raises(lambda: hvd.alltoall(tf.ones([N + 1])), invalid)
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]), tf.constant([N, 3]))
    out["slices_min"] = _raises(lambda: hvd.allreduce(slices, op=hvd.Min), NotImplementedError)
    out["slices_prescale"] = _raises(
        lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=0.5), NotImplementedError
    )
    out["grouped_slices_max"] = _raises(
        lambda: hvd.grouped_allreduce([slices, tf.ones([2])], op=hvd.Max), NotImplementedError
    )
    out["global_variables_eager"] = _raises(lambda: hvd.broadcast_global_variables(0), RuntimeError)
    with tf.Graph().as_default():  # a TF1 graph without variables: nothing to broadcast
        out["global_variables_graph"] = hvd.broadcast_global_variables(0).type


def _ops(hvd, tf, r, out):
    out["a2a_equal"] = hvd.alltoall(tf.range(N, dtype=tf.float32) + 10.0 * r).numpy()
    shape, splits = ([2, 3], [2, 0]) if r == 0 else ([0, 3], [0, 0])
    got, received = hvd.alltoall(tf.fill(shape, r), splits=splits)
    out["a2a_zero_rows"], out["a2a_zero_splits"] = got.numpy().shape, received.numpy()
    out["a2a_splits_dtype"] = received.dtype.name
    x = tf.constant([1.0, 2.0]) * (r + 1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y, _ = hvd.alltoall(x, splits=[1, 1])
        loss = tf.reduce_sum(tf.concat([y, tf.cast(_, tf.float32)], 0))
    out["a2a_grad"] = tape.gradient(loss, x).numpy()
    (grouped,) = hvd.grouped_allreduce(
        [tf.IndexedSlices(tf.ones([1, 2]) * (r + 1), tf.constant([r]), tf.constant([N, 2]))],
        op=hvd.Sum,
    )
    out["grouped_slices_sum"] = tf.convert_to_tensor(grouped).numpy()
    out["topology_ops"] = [
        int(op()) for op in (hvd.rank_op, hvd.local_rank_op, hvd.size_op, hvd.local_size_op)
    ]
    v = tf.Variable([float(r)] * 3)
    (value,) = hvd.broadcast_([v], root_rank=1)
    out["broadcast_inplace"] = (v.numpy(), np.asarray(value))
    out["broadcast_object_fn"] = hvd.broadcast_object_fn(root_rank=1)({"from": r})
    gathered = hvd.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], float(r))])
    out["grouped_allgather"] = [g.numpy() for g in gathered]
    scattered = hvd.grouped_reducescatter([tf.ones([4]) * (r + 1)], op=hvd.Sum)
    out["grouped_reducescatter"] = [s.numpy() for s in scattered]
    x = tf.ones([4])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        summed = hvd.reducescatter(x, op=hvd.Sum)
        averaged = hvd.reducescatter(x * 2.0, op=hvd.Average)
    out["rs_grads"] = (tape.gradient(summed, x).numpy(), tape.gradient(averaged, x).numpy())


def _session_graph(hvd, tf, r, out):
    # TF1 session graph: the collectives run in the order they were built, fetching one
    # runs those built before it in that graph (the chain that keeps ranks in step).
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable(0.0, use_resource=True)
        count = v.assign_add(1.0)
        with tf.control_dependencies([count]):
            first = hvd.allreduce(tf.ones([2]) * (r + 1), op=hvd.Sum)
        with tf.compat.v1.Session() as sess:
            sess.run(v.initializer)
            sess.run(first)
            second = hvd.allreduce(tf.ones([3]) * (r + 1), op=hvd.Sum)
            third = hvd.allgather(tf.fill([r + 1], float(r)))
            for _ in range(3):
                sess.run(second)
            together = sess.run([third, second])
            out["session_graph"] = ([t.tolist() for t in together], float(sess.run(v)))


def _local_gradients(hvd, hvd_keras, tf, keras, r, out):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    for w in model.weights:
        w.assign(tf.fill(w.shape, float(r + 1)))
    x = tf.ones([1, 3])

    def tape_of_loss():
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x))
        return tape, loss

    tape, loss = tape_of_loss()
    plain = tape.gradient(loss, model.trainable_weights)
    dist = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0])
    local, shared = dist.get_local_and_global_gradients(loss, model.trainable_weights)
    out["tape_local"] = [np.allclose(g, p / N) for (_, g), p in zip(local, plain[:2])]
    out["tape_shared"] = [g.numpy() for _, g in shared]
    opt = hvd_keras.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=[model.layers[0]]
    )
    tape, loss = tape_of_loss()
    pairs = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    out["opt_local"] = [np.allclose(g, p / N) for (g, _), p in zip(pairs[:2], plain[:2])]
    out["opt_shared"] = [g.numpy() for g, _ in pairs[2:]]


def _optimizer_gradients(hvd, tf, keras, r, out):
    # _compute_gradients reduces; apply_gradients then applies without reducing again,
    # and accumulates over backward_passes_per_step like model.fit does.
    u = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    trace = []
    for _ in range(2):
        pairs = opt._compute_gradients(lambda: -u * float(r + 1), [u])
        opt.apply_gradients(pairs)
        trace.append((float(pairs[0][0][0]), float(u[0])))
    out["accumulated_trace"] = trace
    # an infinite gradient in one update is gone from the next (accumulators reset)
    w = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    grads = []
    for step in range(4):
        scale = float("inf") if step == 0 else 1.0
        pairs = opt._compute_gradients(lambda s=scale: w * s, [w])
        opt.apply_gradients(pairs)
        grads.append(float(pairs[0][0][0]))
    out["after_inf"] = grads[2:]
    # model.fit with sparse_as_dense and accumulation over an Embedding layer
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 2)])
    sparse_opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), sparse_as_dense=True, backward_passes_per_step=2
    )
    model.compile(optimizer=sparse_opt, loss="mse")
    hvd.broadcast_variables(model.variables, root_rank=0)
    xs = np.arange(8).reshape(2, 4) % 10
    model.fit(xs, np.full((2, 4, 2), float(r)), batch_size=1, epochs=1, verbose=0)
    out["sparse_fit_weights"] = model.get_weights()[0]


def _elastic(hvd, hvd_keras, tf, keras, r, out):
    v = tf.Variable([float(r + 1)] * 2)
    state = hvd.elastic.TensorFlowState([v], batch=r, epoch=10 + r)
    state.sync()
    synced = (v.numpy().tolist(), state.batch, state.epoch)
    v.assign([5.0, 5.0])
    state.batch = 7
    state.restore()
    restored = (v.numpy().tolist(), state.batch)
    v.assign([6.0, 6.0])
    state.commit()
    v.assign([0.0, 0.0])
    state.restore()
    out["tf_state"] = (synced, restored, v.numpy().tolist())

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    for w in model.weights:
        w.assign(tf.fill(w.shape, float(r)))
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    kstate = hvd_keras.elastic.KerasState(model, batch=0, epoch=0)
    kstate.sync()
    out["keras_state_synced"] = [w.tolist() for w in model.get_weights()]

    class Recorder(hvd.elastic.ObjectState):  # a state that notes when it is committed
        def commit(self):
            self.commits.append((self.batch, self.epoch))

    recorder = Recorder(batch=0, epoch=0)
    recorder.commits = []
    callbacks = [
        hvd_keras.elastic.UpdateBatchStateCallback(recorder),
        hvd_keras.elastic.UpdateEpochStateCallback(recorder),
        hvd_keras.elastic.CommitStateCallback(recorder, batches_per_commit=2),
    ]
    model.fit(
        np.ones((4, 2)), np.ones((4, 1)), batch_size=1, epochs=2, verbose=0, callbacks=callbacks
    )
    out["elastic_commits"] = recorder.commits
    out["elastic_final"] = (recorder.batch, recorder.epoch)

    local = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    for w in local.weights:
        w.assign(tf.fill(w.shape, float(r)))
    local.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    keep = list(local.layers[0].weights)
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(1, local_variables=keep)
    local.fit(np.ones((2, 2)), np.ones((2, 1)), epochs=1, verbose=0, callbacks=[callback])
    out["bcast_local_vars"] = [float(np.mean(w)) for w in local.get_weights()]


def _graph_shapes(hvd, tf, keras, r, out):
    # Horovod's TF2 examples: one step of a tf.function that, on the first batch,
    # broadcasts the Keras 3 model's and optimizer's variables (Variable.assign needs
    # the broadcast value's static shape at trace time)
    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([2, 3]) * (r + 1)))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    try:
        step(True)
        step(False)
        out["bcast_in_function"] = [w.tolist() for w in model.get_weights()]
    except Exception as exc:  # today's failure, recorded for the test's message
        out["bcast_in_function"] = f"{type(exc).__name__}: {exc}"

    # the static shapes the collectives' graph outputs keep (traced only, not run)
    def collectives(x):
        return {
            "allreduce": hvd.allreduce(x),
            "broadcast": hvd.broadcast(x, 0),
            "grouped_allreduce": hvd.grouped_allreduce([x, x[0]])[1],
            "allgather": hvd.allgather(x),
            "alltoall": hvd.alltoall(x),
            "alltoall_splits": hvd.alltoall(x, splits=[2, 2])[1],
            "reducescatter": hvd.reducescatter(x),
            "join": hvd.join(),
        }

    spec = tf.TensorSpec([4, 3], tf.float32)
    traced = tf.function(collectives).get_concrete_function(spec).structured_outputs
    out["graph_shapes"] = {
        k: v.shape.as_list() if v.shape.rank is not None else "unknown rank"
        for k, v in traced.items()
    }


def _compat_worker():
    import keras
    import tensorflow as tf

    import ringcore.keras as hvd_keras
    import ringcore.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    out: dict = {}
    _op_errors(hvd, tf, r, out)
    _ops(hvd, tf, r, out)
    _session_graph(hvd, tf, r, out)
    _local_gradients(hvd, hvd_keras, tf, keras, r, out)
    _optimizer_gradients(hvd, tf, keras, r, out)
    _elastic(hvd, hvd_keras, tf, keras, r, out)
    _graph_shapes(hvd, tf, keras, r, out)
    hvd.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_compat_worker, np=N, env=WORKER_ENV, timeout=150)


MISMATCH = ["CollectiveMismatchError", "FailedPreconditionError"]


def test_a_mismatch_between_ranks_raises_failed_precondition_as_horovods_ops(results):
    for res in results:
        assert res["shape_mismatch_eager"] == MISMATCH
        assert res["root_mismatch"] == MISMATCH


def test_a_mismatch_inside_a_graph_raises_failed_precondition_with_our_message(results):
    for res in results:
        assert res["dtype_mismatch_graph"] == ["FailedPreconditionError"]
        assert res["root_mismatch_session"] == ["FailedPreconditionError"]
        assert "graph.shape" in res["shape_mismatch_graph_message"]
        assert "shape" in res["shape_mismatch_graph_message"].lower()
        assert res["in_step_after_graph_error"] == 1.0  # sum of ranks 0 and 1: still in step


def test_alltoall_without_splits_on_an_uneven_first_dimension_raises_invalid_argument(results):
    for res in results:
        assert res["a2a_uneven_no_splits"] == ["InvalidArgumentError"]


def test_indexed_slices_with_min_max_or_scale_factors_raise_not_implemented(results):
    for res in results:
        assert res["slices_min"] == ["NotImplementedError"]
        assert res["slices_prescale"] == ["NotImplementedError"]
        assert res["grouped_slices_max"] == ["NotImplementedError"]


def test_grouped_allreduce_gathers_indexed_slices_beside_dense_tensors(results):
    want = np.array([[1.0, 1.0], [2.0, 2.0]])
    for res in results:
        np.testing.assert_allclose(res["grouped_slices_sum"], want)


def test_broadcast_global_variables_raises_in_eager_mode_and_builds_in_a_graph(results):
    for res in results:
        assert res["global_variables_eager"] == ["RuntimeError"]
        assert res["global_variables_graph"] == "NoOp"


def test_alltoall_returns_only_the_tensor_without_splits_and_int32_splits_with_them(results):
    for r, res in enumerate(results):
        np.testing.assert_allclose(res["a2a_equal"], [r + 10.0 * q for q in range(N)])
        assert res["a2a_splits_dtype"] == "int32"
        np.testing.assert_allclose(res["a2a_grad"], [1.0, 1.0])


def test_alltoall_to_a_rank_that_receives_nothing_gives_it_zero_rows(results):
    assert results[0]["a2a_zero_rows"] == (2, 3)
    np.testing.assert_array_equal(results[0]["a2a_zero_splits"], [2, 0])
    assert results[1]["a2a_zero_rows"] == (0, 3)
    np.testing.assert_array_equal(results[1]["a2a_zero_splits"], [0, 0])


def test_topology_ops_give_rank_local_rank_size_and_local_size(results):
    for r, res in enumerate(results):
        assert res["topology_ops"] == [r, r, N, N]


def test_inplace_broadcast_assigns_the_roots_value_to_each_variable(results):
    for res in results:
        var, value = res["broadcast_inplace"]
        np.testing.assert_allclose(var, [1.0] * 3)
        np.testing.assert_allclose(value, [1.0] * 3)
        assert res["broadcast_object_fn"] == {"from": 1}


def test_grouped_allgather_and_reducescatter_act_on_each_tensor_of_the_list(results):
    for res in results:
        ints, floats = res["grouped_allgather"]
        np.testing.assert_array_equal(ints, [0, 1, 1])
        np.testing.assert_allclose(floats, [[0.0, 0.0], [1.0, 1.0]])
        np.testing.assert_allclose(res["grouped_reducescatter"][0], [3.0, 3.0])


def test_reducescatter_gradient_is_horovods_allgather_times_size_for_sum(results):
    for res in results:
        summed, averaged = res["rs_grads"]
        np.testing.assert_allclose(summed, [float(N)] * 4)
        np.testing.assert_allclose(averaged, [2.0] * 4)


def test_a_tf1_session_runs_collectives_in_the_order_they_were_built(results):
    for res in results:
        together, first_runs = res["session_graph"]
        assert together == [[0.0, 1.0, 1.0], [3.0] * 3]
        assert first_runs == 5.0  # its own run, and with each of the 4 later fetches


def test_local_layers_keep_their_gradient_divided_by_size_and_the_rest_is_averaged(results):
    for res in results:
        assert res["tape_local"] == [True, True]
        assert res["opt_local"] == [True, True]
    # the second Dense layer's gradient is its input (the first layer's output, whose
    # weights are rank+1), averaged over the ranks: equal on every rank
    for key in ("tape_shared", "opt_shared"):
        for a, b in zip(results[0][key], results[1][key], strict=True):
            np.testing.assert_allclose(a, b)


def test_optimizer_compute_gradients_reduces_once_and_accumulates_over_passes(results):
    for res in results:
        # each pass: the gradient -(1+2)/2 averaged over the ranks; no update after the
        # first pass, then the sum of both (Horovod's default: not averaged over passes)
        assert res["accumulated_trace"] == [(-1.5, 0.0), (-1.5, 3.0)]
        assert res["after_inf"] == [1.0, 1.0]


def test_sparse_as_dense_with_backward_passes_trains_an_embedding_in_fit(results):
    np.testing.assert_allclose(results[0]["sparse_fit_weights"], results[1]["sparse_fit_weights"])


def test_tensorflow_state_syncs_restores_and_commits_variables_and_attributes(results):
    for res in results:
        synced, restored, committed = res["tf_state"]
        assert synced == ([1.0, 1.0], 0, 10)
        assert restored == ([1.0, 1.0], 0)
        assert committed == [6.0, 6.0]


def test_keras_state_syncs_the_model_from_rank_0(results):
    assert results[0]["keras_state_synced"] == results[1]["keras_state_synced"]
    assert np.all(np.array(results[1]["keras_state_synced"][0]) == 0.0)


def test_elastic_callbacks_commit_every_n_batches_and_track_batch_and_epoch(results):
    for res in results:
        # 4 batches an epoch, commit every 2 and at each epoch's end
        assert res["elastic_commits"] == [(1, 0), (3, 0), (0, 1), (1, 1), (3, 1), (0, 2)]
        assert res["elastic_final"] == (0, 2)


def test_broadcast_callback_leaves_local_variables_alone(results):
    for r, res in enumerate(results):
        kernel0, bias0, kernel1, bias1 = res["bcast_local_vars"]
        assert (kernel0, bias0) == (float(r), float(r))
        assert (kernel1, bias1) == (1.0, 1.0)


def test_broadcast_of_keras_3_variables_inside_a_tf_function_gives_every_rank_rank_0s(
    results,
):
    # the first step of Horovod's tensorflow2_synthetic_benchmark.py and
    # tensorflow2_mnist.py: every rank's weights end up the same
    weights = [res["bcast_in_function"] for res in results]
    assert isinstance(weights[0], list), weights[0]
    assert weights[0] == weights[1]


def test_collectives_in_a_graph_keep_the_static_shape_they_know_at_trace_time(results):
    assert results[0]["graph_shapes"] == {
        "allreduce": [4, 3],
        "broadcast": [4, 3],
        "grouped_allreduce": [3],
        "allgather": [None, 3],
        "alltoall": [None, 3],
        "alltoall_splits": [N],
        "reducescatter": [None, 3],
        "join": [],
    }
