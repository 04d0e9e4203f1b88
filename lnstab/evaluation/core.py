"""Final evaluation of a trained GPT: validation loss, two perplexities, ROUGE-1/2/L and BERTScore P/R/F1.

Plain torch (no Lightning); :class:`lnstab.eval_callback.FinalEvaluation` and ``lnstab evaluate`` call
:func:`evaluate_model`. Two protocols:

* ``teacher_forced`` (the authors' nanoGPT-based code): ``n_samples`` windows of ``block_size + 1`` tokens at
  seeded random offsets of the validation stream (``torch.randint(len - block_size, …)`` as nanoGPT's
  ``get_batch``); one forward pass per window; the prediction at every position is the argmax of the logits; the
  predicted ids and the shifted targets are decoded with GPT-2's BPE and scored. Loss: mean next-token
  cross-entropy of the window. The protocol credits copying: predicting each position's input token scores
  ROUGE ≈ 1 (the prediction is the reference shifted by one token), and a random GPT with tied embeddings nearly
  does that; ``copying`` in ``eval.json`` gives the model's copy rate and that rule's ROUGE on the same windows.
* ``generation``: windows of ``prompt_tokens + new_tokens`` tokens at seeded random offsets that contain no
  end-of-text token (so prompt and continuation lie inside one document); the model continues the prompt by
  ``new_tokens`` tokens through its KV cache (greedy, or sampling with a generator seeded per batch); prediction
  and the true continuation are decoded and scored. Loss: cross-entropy of the true continuation given the prompt.

Metrics (``eval/`` in TensorBoard): ``loss`` (mean over samples; every sample has the same token count, so it is
also the token mean), ``ppl_exp_mean_loss`` = exp(mean loss) (the usual perplexity), ``ppl_mean_seq`` = mean over
samples of exp(sample loss) (the authors' convention; ≥ the former by Jensen), ``rouge1``/``rouge2``/``rougeL``
(F-measure, Porter stemmer), ``bertscore_precision``/``_recall``/``_f1`` (see :mod:`lnstab.evaluation.metrics`).

Distributed: every rank draws the same samples; samples are cut into batches of ``batch_size`` in sample order
and batch ``b`` runs on rank ``b % world_size``, so each sample is computed in the same batch (same shapes, same
sampling seed) whatever the world size. Ranks run the same number of batches (the short ones repeat one, result
dropped) so sharded models stay in lockstep. Per-sample results are gathered (``all_gather_object``) and rank 0
scores the texts in sample order, then broadcasts the result: a DDP run returns what one process returns.

``eval.json`` (schema 1; :func:`write_eval_json`, never overwritten: ``eval-1.json``, … when taken)::

    schema: 1                      protocol: "teacher_forced" | "generation"      n_samples: int
    metrics:   {loss, ppl_exp_mean_loss, ppl_mean_seq, rouge1, rouge2, rougeL,
                bertscore_precision, bertscore_recall, bertscore_f1}            (means over samples)
    bertscore: {model: directory or hub name, name: short name, num_layers}
    rouge:     {types: [rouge1, rouge2, rougeL], measure: fmeasure, use_stemmer: true}
    tokenizer: "gpt2"
    copying:   {rate, baseline: {rouge1, rouge2, rougeL}}      (teacher_forced; null for generation)
    settings:  {n_samples, seed, batch_size, world_size, window_tokens, block_size, prompt_tokens,
                new_tokens, greedy, temperature, top_k}                          (null where not used)
    samples:   [{index, start, loss, prompt (generation only), prediction, reference,
                 rouge1, rouge2, rougeL, bertscore_precision, bertscore_recall, bertscore_f1}, …]
    + from FinalEvaluation: stage ("fit" | "test"), global_step
    + from ``lnstab evaluate``: stage "evaluate", checkpoint, config (list), global_step
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lnstab import validation as require
from lnstab.errors import LNStabError
from lnstab.evaluation import metrics as text_metrics
from lnstab.evaluation.settings import PROTOCOLS, EvalSettings
from lnstab.rundir import EVAL_FILE, fsync_dir, json_safe
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding

METRICS = (
    "loss",
    "ppl_exp_mean_loss",
    "ppl_mean_seq",
    "rouge1",
    "rouge2",
    "rougeL",
    "bertscore_precision",
    "bertscore_recall",
    "bertscore_f1",
)
SCHEMA_VERSION = 1


def select_windows(
    tokens: torch.Tensor, protocol: str, n_samples: int, seed: int, window: int, eot: int | None = EOT_TOKEN
) -> torch.Tensor:
    """Start offsets ``(n_samples,)`` of the evaluation windows of ``window`` tokens, drawn with ``seed``.

    ``teacher_forced``: any offset (nanoGPT's ``get_batch``); ``generation``: offsets whose window holds no ``eot``.

    Raises:
        LNStabError: Bad protocol, no tokens, or no window fits (zero samples).
    """
    require.choice("protocol", protocol, PROTOCOLS)
    require.positive_int("n_samples", n_samples)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise LNStabError(f"validation tokens of shape {shape} are not allowed; they must be a 1-D token tensor")
    g = torch.Generator().manual_seed(int(seed))
    n_pos = tokens.numel() - window + 1
    if n_pos < 1:
        raise LNStabError(
            f"validation tokens: {tokens.numel()} tokens give zero samples; a {protocol} window needs {window} tokens"
        )
    if protocol == "teacher_forced" or eot is None:
        return torch.randint(n_pos, (n_samples,), generator=g)
    is_eot = torch.cat([torch.zeros(1, dtype=torch.long), (tokens.cpu() == eot).long().cumsum(0)])  # (N+1,)
    valid = torch.nonzero(is_eot[window:] - is_eot[:n_pos] == 0).flatten()  # starts of EOT-free windows
    if valid.numel() == 0:
        raise LNStabError(
            f"validation tokens: zero samples; no window of prompt_tokens + new_tokens = {window} tokens lies "
            f"inside one document (documents are split by token {eot})"
        )
    return valid[torch.randint(valid.numel(), (n_samples,), generator=g)]


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialised = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if initialised else 0) if rank is None else rank
    world_size = (dist.get_world_size() if initialised else 1) if world_size is None else world_size
    if world_size > 1 and not initialised:
        raise LNStabError(f"world_size={world_size} is not allowed without an initialised torch.distributed group")
    if not 0 <= rank < world_size:
        raise LNStabError(f"rank={rank} is not allowed; it must be in [0, world_size={world_size})")
    return rank, world_size


def _run_batches(
    model: torch.nn.Module,
    windows: torch.Tensor,
    protocol: str,
    batches: list[int],
    batch_size: int,
    prompt_tokens: int,
    seed: int,
    gen: dict[str, Any],
    forward_context: Callable[[], contextlib.AbstractContextManager],
) -> list[dict[str, Any]]:
    """Per-sample losses and token ids for the given batch numbers (a negative number: run batch ``-b-1``, drop)."""
    device = next(model.parameters()).device
    out: list[dict[str, Any]] = []
    for b in batches:
        real, b = b >= 0, b if b >= 0 else -b - 1
        idx = range(b * batch_size, min((b + 1) * batch_size, windows.size(0)))
        w = windows[idx.start : idx.stop].to(device)  # (B, L)
        with forward_context():
            if protocol == "teacher_forced":
                x, y = w[:, :-1], w[:, 1:]  # (B, T), (B, T)
                logits = model(x).float()  # (B, T, V)
                pred = logits.argmax(-1)  # (B, T)
                ref, prompt, inp = y, None, x
            else:
                k = prompt_tokens
                logits = model(w[:, :-1])[:, k - 1 :].float()  # (B, m, V): predictions of the continuation
                y = ref = w[:, k:]  # (B, m)
                g = torch.Generator(device=device).manual_seed(int(seed) + 1 + b)
                pred = model.generate(w[:, :k], ref.size(1), generator=g, **gen)[:, k:]  # (B, m)
                prompt, inp = w[:, :k], None
            loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)  # (B,)
        if not real:
            continue
        for j, i in enumerate(idx):
            out.append(
                {
                    "index": i,
                    "loss": float(loss[j]),
                    "pred": pred[j].tolist(),
                    "ref": ref[j].tolist(),
                    "prompt": None if prompt is None else prompt[j].tolist(),
                    "input": None if inp is None else inp[j].tolist(),
                }
            )
    return out


def _decode(ids: list[int]) -> str:
    enc = gpt2_encoding()
    return enc.decode([t for t in ids if 0 <= t < enc.n_vocab])  # ids beyond GPT-2's vocabulary are dropped


def _broadcast(obj: Any, world_size: int) -> Any:
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    val_tokens: torch.Tensor,
    settings: EvalSettings | None = None,
    *,
    eot_token: int | None = EOT_TOKEN,
    bertscore_device: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Evaluate ``model`` (an :class:`lnstab.model.GPT` or anything with its ``config``/``generate``) on the
    validation stream; returns the :data:`EVAL_FILE` record (see :func:`write_eval_json`), the same on every rank.

    Args:
        model: The language model; put in eval mode for the call, its mode restored after.
        val_tokens: The validation stream, 1-D GPT-2 token ids, documents separated by EOT (50256).
        settings: What to measure and how (:class:`EvalSettings`; ``None``: its defaults).
        eot_token: Document separator that ``generation`` windows avoid (``None``: the stream is one document).
        bertscore_device: BERTScore's device (``None``: cuda if available).
        rank, world_size: This process's shard (``None``: from ``torch.distributed`` when initialised, else 0/1).
        forward_context: Context for forward passes, e.g. an autocast (``None``: none).
        **overrides: :class:`EvalSettings` fields that replace those of ``settings``
            (``evaluate_model(model, tokens, n_samples=32)``).

    Raises:
        LNStabError: A bad argument, zero samples, or a BERTScore model that cannot be loaded.
    """
    settings = settings or EvalSettings()
    if overrides:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(EvalSettings)})
        if unknown:
            raise LNStabError(f"{unknown[0]!r} is not an evaluation setting; allowed: {', '.join(settings.as_dict())}")
        settings = dataclasses.replace(settings, **overrides)
    s = settings
    protocol, n_samples, seed, batch_size = s.protocol, s.n_samples, s.seed, s.batch_size
    block_size, prompt_tokens, new_tokens = s.block_size, s.prompt_tokens, s.new_tokens
    greedy, temperature, top_k = s.greedy, s.temperature, s.top_k
    bertscore_layers, bertscore_batch_size = s.bertscore_layers, s.bertscore_batch_size
    cfg = model.config
    rank, world_size = _world(rank, world_size)
    window = s.window(cfg.block_size)
    if protocol == "teacher_forced":
        block_size = window - 1
    bs_model = text_metrics.resolve_bertscore_model(s.bertscore_model)  # a missing directory fails on every rank
    starts = select_windows(val_tokens, protocol, n_samples, seed, window, eot_token)
    val = val_tokens.cpu().long()
    if int(val.max()) >= cfg.vocab_size or int(val.min()) < 0:
        bad = int(val.max()) if int(val.max()) >= cfg.vocab_size else int(val.min())
        raise LNStabError(
            f"validation tokens hold id {bad}, which is not allowed; ids must be in [0, vocab_size={cfg.vocab_size})"
        )
    # Load the BERTScore model before the model runs, so a bad model fails fast; rank 0 decides for all.
    error = None
    if rank == 0:
        try:
            text_metrics.load_bertscore(bs_model, bertscore_layers, bertscore_device, bertscore_batch_size)
        except LNStabError as exc:
            error = str(exc)
    error = _broadcast(error, world_size)
    if error is not None:
        raise LNStabError(error)

    windows = torch.stack([val[s : s + window] for s in starts.tolist()])  # (n, L)
    n_batches = math.ceil(n_samples / batch_size)
    mine = list(range(rank, n_batches, world_size))
    steps = math.ceil(n_batches / world_size)
    mine += [-(mine[-1] if mine else 0) - 1] * (steps - len(mine))  # lockstep padding, results dropped
    gen = {"greedy": greedy, "temperature": temperature, "top_k": top_k}
    was_training = model.training
    model.eval()
    try:
        local = _run_batches(
            model, windows, protocol, mine, batch_size, prompt_tokens, seed, gen,
            forward_context or contextlib.nullcontext,
        )
    finally:
        model.train(was_training)
    if world_size > 1:
        parts: list[Any] = [None] * world_size
        dist.all_gather_object(parts, local)
        local = [s for part in parts for s in part]
    result = None
    if rank == 0:
        per_sample = sorted(local, key=lambda s: s["index"])
        result = _score(per_sample, starts, protocol, bs_model, bertscore_layers, bertscore_batch_size,
                        bertscore_device)
        result["settings"] = {
            "n_samples": n_samples, "seed": seed, "batch_size": batch_size, "world_size": world_size,
            "window_tokens": window, "block_size": block_size if protocol == "teacher_forced" else None,
            "prompt_tokens": prompt_tokens if protocol == "generation" else None,
            "new_tokens": new_tokens if protocol == "generation" else None,
            "greedy": greedy if protocol == "generation" else None,
            "temperature": temperature if protocol == "generation" and not greedy else None,
            "top_k": top_k if protocol == "generation" and not greedy else None,
        }
        result["samples"] = result.pop("samples")  # last in the file, after the settings
    return _broadcast(result, world_size)


def _score(
    samples: list[dict[str, Any]], starts: torch.Tensor, protocol: str, bs_model: str, layers: int,
    bs_batch: int, bs_device: str | None,
) -> dict[str, Any]:
    preds = [_decode(s["pred"]) for s in samples]
    refs = [_decode(s["ref"]) for s in samples]
    losses = [s["loss"] for s in samples]
    rouge = text_metrics.rouge_scores(preds, refs)
    bert = text_metrics.bertscore_scores(preds, refs, bs_model, layers, bs_device, bs_batch)
    mean_loss = text_metrics.mean(losses)
    metrics = {
        "loss": mean_loss,
        "ppl_exp_mean_loss": safe_exp(mean_loss),
        "ppl_mean_seq": text_metrics.mean([safe_exp(x) for x in losses]),
        **{k: text_metrics.mean(v) for k, v in {**rouge, **bert}.items()},
    }
    records = []
    for i, s in enumerate(samples):
        rec = {"index": s["index"], "start": int(starts[s["index"]]), "loss": s["loss"]}
        if s["prompt"] is not None:
            rec["prompt"] = _decode(s["prompt"])
        rec.update(prediction=preds[i], reference=refs[i])
        rec.update({k: v[i] for k, v in {**rouge, **bert}.items()})
        records.append(rec)
    return {
        "schema": SCHEMA_VERSION,
        "protocol": protocol,
        "n_samples": len(samples),
        "metrics": {k: metrics[k] for k in METRICS},
        "nonfinite": [k for k in METRICS if not math.isfinite(metrics[k])],
        "bertscore": text_metrics.bertscore_model_id(bs_model, layers),
        "rouge": {"types": list(text_metrics.ROUGE_TYPES), "measure": "fmeasure", "use_stemmer": True},
        "tokenizer": "gpt2",
        "copying": _copying(samples, refs) if protocol == "teacher_forced" else None,
        "samples": records,
    }


def _copying(samples: list[dict[str, Any]], refs: list[str]) -> dict[str, Any]:
    """How much teacher-forced ROUGE a model gets for predicting its input token: ``rate``, the fraction of positions
    whose argmax is the input token there; ``baseline``, the ROUGE of that rule itself (the input as the prediction:
    the reference shifted by one token, ≈ 0.98 at 64 tokens), on these windows. A random GPT with tied embeddings
    follows the rule, so its ROUGE is high; read a model's ROUGE against these two numbers."""
    same = sum(sum(p == i for p, i in zip(s["pred"], s["input"], strict=True)) for s in samples)
    baseline = text_metrics.rouge_scores([_decode(s["input"]) for s in samples], refs)
    return {"rate": same / sum(len(s["pred"]) for s in samples),
            "baseline": {k: text_metrics.mean(v) for k, v in baseline.items()}}


def safe_exp(x: float) -> float:
    """``exp(x)``, ``inf`` where it overflows a float (a diverged model's loss), ``nan`` for ``nan``."""
    return math.exp(x) if x < 709.0 or math.isnan(x) else math.inf


def eval_scalars(result: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """The TensorBoard scalars of a result: ``{f"{prefix}/{metric}": value}`` for every metric, and
    ``{prefix}/copy_rate`` for a teacher-forced one (``copying``: read ROUGE beside it)."""
    scalars = {f"{prefix}/{k}": float(v) for k, v in result["metrics"].items()}
    if result.get("copying"):
        scalars[f"{prefix}/copy_rate"] = float(result["copying"]["rate"])
    return scalars


def write_eval_json(directory: str | os.PathLike, result: dict[str, Any], **extra: Any) -> Path:
    """Write ``result`` (plus ``extra`` top-level fields) to ``directory/eval.json`` atomically; never overwrite.

    If ``eval.json`` exists the record goes to ``eval-1.json``, ``eval-2.json``, … (the first free name, claimed
    with a hard link, so two writers cannot take the same one). Non-finite numbers are written as
    ``{"$float": "nan"}`` objects (:func:`lnstab.rundir.json_safe`; strict JSON has no such numbers) and the metrics
    that are non-finite are listed under ``nonfinite``. Returns the path written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe({**result, **extra}), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".eval.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        for n in range(10_000):
            path = directory / (EVAL_FILE if n == 0 else f"eval-{n}.json")
            try:
                os.link(tmp, path)  # atomic, and fails if the name exists
                fsync_dir(directory)
                return path
            except FileExistsError:
                continue
        raise LNStabError(f"{directory}: eval.json and eval-1 … eval-9999.json all exist; choose another directory")
    finally:
        Path(tmp).unlink(missing_ok=True)
