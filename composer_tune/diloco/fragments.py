"""Split a model into Streaming DiLoCo fragments: contiguous runs of its layers.

The model's direct children are its units, except that a ``ModuleList`` / ``Sequential`` child
(a decoder's ``layers``) contributes each element as a unit, so the native decoder's units are
``tok_embeddings, layers.0, ..., layers.{L-1}, norm, output`` (a transformers-backend model's
``model.embed_tokens, model.layers.0, ..., model.norm, lm_head``). Units without parameters (or
whose parameters an earlier unit holds: a tied output projection) are dropped and the rest are cut into ``num_fragments`` contiguous groups whose parameter counts are
as even as the unit boundaries allow: fragment ``k`` ends at the unit boundary whose cumulative
parameter count is closest to ``(k + 1) / num_fragments`` of the total. Even fragments keep the
per-sync payload (and so the peak bandwidth Streaming DiLoCo is designed to lower) steady.

Each fragment is an ``nn.ModuleList`` that refers to the model's own submodules, so torchft's
outer step updates the model's ``Parameter`` objects in place.
"""

from __future__ import annotations

from torch import nn


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's direct children in order, with list-like children expanded element-wise;
    a child that holds the decoder layers (``model.decoder_layers()``, e.g. a transformers
    model's ``model``) is walked into, so its layers are units of their own."""
    layers = model.decoder_layers() if hasattr(model, "decoder_layers") else None
    units: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                units.extend((f"{prefix}{name}.{i}", unit) for i, unit in child.named_children())
            elif layers is not None and any(sub is layers for sub in child.modules()):
                walk(f"{prefix}{name}.", child)
            else:
                units.append((f"{prefix}{name}", child))

    walk("", model)
    return units


def _cut_points(sizes: list[int], num_fragments: int) -> list[int]:
    """Indices where fragments 1..F-1 start: each the boundary closest to its share of the
    total, leaving at least one unit to every fragment."""
    cumulative = [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    total = cumulative[-1]
    cuts: list[int] = []
    previous = 0
    for k in range(1, num_fragments):
        target = total * k / num_fragments
        # A boundary after unit `previous` at the earliest, and early enough that every later
        # fragment still gets a unit.
        lowest, highest = previous + 1, len(sizes) - (num_fragments - k)
        cut = min(range(lowest, highest + 1), key=lambda i: (abs(cumulative[i] - target), i))
        cuts.append(cut)
        previous = cut
    return cuts


def split_into_fragments(
    model: nn.Module, num_fragments: int
) -> tuple[list[nn.ModuleList], list[list[str]]]:
    """Fragments of ``model`` and, for each, the names of the units it holds.

    Raises ``ValueError`` when the model has fewer parameter-holding units than fragments, when
    a parameter is shared by units in different fragments (it would get two outer updates per
    round), or when a parameter sits directly on the root module (no unit holds it).
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    # Units without parameters of their own are dropped: parameter-free modules, and an output
    # projection tied to the embedding (an earlier unit's parameter).
    units, seen = [], set()
    for name, module in model_units(model):
        params = {id(param) for param in module.parameters()}
        if params - seen:
            units.append((name, module))
        seen |= params
    if len(units) < num_fragments:
        raise ValueError(
            f"num_fragments={num_fragments} but {type(model).__name__} has only {len(units)} "
            f"units with parameters ({[name for name, _ in units]})"
        )
    sizes = [sum(p.numel() for p in module.parameters()) for _, module in units]
    bounds = [0, *_cut_points(sizes, num_fragments), len(units)]
    groups = [units[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]

    owner: dict[int, int] = {}
    for index, group in enumerate(groups):
        for unit_name, module in group:
            for param_name, param in module.named_parameters():
                first = owner.setdefault(id(param), index)
                if first != index:
                    raise ValueError(
                        f"parameter {unit_name}.{param_name} is shared between fragments {first} "
                        f"and {index}; use fewer fragments or untie it"
                    )
    uncovered = [name for name, p in model.named_parameters() if id(p) not in owner]
    if uncovered:
        raise ValueError(
            f"parameters {uncovered} belong to no fragment: they sit directly on "
            f"{type(model).__name__} instead of inside a submodule"
        )
    fragments = [nn.ModuleList(module for _, module in group) for group in groups]
    return fragments, [[name for name, _ in group] for group in groups]
