"""From a checked subject to a card: the protocol vocabulary, the data, the runs, the grades, and what the card says
about where it was made (the lnstab version and the machine kind, never the machine's paths)."""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lnstab.check.analysis import first_bad, summarise
from lnstab.check.card import build_rows
from lnstab.check.criteria import overall
from lnstab.check.protocol import GPT2_VOCAB, Protocol, load_tokens, plan, tiers
from lnstab.check.report import write_report
from lnstab.check.runspec import probe_forward
from lnstab.check.subjects import Subject
from lnstab.check.workers import RunPool
from lnstab.errors import LNStabError
from lnstab.precision import cpu_has_native_bf16
from lnstab.rundir import sha256_file, short_path

VOCAB_MODES = ("protocol", "model")


@dataclass
class Data:
    """The windows every run trains on and what the card says of them and of the vocabulary."""

    tokens: torch.Tensor
    info: dict[str, Any]
    vocab: dict[str, Any]


def load_data(protocol: Protocol, subject: Subject, seq_len: int, vocab_mode: str, pool: RunPool | None = None
              ) -> tuple[Data, Subject]:
    """The windows and the subject to train on them: with ``vocab_mode='protocol'`` and a subject that allows it
    (:meth:`Subject.with_vocab`), the windows are relabelled onto the distinct tokens they hold and the subject is
    built with that many outputs; else the model's own vocabulary (``files`` then needs GPT-2's). With ``pool``, the
    text is read, tokenised and relabelled in one of its workers (:func:`windows`), which import Lightning anyway."""
    probe = subject.with_vocab(2) if vocab_mode == "protocol" else None
    compact = probe is not None
    if protocol.vocab_top_k is not None and not compact:
        why = ("--vocab model keeps the model's own" if vocab_mode == "model" else
               f"{subject.label} cannot be built with another vocabulary (a factory without a vocab_size argument, "
               "or trained --hf weights), so it keeps its own")
        raise LNStabError(f"--tier {protocol.tier} builds every model with {protocol.vocab_top_k + 1} outputs (the "
                          f"sample's top {protocol.vocab_top_k} tokens + UNK); {why}")
    vocab = subject.shape.vocab_size
    args = (protocol, vocab, seq_len, not compact)
    array, info, size = pool.call(windows, *args) if pool else windows(*args)
    tokens = torch.from_numpy(array)
    if info["source"] == "files":
        info["identity"] = file_identity(protocol.data_path)
    if not compact:
        check_model(subject, vocab, seq_len, width=False)
        return Data(tokens, info, {"mode": "model", "size": vocab, "own": vocab}), subject
    compacted = subject.with_vocab(size)
    check_model(compacted, size, seq_len)
    mode, source = (("protocol", info.get("vocab_size", vocab)) if protocol.vocab_top_k is None
                    else ("top_k", GPT2_VOCAB))
    return Data(tokens, info, {"mode": mode, "size": size, "own": vocab, "source": source}), compacted


def windows(protocol: Protocol, vocab: int, seq_len: int, own_vocab: bool
            ) -> tuple[np.ndarray, dict[str, Any], int]:
    """:func:`~lnstab.check.protocol.load_tokens` with the windows as a numpy array (what a worker sends back) and
    the vocabulary they are in: without ``own_vocab``, relabelled onto the tokens they hold, here where the text was
    read (in a worker: :mod:`lnstab.datamodules` imports Lightning)."""
    tokens, info = load_tokens(protocol, vocab, seq_len, own_vocab=own_vocab)
    size = vocab
    if protocol.vocab_top_k is not None:  # relabelled onto the top-K + UNK where the text was read
        size = info["vocab_size"]
    elif not own_vocab:
        from lnstab.datamodules.vocab import compact_vocabulary

        tokens, size = compact_vocabulary(tokens)
    return tokens.numpy(), info, size


def check_model(subject: Subject, vocab_size: int, seq_len: int, *, width: bool = True, causal: bool = True) -> None:
    """Refuse, in one line, a subject (built once here) whose logits are not ``vocab_size`` wide (``width``), or
    whose logits at a position depend on later tokens (``causal``; an encoder such as BERT): the check trains
    next-token prediction, which such a model solves by reading the answer. lnstab's own GPT is causal by
    construction and is not probed for it."""
    causal = causal and subject.config is None
    if not (width or causal):
        return
    torch.manual_seed(0)
    model = subject.build()
    T = max(2, seq_len)  # the length the runs use: a model need not take any other
    ids = torch.randint(0, vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    a = probe_forward(model, ids, subject.label, vocabulary=vocabulary_advice(subject, vocab_size))
    got = a.shape[-1] if isinstance(a, torch.Tensor) else None
    if width and got != vocab_size:
        raise LNStabError(f"{subject.label} built with vocab_size={vocab_size} returned logits over {got} tokens; "
                          "a factory's vocab_size argument must set the width of its logits (or give --vocab model)")
    finite_at_init(subject.label, a)
    if not causal:
        return
    half = T // 2
    later = ids.clone()
    later[:, half:] = (ids[:, half:] + 1) % vocab_size  # every token from the middle on changed
    b = probe_forward(model, later, subject.label)
    finite_at_init(subject.label, b)  # NaN is no evidence of reading ahead: it is not causal only if finite
    refuse_reading_ahead(subject.label, a, b, half, T, "")
    # The runs train in train mode: a branch only training takes (dropout, LayerDrop, one of the model's own) may
    # read ahead where eval mode does not. Both forwards from the same seed take the same random choices.
    # Each from a copy of the model as built, so that a model that counts its forwards takes the same branch twice.
    trained = []
    with torch.random.fork_rng(devices=[]):  # the check's own random state is left as it was
        for x in (ids, later):
            torch.manual_seed(1)
            trained.append(probe_forward(fresh_copy(model, subject), x, subject.label, train=True))
    a, b = trained
    if torch.isfinite(a).all() and torch.isfinite(b).all():  # a model NaN in training diverges, and is graded so
        refuse_reading_ahead(subject.label, a, b, half, T, " in train mode (its training forward: in eval mode it "
                             "is causal)")


def vocabulary_advice(subject: Subject, vocab_size: int) -> str:
    """What to do when ``subject`` cannot embed token ids below ``vocab_size``, the protocol vocabulary it is built
    with (``own_vocab`` set: a factory's ``vocab_size`` argument, ``--hf-init``) or its own (its logits' width)."""
    if subject.own_vocab is not None:
        return (f"the check builds it with vocab_size={vocab_size} (the protocol vocabulary, the distinct tokens of "
                "its windows): size its embedding by vocab_size, as its logits are")
    return (f"its logits are {vocab_size} wide, so the protocol draws token ids from all {vocab_size}: give its "
            f"embedding {vocab_size} rows, one per logit")


def fresh_copy(model: nn.Module, subject: Subject) -> nn.Module:
    """A copy of ``model`` as :func:`check_model` built it (it ran only in eval mode since): a deep copy, or the
    subject built again from the same seed where the model does not copy."""
    try:
        return copy.deepcopy(model)
    except Exception:  # a model holding something that does not copy (a lock, a file)
        torch.manual_seed(0)
        return subject.build()


def refuse_reading_ahead(label: str, a: torch.Tensor, b: torch.Tensor, half: int, T: int, where: str) -> None:
    """Refuse, in one line, logits ``a``/``b`` of token ids that differ from position ``half`` on whose positions
    before ``half`` differ too: the model reads ahead."""
    early_a, early_b = a[:, :half].double(), b[:, :half].double()
    change = (early_a - early_b).abs().max().item()
    if not change <= 1e-5 * (1.0 + early_a.abs().max().item()):
        raise LNStabError(f"{label} is not causal{where}: changing tokens {half}…{T - 1} changed its logits at "
                          f"positions 0…{half - 1} (by up to {change:.2g}); lnstab check trains next-token "
                          "prediction, which needs a causal language model (an encoder such as BERT sees the whole "
                          "sequence)")


def finite_at_init(label: str, logits: torch.Tensor) -> None:
    """Refuse, in one line, a model whose logits are NaN or infinite before any training: it would 'diverge' at step 0
    at every rate, a FAIL that would blame its training (one that becomes non-finite in training is graded)."""
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise LNStabError(f"{label}: its logits are not finite at initialisation ({bad} of {logits.numel()} NaN or "
                          f"infinite on token ids of shape {tuple(logits.shape[:-1])}, before any training); "
                          "lnstab check grades how a finite model trains (look for uninitialised weights, e.g. "
                          "torch.empty, or a division by zero in its forward)")


def lnstab_version() -> str:
    """The installed lnstab version, with the git commit of the source tree when it is a checkout."""
    try:
        text = version("lnstab")
    except PackageNotFoundError:
        text = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5)
        if commit.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,40}", commit.stdout.strip()):
            text += f" (commit {commit.stdout.strip()})"
    return text


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else the platform's)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def provenance(workers: int, threads: int) -> dict[str, Any]:
    """What a card was made by: the lnstab version and the machine kind (CPU model, cores, the vector instructions
    torch's CPU kernels use, ``isa``: ``AVX512``, ``AVX2``, ``DEFAULT`` …; fp32 runs at high learning rates round
    differently from one to another, see docs/check/validation/across-machines.md), native bf16, threads and workers,
    torch."""
    return {"lnstab": lnstab_version(), "machine": {
        "cpu": cpu_model(), "cores": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(), "workers": workers, "threads_per_worker": threads,
        "torch": torch.__version__, "os": platform.system()}}


def public_path(text: str) -> str:
    """A path as a card may show it: relative to the working directory when under it, else (absolute, or climbing
    out of it with ``..``) its last part."""
    path = Path(os.path.expanduser(text))
    if not path.is_absolute() and ".." not in path.parts:
        return text
    shown = short_path(path)
    return (path.name or text) if shown.is_absolute() else str(shown)


def public_command(argv: list[str]) -> str:
    """``lnstab check …`` with every absolute path argument (or ``--opt=/abs/path``) shown by :func:`public_path`."""
    shown = []
    for arg in argv:
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        target = value if (eq or not key) else ""
        if target and (os.path.isabs(os.path.expanduser(target)) or ".." in Path(target).parts):
            arg = f"{key}={public_path(target)}" if eq else public_path(target)
        shown.append(arg)
    return "lnstab check " + shlex.join(shown)


def file_identity(path: str | None) -> dict[str, Any]:
    """A data file by name, size and the start of its SHA-256 (no path)."""
    if not path:
        return {}
    file = Path(os.path.expanduser(path))
    try:
        return {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256_file(file)[:16]}
    except OSError:
        return {"file": file.name}


def data_text(data: Data, seq_len: int) -> str:
    """One line on the windows and the vocabulary."""
    info, vocab = data.info, data.vocab
    if info["source"] == "files":
        ident = info.get("identity", {})
        text = (f"{info['windows']} windows of {seq_len + 1} GPT-2 tokens from {ident.get('file', info['path'])}"
                + (f" ({ident['bytes']:,} bytes, sha256 {ident['sha256']}…)" if "sha256" in ident else ""))
    else:
        text = (f"{info['windows']} windows of {seq_len + 1} tokens of lnstab's synthetic Markov stream over "
                f"{info['vocab_size']} tokens (no text)")
    if vocab["mode"] == "top_k":
        text += (f" (the first {info['validation_documents_held_out']} documents held out); proxy vocabulary: the "
                 f"{info['top_k']} most frequent GPT-2 tokens of the other documents, relabelled 0…{info['top_k'] - 1}"
                 f" in id order, and one UNK for the rest ({info['unk_share']:.1%} of the windows' tokens), so every "
                 f"model is built with {vocab['size']} outputs instead of {vocab['own']}")
    elif vocab["mode"] == "protocol":
        text += (f"; protocol vocabulary: the {vocab['size']} distinct tokens of the windows, relabelled 0…"
                 f"{vocab['size'] - 1} in id order, so every model is built with {vocab['size']} outputs instead of "
                 f"{vocab['own']} (same text, a {'smaller' if vocab['size'] < vocab['own'] else 'larger'} head)")
    else:
        text += f"; the model's own vocabulary ({vocab['size']} outputs)"
    return text


def grade(subject: Subject, subjects: list[Subject], runs: dict[str, list[Any]], protocol: Protocol,
          thresholds: dict[str, Any], data: Data, seq_len: int, out: Path, command: str, started: float,
          provenance: dict[str, Any], figures: bool = True, shown: Path | None = None) -> dict[str, Any]:
    """Grade the runs of ``subject`` (key ``checked``) against its references and write the card into ``out``
    (which the card names as ``shown`` when it is written elsewhere first, to be moved there)."""
    opt = protocol.optimisation
    summaries = {s.key: summarise(runs[s.key], opt.steps) for s in subjects}
    repeated = {name: n for run in runs["checked"] for name, n in run.repeated.items()}
    sites = {k: getattr(subject.sites, k) for k in ("norm_pattern", "param_pattern", "attention", "logits")}
    rows = build_rows(summaries, thresholds, {**sites, "bound_unchecked": next(
        (r.bound_unchecked for r in runs["checked"] if r.bound_unchecked), "")})
    drawn: list[str] = []
    if figures:
        from lnstab.check.figures import write_figures

        drawn = write_figures(out, summaries, runs, {s.key: s.label for s in subjects}, list(protocol.lrs))
    verdict = overall([r["status"] for r in rows])
    place = shown or out
    card = {
        "name": place.name,
        "out": public_path(str(place)),
        "command": command,
        "status": verdict,
        "exit_code": 1 if verdict == "fail" else 0,
        "model": {"label": subject.label, "description": describe(subject, seq_len), "shape": vars(subject.shape),
                  "sites": vars(subject.sites), "training": subject.dropout, "repeated": repeated,
                  "z_loss": subject.z_loss or (subject.config.z_loss if subject.config else 0.0)},  # either flag
        "references": {s.key: {"label": s.label, "short": s.label.split()[0], "shape": vars(s.shape),
                               "description": describe(s, seq_len)
                               + (" (the checked model itself: its runs are reused)" if s.same_as else ""),
                               "same_as": s.same_as} for s in subjects if s.key != "checked"},
        "protocol": {**protocol.as_dict(), "data_path": public_path(protocol.data_path or "") or None},
        "protocol_text": (f"{len(plan(subjects, protocol))} stress runs: lr {', '.join(f'{x:g}' for x in protocol.lrs)}"
                          f" × seeds {', '.join(map(str, protocol.seeds))}, {opt.steps} steps of "
                          f"{protocol.batch_size}×{seq_len} tokens, warmup {opt.warmup_steps}, clip {opt.grad_clip:g}, "
                          f"fp32 (precision 32-true) on {protocol.accelerator}, train mode with dropout off"),
        "data": {**{k: v for k, v in data.info.items() if k != "path"}, "vocab": data.vocab},
        "data_text": data_text(data, seq_len),
        "provenance": provenance,
        "criteria": rows,
        "figures": drawn,
        "summaries": summaries,
        "runs": [run_record(r, out) for s in subjects if s.same_as is None for r in runs[s.key]],
    }
    if protocol.tier != "quick":  # a quick card as before there were tiers
        described = tiers()[protocol.tier]
        card["tier"] = {"name": protocol.tier, "sees": described["sees"], "cannot_see": described["cannot_see"],
                        "thresholds": described.get("thresholds")}
        end = f"{opt.min_lr_ratio:g}× the rate" if opt.min_lr_ratio else "0"
        card["protocol_text"] += (f", AdamW {opt.betas[0]:g}/{opt.betas[1]:g}, weight decay {opt.weight_decay:g}, "
                                  f"cosine to {end}")
    card["wall_s"] = time.perf_counter() - started
    card["_out"] = str(place)
    write_report(out, card, thresholds)
    return card


def describe(subject: Subject, seq_len: int) -> str:
    """Shape and origin of a subject in words."""
    s = subject.shape
    ctx = f"context {s.block_size}" if s.block_size else "context unknown"
    vocab = f"vocabulary {s.vocab_size}" + (f" (protocol; its own {subject.own_vocab})" if subject.own_vocab
                                            and subject.own_vocab != s.vocab_size else "")
    z_loss = f", on its cross-entropy + {subject.z_loss:g}·mean (log Z)² (--z-loss)" if subject.z_loss else ""
    return (f"{subject.label}: {s.n_layer} layers × {s.n_embd} wide, {ctx}, {vocab}; trained on sequences of {seq_len}"
            + z_loss)


def run_record(run: Any, out: Path) -> dict[str, Any]:
    """One stress run for ``report.json`` (its losses, divergence and where its TensorBoard logs are)."""
    log_dir = Path(run.log_dir)
    return {
        "subject": run.subject, "lr": run.lr, "seed": run.seed, "diverged": run.diverged, "first_bad": first_bad(run),
        "loss_init": run.losses[0] if run.losses else float("nan"),
        "loss_final": run.losses[-1] if run.losses else float("nan"),
        "losses": run.losses, "events": run.events, "wall_s": run.wall_s,
        "log_dir": str(log_dir.relative_to(out)) if log_dir.is_relative_to(out) else public_path(run.log_dir),
        **({"cached": True} if run.cached else {}),
    }

