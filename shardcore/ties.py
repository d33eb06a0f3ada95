"""Tied weights: one ``nn.Parameter`` held by several modules (a language model's input embedding and
output head). Several operations give each holder its own new parameter, silently untying them:
``model.to(xla_device)``, ``to_empty``, ``set_model_state_dict`` on a meta-device model,
``copy.deepcopy`` followed by a cast. Every part of shardcore that does one of those (the plan, the
checkpoints, both backends, the conformance suite) finds the ties and restores them here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

from torch import nn


class Site(NamedTuple):
    """One holder of a parameter: ``module._parameters[attr]``, the module at ``path``."""

    path: str
    module: nn.Module
    attr: str

    @property
    def name(self) -> str:
        return f"{self.path}.{self.attr}" if self.path else self.attr


def tie_groups(model: nn.Module) -> list[list[Site]]:
    """For each parameter held by more than one module, every site holding it, in module order."""
    by_id: dict[int, list[Site]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append(Site(path, mod, attr))
    return [sites for sites in by_id.values() if len(sites) > 1]


def retie(groups: list[list[Site]]) -> None:
    """Make every site of each group hold its first site's current parameter again."""
    for first, *rest in groups:
        shared = first.module._parameters[first.attr]
        for site in rest:
            site.module._parameters[site.attr] = shared


@contextlib.contextmanager
def ties_kept(model: nn.Module) -> Iterator[None]:
    """Run the body (a device move, a state-dict load) and then tie again what was tied before."""
    groups = tie_groups(model)
    yield
    retie(groups)


def retie_like(source: nn.Module, copy: nn.Module) -> None:
    """Tie in ``copy`` (a structural copy of ``source`` with the same module paths) the parameters
    that ``source`` ties; ``copy``'s first holder of each group keeps its parameter."""
    modules = dict(copy.named_modules(remove_duplicate=False))
    for first, *rest in tie_groups(source):
        shared = modules[first.path]._parameters[first.attr]
        for site in rest:
            modules[site.path]._parameters[site.attr] = shared


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{name that a checkpoint does not store: the name that it stores}`` for every tied parameter
    of an unwrapped model, as ``save_pretrained`` decides: the names a Transformers model lists in
    ``_tied_weights_keys`` are the ones dropped; otherwise the first name in module order is kept."""
    declared: set[str] = set()
    for prefix, sub in model.named_modules():
        declared.update(f"{prefix}.{k}" if prefix else k for k in getattr(sub, "_tied_weights_keys", None) or ())
    out: dict[str, str] = {}
    for group in tie_groups(model):
        names = [site.name for site in group]
        kept = next((n for n in names if n not in declared), names[0])
        out.update({n: kept for n in names if n != kept})
    return out
