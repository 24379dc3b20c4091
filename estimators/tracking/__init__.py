"""What a fit shows and records while it runs, beside its checkpoints.

``_progress``: rank 0's live progress file and TensorBoard scalars (``StepReporter``);
``_report``: the driver's poller printing each epoch and showing the progress;
``_tensorboard``: the event files, written and read back; ``_mlflow``: the active MLflow
run's params, metrics and model.
"""
