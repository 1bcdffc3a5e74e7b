"""``patch_model`` and ``unpatch``: a model's eligible linears swapped in place.

``patch_model`` runs in three steps: ``_collect`` finds what to swap (and
merges the groups of ``merge=True``), ``_precompile`` compiles every kernel
in parallel workers and prepares the merged groups, ``_swap`` puts the
``DecodeLinear`` modules (and SwiGLU MLPs: merged gate/up, or a model's own
``gate_up_proj``) in place. ``unpatch`` puts the
original modules back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from .. import contract
from ..contract import MAX_M
from ..planning import plans
from ..tactics import check_ms
from .gate_up import GateUpSwiGLUMLP, gate_up_refusal, gate_up_scale
from .linear import DecodeLinear, fp8_linear_scale, ineligibility
from .merge import (MERGED_GROUPS, MergedPart, SwiGLUMLP, merge_linears, merge_refusal,
                    swiglu_refusal)

logger = logging.getLogger("warpsplitk")


@dataclass
class PatchReport:
    """What ``patch_model`` did: qualified names swapped, and (name, reason) skipped."""

    swapped: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    #: with merge=True: the qualified names of each merged group
    merged: list = field(default_factory=list)
    #: with merge=True: the MLPs whose gate/up run with the SwiGLU epilogue
    swiglu: list = field(default_factory=list)

    def __str__(self):
        lines = [f"warpsplitk: swapped {len(self.swapped)} nn.Linear, skipped {len(self.skipped)}"
                 + (f", merged {len(self.merged)} groups" if self.merged else "")
                 + (f", {len(self.swiglu)} MLPs with the SwiGLU epilogue" if self.swiglu else "")]
        by_reason = {}  # grouped: a large model repeats the same few reasons
        for name, reason in self.skipped:
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"  skipped {shown}: {reason}")
        return "\n".join(lines)


def linear_ineligibility(module, ms=range(1, MAX_M + 1)):
    """Why ``patch_model`` leaves ``module`` alone, or None when it can swap it:
    a plain ``nn.Linear`` or an FP8 linear (``fp8_linear_scale``) the kernel
    takes, without forward hooks."""
    fp8 = is_fp8_linear(module)
    if type(module) is not nn.Linear and not fp8:
        # subclasses (quantised, LoRA, MultiheadAttention's out_proj) have their own semantics
        return f"{type(module).__name__} is not a plain nn.Linear"
    if module._forward_hooks or module._forward_pre_hooks:
        return "has forward hooks, which the swap would drop"
    if "forward" in module.__dict__:
        return "its forward is overridden on the instance (e.g. accelerate hooks)"
    if fp8:
        name, reason = fp8_linear_scale(module)
        return reason or ineligibility(module.weight, module.bias, ms, getattr(module, name))
    return ineligibility(module.weight, module.bias, ms)


def is_fp8_linear(module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` subclass holding an e4m3 weight
    (transformers' ``FP8Linear``, ``FbgemmFp8Linear``): ``patch_model``
    swaps it where ``fp8_linear_scale`` recognises its scales."""
    return isinstance(module, nn.Linear) and contract.is_fp8(getattr(module, "weight", None))


def patch_model(model: nn.Module, plan=None, ms=range(1, MAX_M + 1), filter=None,
                jobs=None, progress=print, merge=False) -> PatchReport:
    """Replace, in place, every eligible ``nn.Linear`` of ``model`` by a
    ``DecodeLinear`` sharing its Parameters, compiling the kernels now (before
    any graph capture). Eligible: a plain ``nn.Linear`` without forward hooks,
    BF16 weight on CUDA whose shape the kernel supports for every M in ``ms``
    and, if given, ``filter(name, module)`` is true. Returns a ``PatchReport``,
    also logged at INFO (skips at DEBUG).

    The kernels are compiled first, ``jobs`` worker processes at a time
    (default: ``precompile.default_jobs()``), into the
    disk cache the swapped modules then load from.

    ``plan``: a ``DecodePlan``, None (the default (cost model)), or ``"auto"``:
    the plan for this GPU (``warpsplitk.planning.plan_cache``), tuning first, with
    ``progress``, the shapes of the eligible linears it lacks and keeping
    them for the next process.

    ``merge=True``: each module's ``q_proj``, ``k_proj``, ``v_proj`` and
    ``gate_proj``, ``up_proj`` (transformers' Llama-family names) become
    parts of one merged weight run in one launch (:mod:`warpsplitk.nn.merge`),
    keeping their parameter names; ``report.merged`` lists the groups (FP8
    linears merge too where their scales stack: ``merge_refusal``). A
    Llama-family MLP's merged gate/up, and an MLP's own ``[gate; up]``
    ``gate_up_proj`` (Phi-3, GLM: :mod:`warpsplitk.nn.gate_up`), run with the
    SwiGLU epilogue; ``report.swiglu`` lists those MLPs."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    plans.check_plan(plan)
    ms = check_ms(ms)
    report = PatchReport()
    found = _collect(model, ms, filter, merge, report)
    plan = _precompile(found, plan, ms, jobs, progress)
    _swap(model, found, plan, ms, report)
    logger.info("warpsplitk: swapped %d nn.Linear, skipped %d", len(report.swapped),
                len(report.skipped))
    for name, reason in report.skipped:
        logger.debug("warpsplitk: skipped %s: %s", name, reason)
    return report


def unpatch(model: nn.Module) -> list:
    """Put back the ``nn.Linear`` behind every ``DecodeLinear`` of ``model``
    (the original objects when they came from ``patch_model``/``from_linear``).
    Returns the qualified names restored."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    restored = []
    _replace(model, SwiGLUMLP, SwiGLUMLP.to_original, [])
    _replace(model, GateUpSwiGLUMLP, GateUpSwiGLUMLP.to_original, [])
    _replace(model, MergedPart, MergedPart.to_linear, restored)
    _replace(model, DecodeLinear, DecodeLinear.to_linear, restored)
    return restored


# --------------------------------------------------------------- the steps


@dataclass
class _Found:
    """What ``_collect`` found to swap."""

    #: id -> eligible nn.Linear outside the merged groups, in model order
    linears: dict = field(default_factory=dict)
    #: the merged groups (``MergedGroup``), in place, not prepared yet
    groups: list = field(default_factory=list)
    #: the MLPs whose merged gate/up run with the SwiGLU epilogue
    mlps: list = field(default_factory=list)
    #: the MLPs holding one [gate; up] projection (``GATE_UP_MLPS``) to run so
    gate_up_mlps: list = field(default_factory=list)
    #: id -> eligible FP8 linear (``is_fp8_linear``), in model order
    fp8: dict = field(default_factory=dict)


def _collect(model, ms, filter, merge, report) -> _Found:
    """Step 1, what to swap: with ``merge``, each group that can merge is
    merged in place now (its parts run ``F.linear`` until ``_precompile``
    prepares it: the kernels compile from the merged weight); then the
    eligible linears left. Refusals go to ``report.skipped``."""
    found = _Found()
    if isinstance(model, nn.Linear):
        report.skipped.append(("", "the root module cannot be replaced in place; "
                                   "use DecodeLinear.from_linear"))
    for names, places, linears in (_merge_groups(model, filter, report) if merge else []):
        parts = merge_linears(linears, plan=None, ms=ms, prepare=False)
        for (parent, attr), part in zip(places, parts):
            setattr(parent, attr, part)
        found.groups.append(parts[0].group)
        report.merged.append(names)
        owner = places[0][0]
        if [a for _, a in places] == ["gate_proj", "up_proj"] and swiglu_refusal(owner) is None:
            parts[0].group.swiglu = True
            found.mlps.append(owner)
    if merge:
        found.gate_up_mlps = [m for name, m in model.named_modules()
                              if gate_up_refusal(m, ms) is None
                              and (filter is None or filter(f"{name}.gate_up_proj",
                                                            m.gate_up_proj))]
    for name, _, _, child in _children(model, nn.Linear):
        if id(child) in found.linears:
            continue
        reason = ("excluded by filter" if filter is not None and not filter(name, child)
                  else linear_ineligibility(child, ms))
        if reason is not None:
            report.skipped.append((name, reason))
        elif is_fp8_linear(child):
            found.fp8[id(child)] = child
        else:
            found.linears[id(child)] = child
    return found


def _precompile(found, plan, ms, jobs, progress):
    """Step 2: the plan (``"auto"``: tuned first for the shapes it lacks, the
    FP8 linears' and FP8 merged groups' as FP8), every kernel compiled in
    parallel workers into the disk cache, the merged groups prepared from it.
    Returns the plan."""
    linears = list(found.linears.values())
    shapes = [tuple(lin.weight.shape) for lin in linears]
    shapes += [tuple(g.weight.shape) for g in found.groups
               if ineligibility(g.weight, g.bias, ms) is None]
    fp8 = {id(m): (m.weight, getattr(m, fp8_linear_scale(m)[0]), m.bias)
           for m in found.fp8.values()}
    fp8.update({id(g): (g.weight, g.scale, g.bias) for g in found.groups if g.scale is not None})
    plan = plans.resolve_plan(plan, shapes, ms, progress=progress, jobs=jobs,
                              fp8_shapes=plans.fp8_tuning_shapes(fp8))
    # the SwiGLU kernels: merged [gate; up] groups and MLPs' own gate_up_proj
    swiglu = [(g, g.scale) for g in found.groups if g.swiglu]
    swiglu += [(m.gate_up_proj, gate_up_scale(m.gate_up_proj)) for m in found.gate_up_mlps]
    _precompile_weights(linears + [g for g in found.groups if g.scale is None], plan, ms, jobs)
    _precompile_weights([g for g, scale in swiglu if scale is None], plan, ms, jobs, swiglu=True)
    plans.precompile_fp8(fp8, ms, jobs, plan=plan)
    plans.precompile_fp8({id(g): (g.weight, scale, g.bias) for g, scale in swiglu
                          if scale is not None}, ms, jobs, plan=plan, swiglu=True)
    for group in found.groups:
        group.plan = plan
        group.prepare()
    return plan


def _swap(model, found, plan, ms, report):
    """Step 3: each SwiGLU MLP wrapped, each eligible linear replaced by a
    ``DecodeLinear`` sharing its Parameters (it loads its kernels from the
    disk cache)."""
    _replace(model, nn.Module, SwiGLUMLP, report.swiglu, only={id(m) for m in found.mlps})
    _replace(model, nn.Linear, lambda lin: DecodeLinear.from_linear(lin, plan, ms),
             report.swapped, only=found.linears)
    _replace(model, nn.Linear, lambda lin: DecodeLinear.from_fp8_module(lin, plan, ms),
             report.swapped, only=found.fp8)
    # after the linears: each wraps its gate_up_proj's DecodeLinear
    _replace(model, nn.Module, lambda mlp: GateUpSwiGLUMLP(mlp, plan, ms), report.swiglu,
             only={id(m) for m in found.gate_up_mlps})


# ---------------------------------------------------------------- helpers


def _children(model, kind):
    """(qualified name, parent, attribute, module) for every submodule of type
    ``kind``, in named_modules order, once per path (a module reachable
    through two parents comes twice)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        if name and isinstance(module, kind):
            parent_name, _, attr = name.rpartition(".")
            yield name, modules[parent_name], attr, module


def _replace(model, kind, make, names, only=None):
    """Each submodule of type ``kind`` (with ``only``: whose id is in it)
    replaced by ``make(module)``, made once per module: one shared by two
    parents stays shared. The first name of each goes to ``names``."""
    made = {}
    for name, parent, attr, child in list(_children(model, kind)):
        if only is not None and id(child) not in only:
            continue
        if id(child) not in made:
            made[id(child)] = make(child)
            names.append(name)
        setattr(parent, attr, made[id(child)])


def _merge_groups(model, filter, report):
    """``[(names, parents and attributes, linears)]``: each module's
    ``MERGED_GROUPS`` whose linears can merge; refusals go to
    ``report.skipped`` under the group's names."""
    places, holders = _sharing(model)
    groups, seen = [], set()
    for name, module in model.named_modules():
        for attrs in MERGED_GROUPS:
            linears = [getattr(module, a, None) for a in attrs]
            if not all(isinstance(lin, nn.Linear) for lin in linears) \
                    or any(id(lin) in seen for lin in linears):
                continue  # not such a group, or a layer shared by two parents: merged once
            names = [f"{name}.{a}" if name else a for a in attrs]
            if filter is not None and not all(filter(n, lin) for n, lin in zip(names, linears)):
                report.skipped.append((names[0], "excluded by filter"))
                continue
            reason = merge_refusal(linears) or _shared_refusal(linears, places, holders)
            if reason is not None:
                report.skipped.append((" + ".join(names), f"not merged: {reason}"))
                continue
            seen |= {id(lin) for lin in linears}
            groups.append((names, [(module, a) for a in attrs], linears))
    return groups


def _sharing(model):
    """``({id(linear): {(id(parent), attribute)}}, {id(Parameter): {id(module)}})``:
    where each linear sits and which modules hold each Parameter."""
    places, holders = {}, {}
    for _, parent, attr, child in _children(model, nn.Linear):
        places.setdefault(id(child), set()).add((id(parent), attr))
    for module in dict(model.named_modules(remove_duplicate=False)).values():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(id(module))
    return places, holders


def _shared_refusal(linears, places, holders):
    """Why merging would break sharing, or None: a linear used in a second
    place would be left with no weight, a Parameter another module holds
    too (tied) split from its twin."""
    if any(len(places[id(lin)]) > 1 for lin in linears):
        return "a linear is also used elsewhere in the model"
    if any(holders[id(p)] != {id(lin)} for lin in linears
           for p in lin._parameters.values() if p is not None):
        return "a Parameter is also held by another module (tied)"
    return None


def _precompile_weights(modules, plan, ms, jobs, swiglu=False):
    """The kernels of ``modules`` (anything with ``weight`` and ``bias``:
    linears, merged groups; with ``swiglu``, gate/up groups' SwiGLU kernels),
    compiled in parallel workers into the disk cache."""
    with_bias = [mod.weight for mod in modules if mod.bias is not None]
    without = [mod.weight for mod in modules if mod.bias is None]
    for weights, has_bias in ((with_bias, True), (without, False)):
        if weights:
            plans.precompile_for(weights, plan, ms, jobs, progress=None, has_bias=has_bias,
                                 swiglu=swiglu)


__all__ = ["PatchReport", "linear_ineligibility", "is_fp8_linear", "patch_model", "unpatch"]
