"""ringcore.keras on 2 Gloo ranks: ``model.fit`` with ``DistributedOptimizer`` gives the
weights of one process on the full batch (SGD), with and without
``backward_passes_per_step``; the callbacks (broadcast, metric averaging, learning
rate warm-up and schedule, best-model checkpoint); ``load_model`` of a model saved
with a wrapped optimizer; ``SyncBatchNormalization`` against one process's
``BatchNormalization`` on the whole batch. One launch of 2 ranks runs it all."""

from __future__ import annotations

import numpy as np
import pytest

from ringcore.testing import run_workers

N = 2
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
LR = 0.1


def _data():
    rng = np.random.default_rng(1)
    features = rng.normal(size=(16, 4)).astype(np.float32)
    target = (features @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.3).astype(np.float32)
    return features, target


def _model(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def _fit_equivalence(hvd, keras, r):
    features, target = _data()
    mine = slice(8 * r, 8 * r + 8)
    out = {}
    # single process, full batch of 16: the reference
    ref = _model(keras, 0)
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ref.fit(features, target, batch_size=16, epochs=3, shuffle=False, verbose=0)
    out["reference"] = [w.copy() for w in ref.get_weights()]
    # 2 ranks, 8 rows each, averaged gradients
    model = _model(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    model.fit(features[mine], target[mine], batch_size=8, epochs=3, shuffle=False, verbose=0)
    out["distributed"] = model.get_weights()
    # 2 ranks, 2 micro-batches of 4 accumulated per update
    acc = _model(keras, 0)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(LR), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    acc.compile(optimizer=opt, loss="mse")
    acc.fit(features[mine], target[mine], batch_size=4, epochs=3, shuffle=False, verbose=0)
    out["accumulated"] = acc.get_weights()
    out["accumulated_updates"] = int(opt.iterations.numpy())
    return out, model


class _Recorder:
    """Builds a callback that copies logs and the learning rate."""

    @staticmethod
    def make(keras, store, key):
        class Recorder(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
                store.setdefault(f"{key}/lr", []).append(lr)

            def on_epoch_end(self, epoch, logs=None):
                store.setdefault(f"{key}/logs", []).append(dict(logs or {}))

        return Recorder()


def _callbacks(hvd, keras, r, tmp):
    features, target = _data()
    mine = slice(8 * r, 8 * r + 8)
    out: dict = {}
    model = _model(keras, 100 + r)  # different initial weights on every rank
    out["initial_rank0"] = _model(keras, 100).get_weights()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", metrics=["mae"]
    )
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=f"{tmp}/best_{r}.keras")
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        _Recorder.make(keras, out, "raw"),
        hvd.callbacks.MetricAverageCallback(),
        _Recorder.make(keras, out, "avg"),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2),
        _Recorder.make(keras, out, "warmup"),
        best,
    ]
    model.fit(
        features[mine],
        target[mine],
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        validation_data=(features[mine], target[mine]),
    )
    out["after_broadcast_fit"] = model.get_weights()

    # rank 0 alone built (or restored) its optimizer before fit: the ranks must still
    # broadcast the same variables (rank 0 broadcast 2 more, and both waited for ever)
    lopsided = _model(keras, 200 + r)
    lopsided.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(LR)), loss="mse")
    if r == 0:
        lopsided.optimizer.build(lopsided.trainable_variables)
    lopsided.fit(
        features[mine],
        target[mine],
        batch_size=8,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    out["lopsided_weights"] = lopsided.get_weights()
    out["lopsided_optimizer"] = [np.array(v) for v in lopsided.optimizer.variables]
    import os

    out["best_written"] = os.path.exists(f"{tmp}/best_{r}.keras")
    return out


def _save_and_load(hvd, keras, r, model, tmp):
    path = f"{tmp}/saved.keras"
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    out = {
        "loaded_distributed": type(loaded.optimizer).__dict__.get("_ring_base") is not None,
        "loaded_iterations": int(loaded.optimizer.iterations.numpy()),
        "loaded_equal": all(
            np.array_equal(a, b) for a, b in zip(loaded.get_weights(), model.get_weights())
        ),
    }
    features, target = _data()
    mine = slice(8 * r, 8 * r + 8)
    loaded.fit(
        features[mine],
        target[mine],
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[
            hvd.callbacks.LearningRateScheduleCallback(LR, lambda e: 0.5**e, start_epoch=1),
            _Recorder.make(keras, out, "schedule"),
        ],
    )
    out["loaded_fit"] = loaded.get_weights()
    other = _model(keras, 7 + r)
    hvd.broadcast_global_variables(0, model=other)
    out["global_broadcast"] = other.get_weights()
    try:
        hvd.broadcast_global_variables(0)
    except ValueError as exc:
        out["global_error"] = str(exc)
    return out


BN_ROWS = (6, 10)  # uneven batches: the statistics weigh each rank by its rows


def _batch_norm_run(tf, layer, x, upstream, graph):
    """A training-mode call of ``layer`` on ``x`` and its gradients for the loss
    ``sum(output * upstream)``, eagerly or inside a ``tf.function``."""
    x, upstream = tf.constant(x), tf.constant(upstream)
    layer.build(x.shape)

    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            output = layer(x, training=True)
            loss = tf.reduce_sum(output * upstream)
        return (output, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

    output, d_x, d_gamma, d_beta = (tf.function(step) if graph else step)()
    moving = [layer.moving_mean.numpy(), layer.moving_variance.numpy()]
    return [output.numpy(), d_x.numpy(), d_gamma.numpy(), d_beta.numpy(), *moving]


def _sync_batch_norm(keras, r):
    """SyncBatchNormalization on this rank's rows against BatchNormalization on all 16
    (every rank computes the reference); the gamma and beta gradients summed over the
    ranks are the full batch's."""
    import tensorflow as tf

    import ringcore.tensorflow as hvd_tf

    rng = np.random.default_rng(3)
    x = rng.normal(2.0, 3.0, size=(16, 2, 2, 3)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    start = sum(BN_ROWS[:r])
    mine = slice(start, start + BN_ROWS[r])
    ref = _batch_norm_run(tf, keras.layers.BatchNormalization(momentum=0.5), x, upstream, False)
    out = {"bn_reference": [ref[0][mine], ref[1][mine], *ref[2:]]}
    for mode, graph in (("eager", False), ("graph", True)):
        layer = hvd_tf.SyncBatchNormalization(momentum=0.5)
        got = _batch_norm_run(tf, layer, x[mine], upstream[mine], graph)
        got[2:4] = [hvd_tf.allreduce(g, op=hvd_tf.Sum).numpy() for g in got[2:4]]
        out[f"bn_{mode}"] = got
    config = keras.saving.serialize_keras_object(layer)
    out["bn_deserialized"] = type(keras.saving.deserialize_keras_object(config)).__name__
    try:
        hvd_tf.SyncBatchNormalization(fused=True)
    except ValueError as exc:
        out["bn_fused_error"] = str(exc)
    return out


def _keras_worker(tmp):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import ringcore.keras as hvd

    hvd.init()
    r = hvd.rank()
    out, model = _fit_equivalence(hvd, keras, r)
    out.update(_callbacks(hvd, keras, r, tmp))
    out.update(_save_and_load(hvd, keras, r, model, tmp))
    out.update(_sync_batch_norm(keras, r))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("keras"))
    return run_workers(_keras_worker, np=N, args=(tmp,), env=WORKER_ENV, timeout=150)


def _close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


@pytest.mark.timeout(180)
def test_fit_on_two_ranks_gives_the_weights_of_one_full_batch_process(results):
    for res in results:
        _close(res["distributed"], res["reference"])


@pytest.mark.timeout(180)
def test_backward_passes_per_step_accumulates_then_reduces_once_per_update(results):
    for res in results:
        _close(res["accumulated"], res["reference"])
        assert res["accumulated_updates"] == 3  # 6 batches, 3 updates


@pytest.mark.timeout(180)
def test_broadcast_callback_makes_every_rank_start_from_rank_0(results):
    _close(results[0]["after_broadcast_fit"], results[1]["after_broadcast_fit"], tol=0)
    assert not all(
        np.allclose(a, b)
        for a, b in zip(results[0]["initial_rank0"], results[1]["after_broadcast_fit"])
    )  # training moved them away from the start


@pytest.mark.timeout(180)
def test_broadcast_callback_agrees_when_only_rank_0_built_its_optimizer(results):
    _close(results[0]["lopsided_weights"], results[1]["lopsided_weights"], tol=0)
    _close(results[0]["lopsided_optimizer"], results[1]["lopsided_optimizer"], tol=0)


@pytest.mark.timeout(180)
def test_metric_average_callback_replaces_logs_by_the_mean_over_ranks(results):
    for epoch in range(3):
        raw = [res["raw/logs"][epoch] for res in results]
        assert raw[0]["mae"] != raw[1]["mae"]  # the ranks see different data
        for res in results:
            avg = res["avg/logs"][epoch]
            for key in ("loss", "mae", "val_loss", "val_mae"):
                assert avg[key] == pytest.approx(np.mean([x[key] for x in raw]), rel=1e-6)


@pytest.mark.timeout(180)
def test_learning_rate_warmup_and_schedule_callbacks(results):
    for res in results:
        assert res["warmup/lr"] == pytest.approx([LR / 2, LR * 0.75, LR])
        assert res["schedule/lr"] == pytest.approx([LR, LR * 0.5, LR * 0.25])


@pytest.mark.timeout(180)
def test_best_model_checkpoint_writes_on_rank_0_only(results):
    assert results[0]["best_written"] is True
    assert results[1]["best_written"] is False


@pytest.mark.timeout(180)
def test_load_model_restores_and_rewraps_the_optimizer(results):
    for res in results:
        assert res["loaded_distributed"] is True
        assert res["loaded_iterations"] == 3
        assert res["loaded_equal"] is True
    _close(results[0]["loaded_fit"], results[1]["loaded_fit"], tol=0)
    _close(results[0]["global_broadcast"], results[1]["global_broadcast"], tol=0)
    assert "model=" in results[0]["global_error"]


@pytest.mark.timeout(180)
def test_sync_batch_normalization_on_uneven_batches_equals_one_process_on_the_whole_batch(
    results,
):
    # output and input gradient of this rank's rows, summed gamma/beta gradients and
    # the moving statistics, eagerly and inside a tf.function
    for res in results:
        for mode in ("bn_eager", "bn_graph"):
            _close(res[mode], res["bn_reference"], tol=1e-4)
        assert res["bn_deserialized"] == "SyncBatchNormalization"
        assert "fused=True" in res["bn_fused_error"]
