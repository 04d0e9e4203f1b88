"""A ``--factory package.module:function`` model: importing it, finding its blocks, probing its forward. The function
is called with ``vocab_size=`` when it takes that argument and the protocol's smaller vocabulary is in use
(:meth:`lnstab.check.subjects.Subject.with_vocab`); :func:`own_vocabulary_note` says what one without it costs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from lnstab.callbacks.sites import BLOCK_PATTERN, first_tensor
from lnstab.check import hf
from lnstab.check.runspec import Sites, exit_call, exits_caught, probe_forward
from lnstab.check.subjects import Shape, Subject, attention_problem, dropout_off, instrument_support
from lnstab.errors import LNStabError, first_line


@dataclass(frozen=True)
class FactoryRecipe:
    """``package.module:function`` called with ``kwargs``; ``path``: the ``sys.path`` a worker process needs."""

    spec: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    path: tuple[str, ...] = ()

    def build(self) -> nn.Module:
        for entry in reversed(self.path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        fn = import_factory(self.spec)
        kwargs = dict(self.kwargs)
        try:  # a config made for the model's own vocabulary names bos/eos ids the protocol's does not hold
            with exits_caught(), hf.outside_vocabulary_quiet() if "vocab_size" in kwargs else contextlib.nullcontext():
                model = fn(**kwargs)
        except SystemExit as exc:  # would end the check with the factory's status: sys.exit(0) read as 'nothing fails'
            raise LNStabError(f"--factory {self.spec!r} ended the process when called ({exit_call(exc)}); it must "
                              "return the model") from None
        except Exception as exc:
            raise LNStabError(f"--factory {self.spec!r} raised {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise LNStabError(f"--factory {self.spec!r} returned {type(model).__name__}; it must return a "
                              "torch.nn.Module")
        if "vocab_size" in kwargs:
            hf.special_ids_in_vocabulary(model, kwargs["vocab_size"])
        return model.float()  # the protocol trains in fp32 (a model built in half precision too, as --hf's)

    def with_vocab(self, vocab_size: int) -> FactoryRecipe | None:
        """The recipe with ``vocab_size=``, or ``None`` when the function takes no such argument."""
        if not takes_vocab_size(import_factory(self.spec)):
            return None
        return FactoryRecipe(self.spec, tuple({**dict(self.kwargs), "vocab_size": vocab_size}.items()), self.path)


def takes_vocab_size(fn: Callable[..., Any]) -> bool:
    """Whether a factory function has a ``vocab_size`` parameter."""
    try:
        return "vocab_size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


LOOKUP_ERRORS = (ImportError, AttributeError, ValueError)  # a dotted path that names nothing
SITE_OPTIONS = ("--embed-pattern", "--final-pattern", "--norm-pattern", "--head-pattern")  # each a Sites field


def import_user_module(where: str, module_name: str, passed_on: tuple[type[Exception], ...] = (),
                       hint: str = "") -> ModuleType:
    """``module_name``, a user's module, imported for ``where`` (``--factory 'm:f'``): one that ends the process
    (``sys.exit(0)`` would end the check with status 0, read as 'nothing fails') or raises is one line naming it;
    ``passed_on`` errors reach the caller as they are."""
    try:
        with exits_caught():
            return importlib.import_module(module_name)
    except passed_on:
        raise
    except SystemExit as exc:
        raise LNStabError(f"{where}: module {module_name!r} ended the process when imported ({exit_call(exc)}){hint}"
                          ) from None
    except Exception as exc:  # the module itself raised: the user's code, not a failed check (exit 3)
        raise LNStabError(f"{where}: module {module_name!r} cannot be imported ({type(exc).__name__}: "
                          f"{first_line(exc)})") from None


def import_factory(spec: str) -> Callable[[], Any]:
    """The function named by ``package.module:function`` (the working directory is importable, as with python -m)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LNStabError(f"--factory {spec!r} is not allowed; give package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = import_user_module(f"--factory {spec!r}", module_name, hint="; a factory's module must define the "
                                "function without running anything (put a script's own work under if __name__ == "
                                "'__main__':)")
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise LNStabError(f"--factory {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise LNStabError(f"--factory {spec!r}: {attr!r} is not callable")
    return fn


def resolve_types(option: str, value: str | None) -> tuple[type, ...]:
    """Comma-separated dotted class paths as classes."""
    if not value:
        return ()
    types = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        module_name, _, attr = item.rpartition(".")
        try:
            cls = getattr(import_user_module(f"{option} {item!r}", module_name, passed_on=LOOKUP_ERRORS), attr)
        except LNStabError:  # a ValueError too: the module's own one line
            raise
        except LOOKUP_ERRORS:
            raise LNStabError(f"{option} {item!r} cannot be imported; give dotted class paths") from None
        if not isinstance(cls, type):
            raise LNStabError(f"{option} {item!r} is not a class")
        types.append(cls)
    return tuple(types)


def check_block_types(model: nn.Module, module_types: str, types: tuple[type, ...]) -> None:
    """Refuse a ``--module-types`` class of torch's own layers (``types``, resolved from ``module_types`` in order)
    whose modules in ``model`` all have no submodules: ``torch.nn.LayerNorm`` or ``torch.nn.Linear`` selects pieces
    of the blocks, which the card would grade as the blocks (a user's own class, a block written with bare
    parameters, is taken)."""
    items = [v.strip() for v in module_types.split(",") if v.strip()]
    for item, cls in zip(items, types, strict=True):
        matched = [name for name, module in model.named_modules() if name and isinstance(module, cls)]
        refuse_torch_leaves(model, f"--module-types {item!r}", matched, "the class of the blocks")


def refuse_torch_leaves(model: nn.Module, what: str, names: list[str], give: str) -> None:
    """Refuse ``names`` (the blocks ``what`` selected) when every one is a layer of torch's own without submodules."""
    modules = [model.get_submodule(n) for n in names]
    if not modules or any(type(m).__module__.split(".")[:2] != ["torch", "nn"] or next(m.children(), None) is not None
                          for m in modules):
        return
    some = f"{', '.join(names[:2])}{', …' if len(names) > 2 else ''}"
    raise LNStabError(f"{what} is not allowed; it matched {len(names)} module{'s' * (len(names) != 1)} with no "
                      f"submodules ({some}), which cannot be Transformer blocks (a block holds its attention and MLP): "
                      f"give {give} that hold them")


def compile_regex(option: str, value: str | None) -> re.Pattern | None:
    """``value`` compiled, or a one-line error naming the option."""
    if value is None:
        return None
    try:
        return re.compile(value)
    except re.error as err:
        raise LNStabError(f"{option} {value!r} is not a valid regular expression ({err})") from None


def block_names(model: nn.Module, pattern: re.Pattern | None, types: tuple[type, ...],
                option: str = "--layer-pattern") -> list[str]:
    """Names of the modules that ``pattern`` (searched) or ``types`` select: in the order of the layer index the
    pattern's first group captures where it captures one in every name, else in module order (the order they were
    created, not necessarily the order they run).

    Raises:
        LNStabError: Two modules get one index (an unanchored pattern that also matches a block's submodules),
            naming ``option``, the flag that gave ``pattern``.
    """
    names = [name for name, module in model.named_modules()
             if name and ((pattern is not None and pattern.search(name)) or (types and isinstance(module, types)))]
    index = {n: layer_index(pattern, n) for n in names}
    if not names or any(i is None for i in index.values()):
        return names
    first: dict[int, str] = {}
    for n in names:
        other = first.setdefault(index[n], n)
        if other != n and n.startswith(other + "."):  # a block and its own submodule: one layer twice
            raise LNStabError(f"{option} '{pattern.pattern}' is not allowed; it gives layer index {index[n]} to "
                              f"{other!r} and {n!r}: anchor it where a block's name ends ($)")
    if len(first) < len(names):  # two families share indices (layers.0, extra.0): module order, as given
        return names
    return sorted(names, key=lambda n: index[n])


def layer_index(pattern: re.Pattern | None, name: str) -> int | None:
    """The layer index ``pattern``'s first group captures in ``name`` (``None``: no such integer group)."""
    match = pattern.search(name) if pattern is not None else None
    group = match.group(1) if match is not None and match.re.groups else None
    return int(group) if group is not None and group.isdigit() else None


def exact_pattern(names: list[str], pattern: re.Pattern | None = None) -> str:
    """A regex matching exactly these module names (as suffixes after a dot). The instruments order what it matches
    by the index its group captures where ``pattern`` gives each name one (a block's own index), else in module
    order."""
    indexed = pattern is not None and len({layer_index(pattern, n) for n in names} - {None}) == len(names)
    parts = []
    for n in names:
        match = pattern.search(n) if indexed else None
        if match is None:
            parts.append(re.escape(n))
        else:
            start, end = match.span(1)
            parts.append(re.escape(n[:start]) + "(" + re.escape(n[start:end]) + ")" + re.escape(n[end:]))
    return r"(?:^|\.)(?:" + "|".join(parts) + r")$"


def param_pattern(names: list[str], pattern: re.Pattern | None = None) -> str | None:
    """A parameter regex whose group is the layer index, when every block name ends in ``.<index>``, else when
    ``pattern``'s first group captures an integer in every name with the same text after it (an ``nn.ModuleDict``'s
    ``blocks.b0`` under ``blocks\.b(\d+)$``, an attribute's ``layer_0``; those got no gradient spread)."""
    parts = [re.fullmatch(r"(.*)\.(\d+)", n) for n in names]
    if names and all(p is not None for p in parts):
        prefixes = sorted({p.group(1) for p in parts})
        return r"(?:^|\.)(?:" + "|".join(re.escape(p) for p in prefixes) + r")\.(\d+)\."
    if not names or any(layer_index(pattern, n) is None for n in names):
        return None
    spans = [pattern.search(n).span(1) for n in names]
    suffixes = {n[end:] for n, (_, end) in zip(names, spans, strict=True)}
    if len(suffixes) != 1:
        return None
    prefixes = sorted({n[:start] for n, (start, _) in zip(names, spans, strict=True)})
    return r"(?:^|\.)(?:" + "|".join(re.escape(p) for p in prefixes) + r")(\d+)" + re.escape(suffixes.pop()) + r"\."


def factory_subject(
    spec: str,
    layer_pattern: str | None,
    module_types: str | None,
    seq_len: int,
    embed_pattern: str | None = None,
    final_pattern: str | None = None,
    norm_pattern: str | None = None,
    head_pattern: str | None = None,
    qk: tuple[str | None, str | None, int | None] = (None, None, None),
) -> Subject:
    """A model built by ``package.module:function``; its blocks are found by ``layer_pattern`` / ``module_types``,
    its sites by the other patterns (matched against its own module names, each refused when it matches none),
    its attention's q and k projections by ``qk`` = ``(q_pattern, k_pattern, n_head)`` when the instruments do not
    recognise them."""
    import_factory(spec)
    q_spec, k_spec, n_head = qk
    if (q_spec is None) != (k_spec is None) or (q_spec is None) != (n_head is None):
        raise LNStabError("--q-pattern, --k-pattern and --n-head go together; give all three or none")
    if n_head is not None and (isinstance(n_head, bool) or n_head < 1):
        raise LNStabError(f"--n-head={n_head} is not allowed; it must be an integer >= 1")
    pattern = compile_regex("--layer-pattern", layer_pattern)
    types = resolve_types("--module-types", module_types)
    given = {option: compile_regex(option, value) for option, value in zip(
        (*SITE_OPTIONS, "--q-pattern", "--k-pattern"),
        (embed_pattern, final_pattern, norm_pattern, head_pattern, q_spec, k_spec), strict=True)}

    recipe = FactoryRecipe(spec, (), tuple(p for p in sys.path if p))
    model = recipe.build()
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:  # no values to train (it failed inside the first forward, exit 3, with no error.txt)
        raise LNStabError(f"--factory {spec!r} returned a model with {len(meta)} tensor{'s' * (len(meta) != 1)} on "
                          f"the meta device (e.g. {meta[0]!r}), which hold no values; lnstab check trains real "
                          "weights: build it on the CPU, or call .to_empty(device='cpu') and initialise it")
    dropped = dropout_off(model)
    context = hf.context_of(getattr(model, "config", None))  # GPT-2's n_positions, nanoGPT's block_size, ...
    if default := (pattern is None and not types):
        pattern = re.compile(BLOCK_PATTERN)
    names = block_names(model, pattern, types)
    if default and not names:
        raise LNStabError(f"--factory {spec!r}: no numbered blocks (h.N, layers.N, blocks.N) found; "
                          "give --layer-pattern REGEX or --module-types package.Class")
    children = [n for n, _ in model.named_modules()][1:]
    some = (f"its modules: {', '.join(children[:6])}{', …' if len(children) > 6 else ''}" if children else
            f"it has no submodules, only the {type(model).__name__} itself")
    if not names:
        what = f"--layer-pattern {layer_pattern!r}" if layer_pattern else f"--module-types {module_types!r}"
        raise LNStabError(f"{what} matched no module of the model from --factory {spec!r} ({some})")
    if types:
        check_block_types(model, module_types, types)
    elif layer_pattern:
        refuse_torch_leaves(model, f"--layer-pattern {layer_pattern!r}", names, "a pattern of the blocks")
    exact_sites: dict[str, str | None] = {}
    for option, regex in given.items():  # searched in the model's own names, as --layer-pattern is: the stress
        matched = block_names(model, regex, (), option) if regex is not None else []  # runs see them under a prefix
        if regex is not None and not matched:
            raise LNStabError(f"{option} {regex.pattern!r} matched no module of the model from --factory {spec!r} "
                              f"({some})")
        exact_sites[option] = exact_pattern(matched) if matched else None
    q_exact = exact_sites["--q-pattern"]
    qk_sites = (q_exact, exact_sites["--k-pattern"], n_head) if q_exact else None
    # probed at most at its context: a longer --seq-len is then refused in one line (context_length)
    vocab, width, depth = probe_factory(model, spec, names, min(seq_len, context or seq_len))
    exact = exact_pattern(names, pattern)
    attention, logits = instrument_support(model, exact_sites["--head-pattern"], qk_sites)
    if qk_sites and not attention:  # the instrument's own reason, found again only on this path
        raise LNStabError(f"--q-pattern {q_spec!r} and --k-pattern {k_spec!r} are not allowed with --factory "
                          f"{spec!r}; {attention_problem(model, qk_sites)}")
    if qk_sites:
        check_head_widths(model, spec, exact_sites, n_head)
    sites = Sites(hidden_pattern=exact, block_pattern=exact, param_pattern=param_pattern(names, pattern),
                  attention=attention, logits=logits, qk=qk_sites,
                  **{option[2:].replace("-", "_"): exact_sites[option] for option in SITE_OPTIONS})
    name = "factory-" + spec.rpartition(":")[2].replace(".", "-")
    what = (f"{dropped} dropout{'s' if dropped != 1 else ''} (nn.Dropout modules, nn.MultiheadAttention's) set to 0"
            if dropped else "no nn.Dropout module nor nn.MultiheadAttention dropout")
    note = (f"train mode; {what}; dropout applied functionally and any other training-only branch run as in "
            "training")
    subject = Subject("checked", f"checked ({spec})", recipe, sites, Shape(depth, width, context, vocab), name=name,
                      dropout=note)
    subject.extra["probe"] = (spec, names, seq_len)
    subject.extra["parameters"] = sum(p.numel() for p in model.parameters())  # a tied weight once
    return subject


def own_vocabulary_note(subject: Subject, tokens: torch.Tensor) -> str | None:
    """One line, said before any run, on what a factory without a ``vocab_size`` argument costs: its runs train its
    own vocabulary where the protocol's (the distinct ids of the windows ``tokens``) is at least 2× smaller, and how
    to accept ``vocab_size``. ``None`` for any other subject or vocabulary."""
    recipe, shape = subject.recipe, subject.shape
    if not isinstance(recipe, FactoryRecipe) or "parameters" not in subject.extra or takes_vocab_size(
            import_factory(recipe.spec)):
        return None
    protocol = int(torch.unique(tokens).numel())
    if 2 * protocol > shape.vocab_size:
        return None
    own, width, total = shape.vocab_size, shape.n_embd, subject.extra["parameters"]
    return (f"--factory {recipe.spec} takes no vocab_size argument, so every run trains its own {own:,}-token "
            f"vocabulary: its {own:,} × {width} head alone is {own * width / 1e6:.3g}M of its {total / 1e6:.3g}M "
            f"parameters, {own / protocol:.3g}× the {protocol:,} tokens of the protocol vocabulary on this data; to "
            f"train at the protocol's, define {recipe.spec.rpartition(':')[2]}(vocab_size: int = {own}) and size its "
            "embedding and head by it")


def check_head_widths(model: nn.Module, spec: str, exact: dict[str, str | None], n_head: int) -> None:
    """Refuse q and k projections whose outputs do not split into ``n_head`` query heads and a whole number of key
    heads of the same size that divides it (grouped-query attention), read off one forward pass."""
    widths: dict[str, set[int]] = {"--q-pattern": set(), "--k-pattern": set()}
    with contextlib.ExitStack() as hooks, torch.no_grad():
        for option in widths:
            regex = re.compile(exact[option] or r"(?!)")
            for name, module in model.named_modules():
                if name and regex.search(name):
                    hooks.enter_context(module.register_forward_hook(
                        lambda m, a, out, option=option: widths[option].add(int(first_tensor(out).shape[-1]))))
        model(torch.zeros(1, 2, dtype=torch.long))
    silent = [option for option, seen in widths.items() if not seen]
    if silent:
        raise LNStabError(f"{silent[0]} is not allowed with --factory {spec!r}; the modules it matches did not run in "
                          "a forward pass")
    (q_width, *more_q), (k_width, *more_k) = sorted(widths["--q-pattern"]), sorted(widths["--k-pattern"])
    head = q_width // n_head if q_width % n_head == 0 else 0
    k_heads = k_width // head if head and k_width % head == 0 else 0
    if more_q or more_k or not k_heads or n_head % k_heads:
        raise LNStabError(f"--q-pattern, --k-pattern and --n-head {n_head} are not allowed with --factory {spec!r}; "
                          f"q's outputs are {q_width} wide and k's {k_width}, which do not split into {n_head} query "
                          "heads and whole key heads of the same size")


def probe_factory(model: nn.Module, spec: str, names: list[str], seq_len: int) -> tuple[int, int, int]:
    """Run ``model`` on token ids ``(2, T)``; check that logits are ``(2, T, V)`` and that every selected block
    ran; return ``V``, the block width and the depth: the blocks' calls in one forward (more than the blocks where
    one is looped, its weights shared across depth)."""
    widths: list[int] = []
    called: Counter[str] = Counter()
    modules = dict(model.named_modules())

    def keep(module: nn.Module, args: Any, out: Any) -> None:
        out = out[0] if isinstance(out, list | tuple) else out
        if isinstance(out, torch.Tensor) and out.dim() >= 1:
            widths.append(out.shape[-1])

    ids = torch.zeros(2, seq_len, dtype=torch.long)
    with contextlib.ExitStack() as hooks:
        hooks.enter_context(modules[names[0]].register_forward_hook(keep))
        for n in names:
            hooks.enter_context(modules[n].register_forward_hook(lambda m, a, o, n=n: called.update([n])))
        out = probe_forward(model, ids, f"--factory {spec!r}: the model")
    idle = [n for n in names if n not in called]
    if idle:
        raise LNStabError(f"--factory {spec!r}: block {idle[0]!r} (one of {len(names)} the layer pattern or types "
                          f"select) is never called by the model's forward; select only the blocks it runs")
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != (2, seq_len):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        last = (" (the last position only, as nanoGPT's GPT returns without targets: return every position's)"
                if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[1] == 1 < seq_len else "")
        raise LNStabError(f"--factory {spec!r} returned {got} for token ids (2, {seq_len}){last}; it must map token "
                          "ids (B, T) to logits (B, T, V): a tensor, the first item of a tuple, or a dict's 'logits'")
    if out.shape[-1] < 2 or not out.is_floating_point():
        raise LNStabError(f"--factory {spec!r} returned logits of shape {tuple(out.shape)} and dtype {out.dtype}; "
                          "it must return floating-point logits over at least 2 tokens")
    if not widths:
        raise LNStabError(f"--factory {spec!r}: block {names[0]!r} did not return a tensor")
    if torch.equal(out, blocks_perturbed(model, spec, [modules[n] for n in names], ids)):
        raise LNStabError(f"--factory {spec!r}: its logits depend on none of the {len(names)} blocks the layer "
                          "pattern or types select: noise added to what every one of them returns leaves the logits "
                          "unchanged (the forward calls them but discards what they return, e.g. 'block(x)' for "
                          "'x = block(x)'), so the card would grade blocks the model does not use")
    return int(out.shape[-1]), int(widths[0]), sum(called.values())


def blocks_perturbed(model: nn.Module, spec: str, blocks: list[nn.Module], ids: torch.Tensor) -> Any:
    """The logits of ``model`` on ``ids`` with seeded noise (about 1 % of its largest entry, at least 1) added to
    what each of ``blocks`` returns (the first item of a tuple or list)."""
    generator = torch.Generator().manual_seed(0)

    def noisy(module: nn.Module, args: Any, out: Any) -> Any:
        first = out[0] if isinstance(out, list | tuple) and out else out
        if not isinstance(first, torch.Tensor) or not first.is_floating_point():
            return None
        scale = float(first.detach().abs().amax()) * 1e-2 + 1.0 if first.numel() else 1.0
        moved = first + scale * torch.randn(first.shape, generator=generator).to(first)
        if first is out:
            return moved
        return type(out)(moved, *out[1:]) if hasattr(out, "_fields") else type(out)([moved, *out[1:]])  # namedtuple

    with contextlib.ExitStack() as hooks:
        for block in blocks:
            hooks.enter_context(block.register_forward_hook(noisy))
        return probe_forward(model, ids, f"--factory {spec!r}: the model")
