"""Sharded checkpoints: each rank writes its own shard of the model and optimizer state
(torch.distributed.checkpoint), to a local folder or an fsspec URL; they load on any
number of ranks (resharded). Under ring and ddp, the same call writes rank 0's replica
in the same format, so a loop needs one code path."""

from __future__ import annotations

from typing import Any


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _writer(path: str, storage_options: dict | None) -> Any:
    import torch.distributed.checkpoint as dcp

    if not _is_url(path):
        return dcp.FileSystemWriter(path.removeprefix("file://"))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path, **(storage_options or {}))


def _reader(path: str, storage_options: dict | None) -> Any:
    import torch.distributed.checkpoint as dcp

    if not _is_url(path):
        return dcp.FileSystemReader(path.removeprefix("file://"))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path, **(storage_options or {}))


def _state(run: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if run.optimizer is None:
        return {"model": get_model_state_dict(run.module)}
    with run.local_step():  # torch initialises an empty state by a zero step
        model, optim = get_state_dict(run.module, run.optimizer)
    return {"model": model, "optim": optim}


def save_sharded(run: Any, path: str, storage_options: dict | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    from ._group import ensure_process_group

    ensure_process_group()
    dcp.save(_state(run), storage_writer=_writer(path, storage_options))


def load_sharded(run: Any, path: str, storage_options: dict | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from ._group import ensure_process_group

    ensure_process_group()
    state = _state(run)
    dcp.load(state, storage_reader=_reader(path, storage_options))
    if "optim" in state:
        set_state_dict(
            run.module, run.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optim"],
        )  # fmt: skip
    else:
        set_model_state_dict(run.module, state["model"])
