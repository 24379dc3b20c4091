"""Four torch.distributed programs written the way users write them, for the launcher tests.

None of them imports ringcore, spark_runner or ray_runner: each reads only the torchrun
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...) through the
framework that reads it: ``dist.init_process_group("gloo")`` with env:// (``ddp``,
``fsdp2``), Lightning's torchelastic environment (``lightning_ddp``: detected from
TORCHELASTIC_RUN_ID, like torchrun's ranks), and accelerate's state under the Hugging
Face Trainer (``hf_trainer``: distributed when LOCAL_RANK is set). A launcher that sets the
contract as torchrun does runs them unchanged; tests/_torch_programs_main.py is the same
as a script, for the launchers' file forms and for torchrun itself.

Each program returns ``{"world_size", "rank", "digest", "seconds"}``: ``digest`` is a
fingerprint of the final parameters, the same on every rank of a run when the ranks
trained in step. ``run_all`` leaves no default process group behind (Lightning and the
Trainer leave theirs: it ends each program's group after it, as a script that runs
several of them would),
and keeps torch's count of groups (``_end_group``), so the next group in the process
gets fresh rendezvous keys: ``run_all`` runs the four one after another in one process.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
SAMPLES = 32  # the global data set, sharded by rank
FEATURES = 8


def digest(named: Iterable[tuple[str, Any]]) -> str:
    """A fingerprint of named tensors: sha256 over their names and bytes, by name."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _data(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a fixed regression data set (``x[rank::world]``)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return x[rank::world], y[rank::world]


def _end_group() -> None:
    """Destroy the default group; under the bare torchrun, keep torch's count of groups.

    ``destroy_process_group()`` resets that count to 0, and the count names the next
    default group, whose Gloo rendezvous keys live in the same store (torchrun's agent
    store, or one that outlives the group through references to it): the next group
    would read the addresses the destroyed one left there and fail with "Connection
    refused" or hang (pytorch#55967, #114585; measured: 5 of 5 torchrun runs of six
    init/destroy cycles failed). Under torchrun the count is kept, so every group gets
    fresh keys. Under a ringtrain launcher its guard on ``init_process_group`` gives each
    group a fresh prefix of the store, and the count is left as torch sets it: kept
    across the jobs of a reused process (a Spark Python worker) it named an FSDP2 mesh's
    group after one of the last job's, which torch could no longer resolve."""
    if not dist.is_initialized():
        return
    if "RING_RANK" in os.environ:  # a ringtrain launcher: its guard gives fresh keys
        dist.destroy_process_group()
        return
    world = dist.distributed_c10d._world
    count = world.group_count
    dist.destroy_process_group()
    world.group_count = count


def _sgd_steps(model: nn.Module, rank: int, world: int) -> None:
    """STEPS steps of SGD on this rank's shard of the data (a DDP or FSDP2 module)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data(rank, world)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _result(world_size: int, rank: int, fingerprint: str, start: float) -> dict[str, Any]:
    return {
        "world_size": world_size,
        "rank": rank,
        "digest": fingerprint,
        "seconds": round(time.perf_counter() - start, 2),
    }


# --------------------------------------------------------------------------- ddp


def ddp() -> dict[str, Any]:
    """DistributedDataParallel on Gloo, the env:// rendezvous, a few SGD steps."""
    start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
    )
    _sgd_steps(model, rank, world)
    return _result(world, rank, digest(model.module.named_parameters()), start)


# --------------------------------------------------------------------------- fsdp2


class _Stack(nn.Module):
    """Three linear layers in a ModuleList (the unit FSDP2 shards one by one)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, 16), nn.Linear(16, 16), nn.Linear(16, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def fsdp2() -> dict[str, Any]:
    """FSDP2 (``fully_shard``) on Gloo on CPU: each layer, then the root; the full state
    gathered at the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sgd_steps(model, rank, world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return _result(world, rank, digest(full.items()), start)


# --------------------------------------------------------------------------- lightning


def _lightning_module() -> Any:
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def lightning_ddp() -> dict[str, Any]:
    """A Lightning Trainer with DDP on Gloo: Lightning detects the torchelastic
    environment from the variables and forms the group itself."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    start = time.perf_counter()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    pl.seed_everything(0, verbose=False)
    model = _lightning_module()
    x, y = _data(0, 1)  # the whole set: Lightning adds the DistributedSampler
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        # the loader is in memory on purpose; Lightning 2.6 still uses torch's LeafSpec
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")
        trainer.fit(model, loader)
    world, rank = dist.get_world_size(), dist.get_rank()
    return _result(world, rank, digest(model.named_parameters()), start)


# --------------------------------------------------------------------------- hf trainer


class _Sentences(torch.utils.data.Dataset):
    """Fixed token sequences labelled by their first token's parity."""

    def __init__(self, n: int = 16, length: int = 8, vocab: int = 50):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": ids[0] % 2,
        }


def hf_trainer() -> dict[str, Any]:
    """A Hugging Face Trainer on a tiny BERT built from its config (nothing downloaded):
    accelerate under the Trainer forms the Gloo group from the variables."""
    import transformers
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        PrinterCallback,
        Trainer,
        TrainingArguments,
    )

    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            ddp_backend="gloo",
            ddp_find_unused_parameters=False,
            disable_tqdm=True,
            seed=0,
        )
        try:
            trainer = Trainer(model=model, args=args, train_dataset=_Sentences())
            trainer.remove_callback(PrinterCallback)  # the end-of-training metrics line
            trainer.train()
            world, rank = trainer.args.world_size, trainer.args.process_index
        finally:
            _reset_accelerate()
    return _result(world, rank, digest(model.named_parameters()), start)


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state (its singletons keep the destroyed group
    as "initialized"), so a later Trainer in this process forms a group again."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# --------------------------------------------------------------------------- all of them

PROGRAMS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": ddp,
    "fsdp2": fsdp2,
    "lightning_ddp": lightning_ddp,
    "hf_trainer": hf_trainer,
}


def run_all(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the named programs (default: all four) one after another: {name: result}."""
    names = list(PROGRAMS) if names is None else names
    unknown = sorted(set(names) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"no program named {unknown}; the programs are {sorted(PROGRAMS)}")
    return {name: _run(name) for name in names}


def _run(name: str) -> dict[str, Any]:
    """One program, then the end of its group (Lightning and the Trainer leave theirs).
    Its objects go first, while the group lives: torch deadlocks when a DDP module
    outlives ``destroy_process_group()`` and is freed later (its Reducer then holds the
    last reference to the Gloo group, whose destructor joins Gloo's worker thread while
    holding the GIL that thread needs to free a Python object; seen on a reused Spark
    worker with the DDP program's module freed after the group)."""
    try:
        return PROGRAMS[name]()
    finally:
        gc.collect()
        _end_group()
