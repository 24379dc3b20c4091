"""The user's optimizer rebuilt over new parameter objects (FSDP2 replaces each
parameter by a sharded one): the same class, parameter groups and hyper-parameters."""

from __future__ import annotations

from typing import Any


def names_of(model: Any, optimizer: Any) -> list[list[str]]:
    """Each parameter group of ``optimizer`` as the names of its parameters in ``model``
    (before the model changes); a parameter not in the model is an error naming it."""
    by_id = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    f"{type(optimizer).__name__}'s parameter group {i} holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of {type(model).__name__}; "
                    "build the optimizer over model.parameters()"
                )
            names.append(by_id[id(p)])
        groups.append(names)
    return groups


def rebuild(optimizer: Any, model: Any, groups: list[list[str]]) -> Any:
    """A new optimizer of ``optimizer``'s class over ``model``'s current parameters of
    the same names, each group with its own hyper-parameters; state is not carried (a
    fresh optimizer: load a checkpoint's state after)."""
    if any(optimizer.state.values()):
        raise ValueError(
            f"the {type(optimizer).__name__} given already holds state (it has stepped); "
            "strategy='fsdp' rebuilds the optimizer over the sharded parameters and would "
            "lose it. Pass a fresh optimizer and resume from a checkpoint instead"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    new_groups = []
    for names, group in zip(groups, optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        new_groups.append({**settings, "params": [params[n] for n in names]})
    rebuilt = type(optimizer)(new_groups, **_constructor_defaults(optimizer))
    return rebuilt


def _constructor_defaults(optimizer: Any) -> dict[str, Any]:
    """The keyword arguments the class takes of ``optimizer.defaults`` (the groups carry
    their own values; these fill any key a group lacks)."""
    import inspect

    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
