"""The check's protocol: its settings, the cached token windows every run trains on, and the ladder of runs."""

from __future__ import annotations

import functools
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lnstab import validation
from lnstab.check.runspec import Optimisation, RunResult
from lnstab.check.subjects import Subject
from lnstab.check.workers import Failure, Job, RunPool, quiet
from lnstab.errors import LNStabError
from lnstab.safeload import load_yaml

GPT2_VOCAB = 50257
TIERS_FILE = Path(__file__).with_name("tiers.yaml")
TIERS = ("quick", "proxy")


@functools.cache
def tiers() -> dict[str, Any]:
    """``tiers.yaml``: what each tier sees and cannot see, and the proxy tier's protocol, model shape and data."""
    return load_yaml(TIERS_FILE, TIERS_FILE.name)


class RunFailed(Exception):
    """A stress run that raised: the checked model (or a reference, or the check itself) failed while training; not a
    usage error: ``lnstab check`` exits 3 with one line naming the run (``subject``: its label). ``detail``: the run's
    traceback, from the process that ran it."""

    def __init__(self, subject: str, lr: float, seed: int, exc_type: str, first: str, detail: str = "") -> None:
        self.subject, self.lr, self.seed, self.detail = subject, lr, seed, detail
        hint = " (its loss does not depend on a trainable parameter: detached logits?)" if (
            "does not require grad" in first) else ""
        super().__init__(f"{subject} failed in its stress run at lr {lr:g}, seed {seed}: {exc_type}"
                         + (f": {first[:300]}" if first else "") + hint)


MAX_SEED = 2**64 - 1  # the largest seed torch.manual_seed takes


@dataclass(frozen=True)
class Protocol:
    """Every number of the check (defaults: a few minutes on a 2-core CPU for a 4-layer, 128-wide model).

    Attributes:
        lrs: The learning-rate ladder; every subject trains once per rate and seed.
        seeds: Seeds of initialisation and of the batch order.
        batch_size: Sequences per step.
        seq_len: Tokens per sequence (at most the model's context).
        measure_every: Hidden-state statistics and growth fits every N steps (N must divide ``steps``).
        jacobian_iters: Power iterations per Jacobian norm (measured at initialisation and after training).
        probe_size: Sequences of the Jacobian probe.
        optimisation: Steps, warmup, decay, AdamW settings, clipping.
        data_source: ``auto`` (``files`` when ``data_path`` is given, else ``synthetic``), ``files`` or ``synthetic``.
        data_path: Text for ``files`` (``.jsonl``/``.txt``/``.parquet``, gzip too), e.g. the OpenWebText sample.
        accelerator: Lightning accelerator (``cpu``, ``gpu``, ``auto``); the runs are fp32 everywhere.
        tier: ``quick`` (the per-PR screen) or ``proxy`` (docs/proxy's shape; lnstab/check/tiers.yaml).
        vocab_top_k: With ``files``: the windows relabelled onto the ``K`` most frequent training tokens + one UNK
            (:func:`lnstab.datamodules.vocab.top_k_map`), every model built with ``K + 1`` outputs; ``None``: GPT-2's
            tokens (or the windows' protocol vocabulary, :func:`lnstab.datamodules.vocab.compact_vocabulary`).
        val_documents: With ``vocab_top_k``: the first documents of ``data_path``, held out of the vocabulary and of
            the windows (the OpenWebText DataModule's ``val_split: documents``).
    """

    lrs: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
    seeds: tuple[int, ...] = (0, 1)
    batch_size: int = 8
    seq_len: int = 64
    measure_every: int = 10
    jacobian_iters: int = 8
    probe_size: int = 2
    optimisation: Optimisation = field(default_factory=Optimisation)
    data_source: str = "auto"
    data_path: str | None = None
    accelerator: str = "cpu"
    tier: str = "quick"
    vocab_top_k: int | None = None
    val_documents: int | None = None

    def __post_init__(self) -> None:
        if not self.lrs:
            raise LNStabError("--lrs is empty; give at least one learning rate")
        for lr in self.lrs:
            validation.number("--lrs", lr, 0, low_open=True)
        if not self.seeds:
            raise LNStabError("--seeds is empty; give at least one seed")
        for seed in self.seeds:
            validation.integer("--seeds", seed, 0)
            if seed > MAX_SEED:  # torch.manual_seed's range: beyond it the run failed as the model's fault, exit 3
                raise LNStabError(f"--seeds={seed} is not allowed; a seed is at most {MAX_SEED} (2**64 - 1)")
        for option, shown in (("--lrs", [f"{v:g}" for v in self.lrs]), ("--seeds", [str(v) for v in self.seeds])):
            if repeated := sorted(v for v, n in Counter(shown).items() if n > 1):
                raise LNStabError(f"{option} {','.join(shown)} is not allowed; it names "
                                  f"{repeated[0]} twice (each rate and seed is one run with its own log directory)")
        opt = self.optimisation
        for option, value, least in (("--batch-size", self.batch_size, 1), ("--seq-len", self.seq_len, 2),
                                     ("--measure-every", self.measure_every, 1),
                                     ("--jacobian-iters", self.jacobian_iters, 1), ("--probe-size", self.probe_size, 1),
                                     ("--steps", opt.steps, 1), ("--warmup-steps", opt.warmup_steps, 0)):
            validation.integer(option, value, least)
        validation.number("--min-lr-ratio", opt.min_lr_ratio, 0, 1)
        validation.number("--weight-decay", opt.weight_decay, 0)
        validation.number("--grad-clip", opt.grad_clip, 0)
        validation.number("--eps", opt.eps, 0, low_open=True)
        if len(opt.betas) != 2 or not all(isinstance(b, int | float) and 0 <= b < 1 for b in opt.betas):
            raise LNStabError(f"--model.betas={opt.betas!r} is not allowed; give two numbers in [0, 1)")
        if opt.warmup_steps > opt.steps:
            raise LNStabError(f"--warmup-steps={opt.warmup_steps} is not allowed with --steps={opt.steps}; it must be "
                              "at most the number of steps (the rate would never reach the rung's peak); the warm-up "
                              "is --warmup-steps when given, else the --tier's or the default's")
        if opt.steps % self.measure_every:
            raise LNStabError(f"--measure-every={self.measure_every} is not allowed with --steps={opt.steps}; "
                              "it must divide the number of steps (the last measurement is after training)")
        if self.probe_size > self.batch_size:
            raise LNStabError(f"--probe-size={self.probe_size} is not allowed; it must be <= --batch-size="
                              f"{self.batch_size} (--probe-size is {Protocol.probe_size} unless given: with a smaller "
                              "--batch-size, give it too)")
        validation.choice("--data.source", self.data_source, ("auto", "files", "synthetic"))
        if self.data_source == "files" and not self.data_path:
            raise LNStabError("--data.source files needs --data.path FILE")
        if self.data_source == "synthetic" and self.data_path:
            raise LNStabError(f"--data.path {self.data_path} is not used with --data.source synthetic; drop one")
        validation.choice("--accelerator", self.accelerator, ("cpu", "gpu", "cuda", "mps", "auto"))
        # Lightning refuses a missing one only in the first stress run: exit 3 as if the model had failed, after the
        # data was read and the run directory made
        missing = {"gpu": "CUDA GPU", "cuda": "CUDA GPU", "mps": "MPS device"}.get(self.accelerator)
        if missing and not (torch.cuda.is_available() if missing == "CUDA GPU" else torch.backends.mps.is_available()):
            raise LNStabError(f"--accelerator {self.accelerator} is not allowed here: torch {torch.__version__} sees "
                              f"no {missing}; give --accelerator cpu (the default) or auto")
        if self.vocab_top_k is not None:
            validation.positive_int("vocab_top_k", self.vocab_top_k)
            if self.source != "files":
                raise LNStabError(f"--tier {self.tier} needs the OpenWebText sample: give --data.path FILE (e.g. "
                                  "$LNSTAB_OWT_SAMPLE, owt-sample-900.jsonl.gz); it trains on its text with its "
                                  f"{self.vocab_top_k} most frequent tokens + one UNK")
            if not os.path.isfile(os.path.expanduser(self.data_path or "")):
                raise LNStabError(f"--data.path {self.data_path} is not a file; --tier {self.tier} trains on the "
                                  "OpenWebText sample (e.g. $LNSTAB_OWT_SAMPLE, owt-sample-900.jsonl.gz)")

    @property
    def source(self) -> str:
        """The data source in use."""
        return "files" if self.data_source == "files" or (self.data_source == "auto" and self.data_path) else (
            "synthetic")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready settings."""
        out = {**asdict(self), "source": self.source}
        if self.tier == "quick":  # a quick card's protocol as before there were tiers
            for key in ("tier", "vocab_top_k", "val_documents"):
                out.pop(key)
        return out


def load_tokens(protocol: Protocol, vocab_size: int, seq_len: int, own_vocab: bool = True
                ) -> tuple[torch.Tensor, dict[str, Any]]:
    """``batch_size × (steps + 1)`` windows ``(N, seq_len + 1)`` of token ids, and what they are: GPT-2 tokens of
    ``data_path`` (``files``; with ``own_vocab`` the model must predict all 50257, else they are relabelled afterwards:
    :func:`lnstab.datamodules.vocab.compact_vocabulary`) or lnstab's seeded Markov stream over ``vocab_size`` tokens
    (``synthetic``). Every run takes the same windows, each seed in its own order."""
    n = protocol.batch_size * (protocol.optimisation.steps + 1)
    if protocol.source == "synthetic":
        from lnstab.datamodules import SyntheticDataModule

        stream = SyntheticDataModule.markov_stream(n * (seq_len + 1), vocab_size, 1234, 0)
        return stream.view(n, seq_len + 1), {"source": "synthetic", "vocab_size": vocab_size, "windows": n}
    from lnstab.datamodules import OpenWebTextDataModule
    from lnstab.datamodules.text import TooLittleData

    if own_vocab and vocab_size < GPT2_VOCAB:
        raise LNStabError(f"--data.path {protocol.data_path} holds GPT-2 tokens (50257), but the model predicts only "
                          f"{vocab_size}; use --data.source synthetic or a model with GPT-2's vocabulary")
    common = {"block_size": seq_len, "batch_size": protocol.batch_size, "source": "files", "num_workers": 0,
              "path": os.path.expanduser(protocol.data_path or ""), "tokenizer_threads": 1}
    if protocol.vocab_top_k is not None:  # split by document, relabelled onto the training split's top-K + UNK
        dm = OpenWebTextDataModule(**common, val_split="documents", val_documents=protocol.val_documents,
                                   vocab="top_k", vocab_top_k=protocol.vocab_top_k)
        with quiet():
            dm.setup("fit")
    else:
        dm = OpenWebTextDataModule(**common, val_tokens=seq_len + 1)
    windows: list[torch.Tensor] = []
    more = "give more text, or a smaller --batch-size, --steps or --seq-len"
    try:
        with quiet():
            for x, y in dm.train_dataloader():
                windows.append(torch.cat([x, y[:, -1:]], dim=1))  # (B, T + 1)
                if sum(w.size(0) for w in windows) >= n:
                    break
    except TooLittleData:  # said in lnstab fit's options (--data.val_tokens, --data.block_size), not the check's
        raise LNStabError(f"--data.path {protocol.data_path} holds less than one window of {seq_len + 1} tokens held "
                          f"out and a batch of {protocol.batch_size} to train on; the check needs {n} windows "
                          f"(--batch-size × (--steps + 1)): {more}") from None
    tokens = torch.cat(windows)[:n] if windows else torch.empty(0, seq_len + 1, dtype=torch.long)
    if tokens.size(0) and bool((tokens[1:] == tokens[0]).all(dim=1).any()):  # the training loader ran out, began again
        held = int(torch.unique(tokens, dim=0).size(0))
        raise LNStabError(f"--data.path {protocol.data_path} holds {held} windows of {seq_len + 1} tokens to train on; "
                          f"the check needs {n} (--batch-size × (--steps + 1)), each seen once, not the same windows "
                          f"again: {more}")
    if tokens.size(0) < n:
        raise LNStabError(f"--data.path {protocol.data_path} holds {tokens.size(0)} windows of {seq_len + 1} tokens; "
                          f"the check needs {n} (--batch-size × (--steps + 1)): {more}")
    info = {"source": "files", "path": str(protocol.data_path), "windows": n}
    if protocol.vocab_top_k is not None:
        vocab = dm.vocab_map
        return tokens, {**info, "validation_documents_held_out": int(protocol.val_documents or 0),
                        "vocab_size": vocab.size, "top_k": protocol.vocab_top_k,
                        "unk_share": float((tokens == vocab.unk).double().mean())}
    return tokens, {**info, "validation_documents_skipped": int(dm.hparams.val_tokens), "vocab_size": GPT2_VOCAB}


def plan(subjects: list[Subject], protocol: Protocol) -> list[tuple[Subject, float, int]]:
    """The runs in order: every subject that is not a copy of another, every learning rate, every seed."""
    return [(s, lr, seed) for s in subjects if s.same_as is None for lr in protocol.lrs for seed in protocol.seeds]


def run_ladder(subjects: list[Subject], protocol: Protocol, tokens: torch.Tensor, log_root: Path, *, progress: bool,
               pool: RunPool, cache: Path | None = None) -> dict[str, list[RunResult]]:
    """Train every planned run in ``pool`` (with ``progress``, a bar across runs on stderr); ``{subject key: runs}``,
    copies included. With ``cache``, an earlier card's reference run kept there is reused (:mod:`lnstab.check.cache`).
    """
    from tqdm.auto import tqdm

    settings = {key: getattr(protocol, key) for key in ("batch_size", "optimisation", "measure_every", "jacobian_iters",
                                                        "probe_size", "accelerator")}
    # only the first rate probes the Jacobians at initialisation: every rate starts from the same seeded weights and
    # batches, and the card reads the initial probe of the first rate only
    first_lr = min(protocol.lrs)
    jobs = [Job(i, s, lr, seed, {**settings, "probe_init": lr == first_lr}, tokens, log_root, cache)
            for i, (s, lr, seed) in enumerate(plan(subjects, protocol))]
    results: dict[str, list[RunResult]] = {s.key: [] for s in subjects}
    bar = tqdm(total=len(jobs), desc="lnstab check", unit="run", disable=not progress, dynamic_ncols=True)

    def done(job: Job, result: Any) -> None:
        if isinstance(result, Failure):
            return
        loss = result.losses[-1] if result.losses else math.nan
        bar.set_postfix_str(f"{job.subject.key} lr={job.lr:g} seed={job.seed} loss={loss:.3g}"
                            + (" diverged" if result.diverged else ""))
        bar.update()

    try:
        outcomes = pool.run(jobs, done)
    finally:
        bar.close()
    for job, outcome in zip(jobs, outcomes, strict=True):
        if isinstance(outcome, Failure):  # the model's own error (or the check's): a status of its own, no verdict
            raise RunFailed(job.subject.label, job.lr, job.seed, outcome.exc_type, outcome.first_line,
                            outcome.traceback)
        if outcome is not None:
            results[job.subject.key].append(outcome)
    for subject in subjects:
        if subject.same_as is not None:
            results[subject.key] = results[subject.same_as]
    return results
