"""What a fit shows and records while it runs, beside its checkpoints: the estimators'
side of the run-services layer (:mod:`ringcore.runs`, shared with ray_runner).

``_progress``: rank 0's ``StepReporter`` (the progress file and TensorBoard scalars);
``_report``: the driver's ``HistoryPrinter`` printing each epoch and showing the
progress; ``_tensorboard``: a run's scalars read back from its store; ``_mlflow``: the
active MLflow run's params, metrics and model.
"""
