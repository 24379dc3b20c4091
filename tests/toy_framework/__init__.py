"""A framework from outside ``estimators``: least squares in numpy, one register call.

``import toy_framework`` registers ``"numpy-linear"``: a :class:`LinearModel` given to
``RingEstimator`` trains with this folder's own loop (``_linear.train_linear``: full-batch
gradient descent on every rank's shard, the gradients averaged over the ring), and its
``RingModel`` predicts with this folder's Arrow function. Only public names are used:
``estimators.frameworks`` (the plug-in API), ``Store``'s methods, ``ringcore.data`` and
``ringcore.torch``.
"""

from estimators.frameworks import register_framework

from ._linear import LinearModel, NumpyLinearFramework

__all__ = ["LinearModel", "NumpyLinearFramework"]

register_framework(
    "numpy-linear",
    NumpyLinearFramework,
    detect=lambda model: isinstance(model, LinearModel),
    takes="a toy_framework.LinearModel",
)
