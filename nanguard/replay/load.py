"""What a replay loads from an incident into the script's own objects: the model's state (refused when it
does not fit before a tensor is copied), its non-persistent buffers, another model's state, the
optimizer's (when it holds the parameters the captured one held) and the objects given to init.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..incident import IncidentError
from ..rank.modules import (MORE_MODELS, NON_PERSISTENT, OPTIMIZER_PARAMS, STEP_PART, dtensor, local_optimizer,
                             non_persistent_buffers)


def check_model_state(model: nn.Module, state: dict[str, Any], path: str) -> None:
    """Refuse a state that does not fit ``model`` before a single tensor is copied into it."""
    expected = model.state_dict()
    if not state and expected:
        raise IncidentError(path, "holds no model state: the model given to nanguard.init was gone when the"
                                  " incident was captured (the script kept no reference to it), so this"
                                  " incident cannot be replayed; keep the model in a variable")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [k for k in expected if k in state and isinstance(state[k], torch.Tensor)
              and tuple(state[k].shape) != tuple(expected[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
    if shapes:
        problems.append("other shapes for " + ", ".join(
            f"{k} {list(state[k].shape)} vs {list(expected[k].shape)}" for k in shapes[:5]))
    sharded = [k for k in expected if k in state and isinstance(state[k], torch.Tensor)
               and dtensor(state[k]) != dtensor(expected[k])]
    if sharded:
        where = "the incident's" if dtensor(state[sharded[0]]) else "the script's model's"
        problems.append(f"{sharded[0]}{' ...' if len(sharded) > 1 else ''} is sharded (FSDP2's DTensor) in {where}"
                        " state only: the model is wrapped another way than in the run that made it")
    if problems:
        raise IncidentError(path, f"does not fit the script's model {type(model).__name__} "
                                  f"({'; '.join(problems)}); nothing was loaded. Replay with the "
                                  "script and model configuration that made the incident")


def unpersisted(saved: Any, model: nn.Module, path: str) -> list[tuple[str, torch.Tensor]]:
    """(name, value) of what an incident holds of ``model``'s non-persistent buffers, checked before
    anything is loaded: IncidentError unless each is a tensor of the model's own buffer of that
    name, of its shape and dtype (the folder may come from anywhere)."""
    own = non_persistent_buffers(model)
    if not isinstance(saved, dict) or any(
            not isinstance(value, torch.Tensor) or name not in own or value.shape != own[name].shape
            or value.dtype != own[name].dtype for name, value in saved.items()):
        raise IncidentError(path, f"holds non-persistent buffers that do not fit the script's model"
                                  f" {type(model).__name__} (names, shapes or dtypes); nothing was loaded."
                                  " Replay with the script and model configuration that made the incident")
    return list(saved.items())


def load_other_model(extra: Any, prefix: str, model: nn.Module, path: str, loaded: set[int] | None = None) -> bool:
    """Load what an incident's extra states hold of the model whose names begin with ``prefix``
    (a bare init()'s roots after the first: ``MORE_MODELS``), once checked to fit ``model``;
    False when it holds none (an incident from before they were captured). IncidentError, with
    nothing loaded, for anything else (the folder may come from anywhere). ``loaded``: ids of the
    tensors loaded already (a model holding an earlier root, a child the script called first),
    which are left as they are (the forward that ran may have saved them for its backward); the
    model's own are added."""
    saved = extra.get(MORE_MODELS) if isinstance(extra, dict) else None
    if saved is None or (isinstance(saved, dict) and prefix not in saved):
        return False
    record = saved.get(prefix) if isinstance(saved, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict) or not all(
            isinstance(key, str) for key in record["model"]):
        raise IncidentError(path, f"holds a record of the model {prefix} that is not a state dict; nothing"
                                  " of it was loaded. The incident folder is damaged or was not written by"
                                  " nanguard")
    check_model_state(model, record["model"], path)
    load_into(model, record["model"], unpersisted(record.get(NON_PERSISTENT, {}), model, path),
               set() if loaded is None else loaded)
    return True


def load_into(model: nn.Module, state: dict[str, Any], buffers: list[tuple[str, torch.Tensor]],
               loaded: set[int]) -> None:
    """Copy a checked ``state`` and non-persistent ``buffers`` into ``model``, but for the tensors
    in ``loaded`` (ids), which are left as they are; ``model``'s own are added to it."""
    tensors = {**model.state_dict(keep_vars=True), **dict(model.named_buffers())}
    with torch.no_grad():
        model.load_state_dict({k: v for k, v in state.items() if id(tensors[k]) not in loaded}, strict=False)
        for name, value in buffers:
            if id(tensors[name]) not in loaded:
                tensors[name].copy_(value)
    loaded.update(id(t) for t in tensors.values())


_KIND_SETTINGS = frozenset(("momentum", "dampening", "nesterov", "betas", "amsgrad", "alpha", "centered", "lr_decay",
                            "initial_accumulator_value", "rho", "lambd", "t0", "etas", "step_sizes", "max_iter",
                            "history_size", "line_search_fn", "momentum_decay", "beta2_decay", "d"))
"""settings of a parameter group that tell one kind of optimizer from another, the same in every
torch version (a newer torch adds others, which the comparison leaves out)"""


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], extra: Any, names: dict[int, str],
                   path: str) -> str | None:
    """Load an incident's optimizer state into ``optimizer`` when it holds the parameters the
    captured one held (by their ``names``; an incident from before they were kept: any); else a
    note of why not. IncidentError, nothing loaded, when it holds them but the state does not fit.
    A ZeroRedundancyOptimizer's state is its local optimizer's (this rank's shard: ``local_optimizer``)."""
    optimizer = local_optimizer(optimizer)
    held = _optimizer_params(extra, path)
    have = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]
    if held is not None and held != have:
        return (f"the incident's optimizer state (of {', '.join(held[:3])}{' ...' if len(held) > 3 else ''}) was"
                f" not loaded into the script's {type(optimizer).__name__}, which steps first here and holds"
                " other parameters: the script's own state was used")
    kinds = [sorted(set(group) & _KIND_SETTINGS) for group in (saved.get("param_groups") or [{}])[:1]
             + optimizer.param_groups[:1]]
    if len(kinds) == 2 and kinds[0] != kinds[1]:
        raise IncidentError(path, f"holds the state of another kind of optimizer than the script's"
                                  f" {type(optimizer).__name__} (its settings are {', '.join(kinds[0][:8])}; the"
                                  f" script's, {', '.join(kinds[1][:8])}): this is not the script that made the"
                                  " incident; nothing was loaded")
    if len(saved.get("param_groups", ())) != len(optimizer.param_groups):
        raise IncidentError(path, f"holds an optimizer state with {len(saved['param_groups'])} parameter group(s);"
                                  f" the script's {type(optimizer).__name__} has {len(optimizer.param_groups)};"
                                  " nothing was loaded")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise IncidentError(path, f"its optimizer state does not fit the script's {type(optimizer).__name__}"
                                  f" ({exc})") from exc
    return None


def load_states(objs: dict[str, Any], saved: dict[str, Any], path: str) -> None:
    """Load an incident's states (``saved[name]``: a GradScaler's, a scheduler's) into the script's
    ``objs``; IncidentError, nothing loaded, when one is not of the shape of the script's own: the
    same keys, each value of the same kind (a scheduler's ``load_state_dict`` sets whatever it is
    given as attributes, and a wrong one would fail only at the script's next ``step()``)."""
    own = {name: obj.state_dict() for name, obj in objs.items()}
    for name, obj in objs.items():
        wrong = _state_mismatch(own[name], saved[name]) if own[name] else None  # (a disabled scaler has none)
        if wrong:
            raise IncidentError(path, f"holds a {name} state that is not one of the script's {type(obj).__name__}"
                                      f" ({wrong}); the incident folder is damaged or was not written by nanguard"
                                      " for this script, and no state was loaded")
    loaded = []
    for name, obj in objs.items():
        try:
            obj.load_state_dict(saved[name])
            loaded.append(name)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            for back in [*loaded, name]:  # (as they were: a load that failed half-way leaves nothing behind)
                objs[back].load_state_dict(own[back])
            raise IncidentError(path, f"holds a {name} state that does not fit the script's {type(obj).__name__}"
                                      f" ({type(exc).__name__}: {exc}); no state was loaded") from exc


def _state_mismatch(own: dict, saved: Any) -> str | None:
    """How ``saved`` differs in shape from the state dict ``own``, or None."""
    if not isinstance(saved, dict):
        return f"a {type(saved).__name__}, not a dict"
    keys = sorted(map(str, set(saved) - set(own)))  # (one it lacks keeps the script's value)
    if keys:
        return f"keys {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''} it does not have"
    for key, value in own.items():
        other = saved.get(key)
        if value is None or other is None:
            continue
        if _kind(value) != _kind(other):
            return f"{key} is a {type(other).__name__}, not a {type(value).__name__} like its own"
        if isinstance(value, (list, tuple)) and len(value) != len(other):
            return f"{key} holds {len(other)} values, not {len(value)} like its own"
    return None


def _kind(value: Any) -> type:
    return next((kind for kind in (bool, (int, float), str, (list, tuple), dict, torch.Tensor)
                 if isinstance(value, kind)), object)


def _optimizer_params(extra: Any, path: str) -> list[str] | None:
    """The names of the captured optimizer's parameters (``OPTIMIZER_PARAMS``), or None for an
    incident from before they were kept; IncidentError for anything but a list of names."""
    held = extra.get(OPTIMIZER_PARAMS) if isinstance(extra, dict) else None
    if held is not None and not (isinstance(held, list) and all(isinstance(n, str) for n in held)):
        raise IncidentError(path, f"holds {OPTIMIZER_PARAMS} that are not a list of names; the incident folder"
                                  " is damaged or was not written by nanguard, and cannot be replayed")
    return held


def refuse_a_later_optimizer(extra: Any, path: str) -> None:
    """IncidentError when the incident was stopped at an optimizer that stepped after another in
    the same step (``STEP_PART``): its state is from after that other's update, which a replay,
    running the step's code from its start, would apply a second time before reaching it."""
    before = extra.get(STEP_PART, 0) if isinstance(extra, dict) else 0
    if type(before) is not int or before < 0:
        raise IncidentError(path, f"holds {STEP_PART}={before!r}, not a count; the incident folder is damaged"
                                  " or was not written by nanguard, and cannot be replayed")
    if before:
        raise IncidentError(path, f"was stopped at an optimizer that steps after {before} other optimizer step(s)"
                                  " of the same step (a GAN's generator after its critic): the incident holds"
                                  " the weights as they were at that stop, after the other update, which a replay"
                                  " of the step from its start would make again before reaching the stopped"
                                  " one. This step cannot be replayed; nothing was run. The incident's report"
                                  " (nanguard inspect) and its batch and weights are still there to read")
