"""Which of Horovod's examples ``tools/examples.py`` runs, how, and the failures measured
as the example's own (``KNOWN``).

``Example.args`` are the example's own command-line flags, chosen to cap its work (few
steps or one epoch, small batches) so that the whole run takes minutes; ``{data}`` is
the folder of the generated MNIST file, ``{address}`` the local Ray's address.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Launch(enum.Enum):
    HOROVODRUN = "horovodrun"  # 2 ranks with horovodrun's variables
    TORCHRUN = "torchrun"  # torchrun --standalone --nproc-per-node 2
    # elastic: ringrun --min-np 1 --max-np 2 --host-discovery-script <prints localhost:2>
    RINGRUN = "ringrun"
    RAY = "ray"  # the example is the driver of a local Ray (num_cpus=2)


@dataclass(frozen=True)
class Example:
    path: str  # under examples/
    launch: Launch
    args: tuple[str, ...] = ()
    standins: str = ""  # what stands in for a download (shown in docs/conformance.md)


@dataclass(frozen=True)
class Known:
    """A measured failure that is not ringcore's: counted as ``kind`` when the first
    error line contains ``match`` (anything else is reported as a failure)."""

    kind: str  # "not ours" | "not runnable here"
    match: str
    reason: str


_MNIST_KERAS = "MNIST file (keras load_data)"
_MNIST_TORCH = "MNIST file (torchvision stand-in)"
_RESNET = "small net for torchvision `models.resnet50`"
_TF_BENCH = ("--model", "MobileNetV3Small", "--batch-size", "4", "--num-iters", "2")
_TF_BENCH_STEPS = ("--num-batches-per-iter", "2", "--no-cuda")
_TORCH_BENCH = ("--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2")
_IMAGENET = ("--epochs", "1", "--batch-size", "4", "--val-batch-size", "4", "--no-cuda")

EXAMPLES: tuple[Example, ...] = (
    Example(
        "tensorflow2/tensorflow2_synthetic_benchmark.py",
        Launch.HOROVODRUN,
        (*_TF_BENCH, "--num-warmup-batches", "1", *_TF_BENCH_STEPS),
    ),
    Example(
        "tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        Launch.HOROVODRUN,
        (*_TF_BENCH, *_TF_BENCH_STEPS),
    ),
    Example("tensorflow2/tensorflow2_mnist.py", Launch.HOROVODRUN, (), _MNIST_KERAS),
    Example("tensorflow2/tensorflow2_keras_mnist.py", Launch.HOROVODRUN, (), _MNIST_KERAS),
    Example(
        "tensorflow2/tensorflow2_mnist_data_service.py",
        Launch.HOROVODRUN,
        ("{data}/compute-service.json",),
        _MNIST_KERAS,
    ),
    Example(
        "tensorflow2/tensorflow2_mnist_data_service_train_fn_compute_side_dispatcher.py",
        Launch.HOROVODRUN,
        (),
        _MNIST_KERAS,
    ),
    Example(
        "tensorflow2/tensorflow2_mnist_data_service_train_fn_training_side_dispatcher.py",
        Launch.HOROVODRUN,
        (),
        _MNIST_KERAS,
    ),
    Example("keras/keras_mnist.py", Launch.HOROVODRUN, (), _MNIST_KERAS),
    Example("keras/keras_mnist_advanced.py", Launch.HOROVODRUN, ("--epochs", "1"), _MNIST_KERAS),
    Example("keras/keras_imagenet_resnet50.py", Launch.HOROVODRUN, ("--epochs", "1")),
    Example(
        "pytorch/pytorch_mnist.py",
        Launch.HOROVODRUN,
        ("--epochs", "1", "--test-batch-size", "64", "--data-dir", "{data}"),
        _MNIST_TORCH,
    ),
    Example("pytorch/pytorch_synthetic_benchmark.py", Launch.HOROVODRUN, _TORCH_BENCH, _RESNET),
    Example("pytorch/pytorch_imagenet_resnet50.py", Launch.HOROVODRUN, _IMAGENET, _RESNET),
    Example(
        "pytorch/pytorch_lightning_mnist.py",
        Launch.HOROVODRUN,
        ("--epochs", "1", "--no-cuda", "--data-dir", "{data}"),
        _MNIST_TORCH,
    ),
    Example(
        "elastic/pytorch/pytorch_mnist_elastic.py",
        Launch.RINGRUN,
        ("--epochs", "1", "--test-batch-size", "64", "--data-dir", "{data}"),
        _MNIST_TORCH,
    ),
    Example(
        "elastic/pytorch/pytorch_synthetic_benchmark_elastic.py",
        Launch.RINGRUN,
        (*_TORCH_BENCH, "--num-iters", "2"),
        _RESNET,
    ),
    Example(
        "elastic/pytorch/pytorch_imagenet_resnet50_elastic.py", Launch.RINGRUN, _IMAGENET, _RESNET
    ),
    Example(
        "elastic/tensorflow/tensorflow_keras_mnist_elastic.py",
        Launch.RINGRUN,
        ("--epochs", "1", "--batches-per-epoch", "4"),
        _MNIST_KERAS,
    ),
    Example(
        "elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", Launch.RINGRUN, (), _MNIST_KERAS
    ),
    Example("elastic/tensorflow2/tensorflow2_mnist_elastic.py", Launch.RINGRUN, (), _MNIST_KERAS),
    Example(
        "elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py",
        Launch.RINGRUN,
        (*_TF_BENCH, "--num-warmup-batches", "1", *_TF_BENCH_STEPS),
    ),
    Example(
        "ray/basic_ray_elastic.py",
        Launch.RAY,
        ("--epochs", "1", "--data-dir", "{data}"),
        _MNIST_TORCH,
    ),
    Example("ray/pytorch_ray_elastic.py", Launch.RAY, ("--epochs", "1"), _MNIST_TORCH),
    Example("ray/tensorflow2_mnist_ray.py", Launch.RAY, ("--address", "{address}"), _MNIST_KERAS),
)

_NOT_OURS, _NOT_HERE = "not ours", "not runnable here"
_OPT_VARIABLES = Known(
    _NOT_OURS,
    "'list' object is not callable",
    "Keras 3: in its first step the example broadcasts `opt.variables()`, and a Keras 3 "
    "optimizer's `variables` is a list, not a method; the broadcast of `model.variables` "
    "just before it, inside the same `tf.function`, runs (it raised `Cannot take the "
    "length of shape with unknown rank` before the static-shape fix)",
)
_RUN_TF_FUNCTION = Known(
    _NOT_OURS,
    "unexpected keyword argument 'experimental_run_tf_function'",
    "Keras 3: `model.compile(..., experimental_run_tf_function=False)` (a Keras 2 "
    "argument) is rejected before training starts",
)
_TF1_SESSION = Known(
    _NOT_OURS,
    "has no attribute 'ConfigProto'",
    "TensorFlow 1: the example builds a `tf.ConfigProto` and a `tf.Session` for "
    "`K.set_session` right after `hvd.init()`",
)
_DATA_SERVICE = Known(
    _NOT_HERE,
    "No module named 'horovod.",
    "needs Horovod's tf.data compute service (`horovod.tensorflow.data.compute_service`, "
    "`horovod.runner.common.util.env` and a config file written by the compute job "
    "`horovodrun` starts); ringtrain has no equivalent",
)
_TENSORBOARD = Known(
    _NOT_HERE,
    "No module named 'tensorboard'",
    "`torch.utils.tensorboard` needs the `tensorboard` package, not installed here; the "
    "example also reads ImageNet folders (`torchvision.datasets.ImageFolder`, not in the "
    "stand-in)",
)

KNOWN: dict[str, Known] = {
    "tensorflow2/tensorflow2_synthetic_benchmark.py": _OPT_VARIABLES,
    "tensorflow2/tensorflow2_mnist.py": _OPT_VARIABLES,
    "tensorflow2/tensorflow2_keras_synthetic_benchmark.py": _RUN_TF_FUNCTION,
    "tensorflow2/tensorflow2_keras_mnist.py": _RUN_TF_FUNCTION,
    "elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py": _RUN_TF_FUNCTION,
    "tensorflow2/tensorflow2_mnist_data_service.py": _DATA_SERVICE,
    "tensorflow2/tensorflow2_mnist_data_service_train_fn_compute_side_dispatcher.py": (
        _DATA_SERVICE
    ),
    "tensorflow2/tensorflow2_mnist_data_service_train_fn_training_side_dispatcher.py": (
        _DATA_SERVICE
    ),
    "keras/keras_mnist.py": _TF1_SESSION,
    "keras/keras_imagenet_resnet50.py": _TF1_SESSION,
    "elastic/tensorflow/tensorflow_keras_mnist_elastic.py": _TF1_SESSION,
    "keras/keras_mnist_advanced.py": Known(
        _NOT_OURS,
        "cannot import name 'ImageDataGenerator'",
        "Keras 3 has no `keras.preprocessing.image.ImageDataGenerator` (imported first); "
        "the example also builds a `tf.ConfigProto` (TensorFlow 1) and calls "
        "`fit_generator` and `Adadelta(lr=...)` (Keras 2)",
    ),
    "pytorch/pytorch_imagenet_resnet50.py": _TENSORBOARD,
    "elastic/pytorch/pytorch_imagenet_resnet50_elastic.py": _TENSORBOARD,
    "pytorch/pytorch_lightning_mnist.py": Known(
        _NOT_OURS,
        "unexpected keyword argument 'gpus'",
        "Lightning 2: `Trainer(accelerator='horovod', gpus=...)` is rejected (both were "
        "removed from Lightning; so was the `validation_epoch_end` hook the example "
        "defines)",
    ),
    "ray/basic_ray_elastic.py": Known(
        _NOT_HERE,
        "No module named 'horovod.ray.elastic'",
        "imports Horovod's `horovod.ray.elastic.TestDiscovery` (a test host discovery "
        "that adds and removes GPU hosts) and asks for GPUs; ringtrain's "
        "`ElasticRayExecutor` takes no custom discovery (`override_discovery=False` "
        "raises ValueError) and this machine has no GPU",
    ),
    "ray/pytorch_ray_elastic.py": Known(
        _NOT_HERE,
        "GpuUnavailableError",
        "asks for GPUs (`ElasticRayExecutor(settings, use_gpu=True, ...)`) and this Ray "
        "has none: our executor says so before it starts a worker",
    ),
    "ray/tensorflow2_mnist_ray.py": Known(
        _NOT_OURS,
        "unexpected keyword argument 'num_slots'",
        "an older `horovod.ray` API: `RayExecutor(settings, num_hosts=2, num_slots=4, "
        "cpus_per_slot=8)`; Horovod's own `RayExecutor` at this commit takes neither "
        "`num_slots` nor `cpus_per_slot` either (the run would also need 64 CPUs, and "
        "its `compile(experimental_run_tf_function=...)` fails on Keras 3)",
    ),
}
