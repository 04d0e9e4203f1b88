"""The validation set of ``lnstab check``: architectures whose stability the literature reports, each with the verdict
that outcome implies, fixed before the set was run (``lnstab check --validate`` runs it, :mod:`lnstab.check.validate`).

Every row runs at the check's default shape (lnstab's ``mini`` preset: 4 layers × 128 wide, 4 heads, context 128) and
default protocol, beside the same Pre-LN and Peri-LN references. The implied verdict is one of the card's statuses
or a set of them:

* ``FAIL`` where the design is reported to diverge or to train badly without special measures;
* ``WARN`` where it trains but the literature documents a weakness the card measures (Pre-LN's massive activations,
  beyond fp16's range);
* ``PASS`` where it is reported stable without such a weakness and is the card's own standard (Peri-LN);
* ``PASS or WARN`` (not ``FAIL``) where it is reported to train stably: the literature says "stable", not which of
  the card's warnings (headroom, growth, spread against the references) may apply at a 4-layer, 30-step scale.

A card agrees with a row when its verdict is in the row's set. The citations were first given as recalled when the
set was fixed (offline, not re-read); on 2026-12-03 they were re-read against stored copies of the papers (ar5iv and
arXiv HTML pages, summaries) and the authors' code where a number was at stake. What could be confirmed is cited by
its section, figure or table; what could not says so ("not re-read"). The corrections, and the one that changed a
row's model (OLMo 2's z-loss), are listed in :data:`lnstab.check.validation_notes.ROW_CHANGES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lnstab.errors import LNStabError

DEFAULT_SHAPE = ("--model.preset", "mini", "--model.block_size", "128")
STABLE = ("pass", "warn")


@dataclass(frozen=True)
class Row:
    """One architecture of the validation set.

    Attributes:
        id: Short name (its card's directory).
        design: The design in words.
        model: ``--model.KEY VALUE`` arguments beyond the default shape (lnstab's family), or ``()`` with ``hf``.
        hf: A Hugging Face family (a key of :data:`HF_FAMILIES`: ``gemma2``, ``llama``, ``olmo2``, ``gpt2``) whose
            model is built from a config of the default shape (no download), or ``None``.
        outcome: The published outcome, one line.
        source: Paper and table / figure / section.
        expected: The verdicts that outcome implies (lower case card statuses).
    """

    id: str
    design: str
    model: tuple[str, ...]
    outcome: str
    source: str
    expected: tuple[str, ...]
    hf: str | None = None


ROWS: tuple[Row, ...] = (
    Row("post-ln", "Post-LN, the protocol's short warmup (3 of 30 steps by default; no long warmup)",
        ("--model.norm_placement", "post"),
        "diverges or trains badly without a long learning-rate warmup; gradients near the output are large at "
        "initialisation",
        "Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, abstract and Theorem 1 (the "
        "warm-up experiments, Fig. 2, not re-read); Liu et al. 2020a, On the Variance of the Adaptive Learning Rate "
        "and Beyond, Fig. 1 (a Transformer without warm-up ends near a training loss of 10, with it near 3)",
        ("fail",)),
    Row("no-ln", "no normalisation at all", ("--model.norm_placement", "none"),
        "diverges under the learning rates a normalised Transformer takes",
        "Kan et al. 2025 (arXiv 2510.09904): no LN diverges in the most seeds under an aggressive learning rate "
        "(reproduced here: docs/mini-reproduction, claim 5, 6 of 6 runs)",
        ("fail",)),
    Row("pre-ln", "Pre-LN (GPT-2)", ("--model.norm_placement", "pre"),
        "trains, but its hidden-state variance grows with depth (exponentially, in Kim et al.'s measurements) and it "
        "carries massive activations",
        "Kim et al. 2025, Peri-LN: Revisiting Normalization Layer in the Transformer Architecture, abstract and Fig. 1 "
        "(Pre-LN's hidden-state variance over depth); Sun et al. 2024, Massive Activations in Large Language Models, "
        "Fig. 1 (LLaMA2-7B: a few fixed dimensions, near-constant values)",
        ("warn",)),
    Row("peri-ln", "Peri-LN / Sandwich-LN (input and output norms)", ("--model.norm_placement", "peri"),
        "stable: more balanced hidden-state variance over depth and steadier gradients than Pre-LN, up to 3.2B "
        "parameters; Sandwich-LN stabilised CogView's pretraining",
        "Kim et al. 2025, Peri-LN, abstract (§4–5 not re-read); Ding et al. 2021, CogView, abstract (§2.4 on "
        "Sandwich-LN not re-read)",
        ("pass",)),
    Row("pre-ln-dt0.1", "Pre-LN with residual step Δt = 0.1",
        ("--model.norm_placement", "pre", "--model.residual_scale", "0.1"),
        "a smaller residual step slows hidden-state growth at equal or better loss",
        "Kan et al. 2025 (arXiv 2510.09904), the Δt = 0.1 experiments (124M, Pre-LN and Peri-LN); reproduced for "
        "growth here: docs/mini-reproduction, claim 2",
        STABLE),
    Row("olmo2", "OLMo 2: output norm + QK-norm + z-loss 1e-5",
        ("--model.norm_placement", "output", "--model.qk_norm", "true", "--model.z_loss", "1e-5"),
        "stable at 7B–32B; the reordered norm and QK-norm were adopted for stability",
        "Team OLMo 2024, 2 OLMo 2 Furious, its training-stability changes (RMSNorm, reordered norm, QK-norm, z-loss "
        "1e-5; section number not re-read); z-loss 1e-5 also in OLMo-core's OLMo2-7B training script",
        STABLE),
    Row("pre-ln-qknorm", "Pre-LN + QK-norm", ("--model.norm_placement", "pre", "--model.qk_norm", "true"),
        "lower learning-rate sensitivity than Pre-LN; attention-logit growth removed",
        "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities, Fig. 1 and "
        "§3.1.1; Dehghani et al. 2023, Scaling Vision Transformers to 22 Billion Parameters, QK normalization "
        "(Model Architecture section; number not re-read)",
        STABLE),
    Row("deepnorm", "DeepNorm (Post-LN, stream up-weighted by α, β init)", ("--model.norm_placement", "deepnorm"),
        "Post-LN made stable: trains up to 1,000 layers where Post-LN diverges",
        "Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers, abstract and §3 (Post-LN's instability at "
        "18L-18L)",
        STABLE),
    Row("rezero", "ReZero: no norms, x + α·f(x), α = 0 at init",
        ("--model.norm_placement", "none", "--model.residual_gate", "rezero"),
        "trains Transformers of over 100 layers without normalisation or warm-up, and converges faster than the "
        "vanilla (Post-LN) Transformer at 12 layers",
        "Bachlechner et al. 2020, ReZero is All You Need, abstract and §1 (56 % faster to 1.2 BPB on enwiki8 at 12 "
        "layers)",
        STABLE),
    Row("layerscale", "Pre-LN + LayerScale (λ = 0.1 at init, CaiT's rule)",
        ("--model.norm_placement", "pre", "--model.residual_gate", "layerscale"),
        "deep models train and keep improving with depth instead of saturating early",
        "Touvron et al. 2021, Going deeper with Image Transformers (CaiT), abstract and §2 (LayerScale; λ₀ 0.1 up to "
        "depth 18, 1e-5 at 24, 1e-6 deeper)",
        STABLE),
    Row("dyt-pre", "DyT in Pre-LN position (γ·tanh(αx)+β for every norm)",
        ("--model.norm_placement", "pre", "--model.norm_type", "dyt"),
        "matches or exceeds normalised models, mostly without tuning",
        "Zhu et al. 2025, Transformers without Normalization, abstract; its LLaMA runs set α₀ by width and layer kind "
        "(the authors' configs), where this row keeps the default 0.5",
        STABLE),
    Row("gemma2-hf", "Gemma 2 through the Hugging Face path (sandwich RMSNorm, 1 + weight; GeGLU; soft-capping)",
        (), "stable: Gemma 2 trains with pre- and post-norm (Peri-LN) RMSNorm",
        "Gemma Team 2024, Gemma 2: Improving Open Language Models at a Practical Size, §2 (architecture, Table 1)",
        STABLE, hf="gemma2"),
)


# The held-out set: designs that played no part in fixing the thresholds (every threshold was fixed, and changed, on
# ROWS alone), with the verdicts their published outcomes imply and, in HELDOUT_PREDICTION, what the card was expected
# to say; both committed before the set was first run (``lnstab check --validate --set heldout``). Its agreement is
# the check's out-of-sample record; the main set's is in-sample (two thresholds were changed after its first run).
HELDOUT: tuple[Row, ...] = (
    Row("pre-rmsnorm", "Pre-LN with RMSNorm (LLaMA's norm, in lnstab's family)",
        ("--model.norm_placement", "pre", "--model.norm_type", "rmsnorm"),
        "trains as LayerNorm does, at lower cost; LLaMA pre-normalises with it for training stability",
        "Zhang & Sennrich 2019, Root Mean Square Layer Normalization, abstract (comparable performance, 7–64 % less "
        "running time); Touvron et al. 2023, LLaMA, §2.2 (pre-normalization with RMSNorm, for training stability)",
        STABLE),
    Row("pre-ln-nobias", "Pre-LN without biases (PaLM's choice)",
        ("--model.norm_placement", "pre", "--model.bias", "false"),
        "PaLM removes every bias, reporting that this increases training stability for large models",
        "Chowdhery et al. 2022, PaLM: Scaling Language Modeling with Pathways, §2 (Model Architecture: no biases)",
        STABLE),
    Row("pre-ln-zloss", "Pre-LN + z-loss 1e-4 (PaLM's auxiliary loss)",
        ("--model.norm_placement", "pre", "--model.z_loss", "1e-4"),
        "the z-loss keeps log Z near 0 and training stable; it prevents the output-logit divergence of small "
        "models at high learning rates",
        "Chowdhery et al. 2022, PaLM, §5 (Training Setup: loss function, z-loss 1e-4); Wortsman et al. 2023, "
        "Small-scale proxies for large-scale Transformer training instabilities, §3.1.2 (output logit divergence)",
        STABLE),
    Row("peri-ln-dt0.1", "Peri-LN with residual step Δt = 0.1",
        ("--model.norm_placement", "peri", "--model.residual_scale", "0.1"),
        "stable, the best of the paper's four 124M configurations (val loss 3.10, ppl 23.63)",
        "Kan et al. 2025 (arXiv 2510.09904), 124M results (Pre/Peri × Δt ∈ {1, 0.1})",
        STABLE),
    Row("post-rmsnorm", "Post-LN with RMSNorm, the protocol's short warmup",
        ("--model.norm_placement", "post", "--model.norm_type", "rmsnorm"),
        "implied, not reported: Xiong et al.'s analysis puts Post-LN's large gradients near the output and its need "
        "for a long warmup in the norm's place after the residual sum, which RMSNorm (LayerNorm without centring) "
        "keeps; so it should train badly without a long warmup, as Post-LN does",
        "Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, abstract and Theorem 1, applied "
        "to RMSNorm",
        ("fail",)),
    Row("llama-hf", "Llama through the Hugging Face path (pre-RMSNorm, SwiGLU, rotary positions, untied head)",
        (), "trains stably from 7B to 65B parameters (a reading of its training-loss curves; its words: "
        "pre-normalization to improve the training stability)",
        "Touvron et al. 2023, LLaMA: Open and Efficient Foundation Language Models, §2.2 (Fig. 1, training loss, not "
        "re-read)",
        STABLE, hf="llama"),
    Row("olmo2-hf", "OLMo 2 through the Hugging Face path (reordered RMSNorm x + RMSNorm(f(x)), QK-norm; its Hugging "
        "Face loss has no z-loss)",
        (), "stable at 7B–32B; the reordered norm and QK-norm were adopted for stability (with a z-loss of 1e-5 in "
        "training)",
        "Team OLMo 2024, 2 OLMo 2 Furious, its training-stability changes (section number not re-read)",
        STABLE, hf="olmo2"),
    Row("gpt2-hf", "GPT-2 through the Hugging Face path (Pre-LN, Conv1D projections, tied head, its own init)",
        (), "Pre-LN's: trains, with hidden-state growth over depth and massive activations (not an independent "
        "design: it checks that the Hugging Face path grades Pre-LN as lnstab's family does)",
        "Kim et al. 2025, Peri-LN, abstract and Fig. 1; Sun et al. 2024, Massive Activations in Large Language "
        "Models (GPT-2 among its models, by a summary of it; the section not re-read)",
        ("warn",), hf="gpt2"),
)

HELDOUT_PREDICTION = (
    "Every row agrees (8 of 8), with one uncertain: pre-rmsnorm, pre-ln-nobias, pre-ln-zloss and gpt2-hf WARN as "
    "Pre-LN does (growth after training, Jacobian slope; the z-loss does not move log Z in 30 steps, as in OLMo 2's "
    "row); peri-ln-dt0.1 PASS or WARN (Δt = 0.1 may slow the lowest rung into an LR-sensitivity warning); "
    "post-rmsnorm FAIL on gradient spread, as Post-LN; llama-hf WARN (as Pre-LN; rotary positions may change its "
    "attention logits, not a verdict). Uncertain: olmo2-hf, whose lnstab-family row warns on gradient spread by a "
    "margin of 2 sd over seeds; with RMSNorm, SwiGLU, no biases and no z-loss it may fail on it, and if it does the "
    "disagreement is gradient spread's, as DeepNorm's is. Expected 7 or 8 of 8.")

def gemma2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """Gemma 2 at a given shape: head width ``n_embd / n_head`` (and ``query_pre_attn_scalar`` that width, as Gemma 2's
    2B/9B models set it), GeGLU four times wide, eager attention (its logit soft-capping needs it)."""
    from transformers import Gemma2Config

    head = n_embd // n_head
    config = Gemma2Config(hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
                          num_attention_heads=n_head, num_key_value_heads=n_head, head_dim=head,
                          query_pre_attn_scalar=head, vocab_size=vocab_size, max_position_embeddings=block_size,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config._attn_implementation = "eager"
    return config


def llama_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """Llama at a given shape: pre-RMSNorm, SwiGLU four times wide (LLaMA's own is 8/3 wide), rotary positions, no
    biases, an untied head, full multi-head attention."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
                       num_attention_heads=n_head, num_key_value_heads=n_head, vocab_size=vocab_size,
                       max_position_embeddings=block_size, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def olmo2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """OLMo 2 at a given shape: the reordered norm ``x + RMSNorm(f(x))``, QK-norm over all heads, SwiGLU four times
    wide, rotary positions, an untied head. Its Hugging Face loss has no z-loss (OLMo 2's training adds one)."""
    from transformers import Olmo2Config

    return Olmo2Config(hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
                       num_attention_heads=n_head, num_key_value_heads=n_head, vocab_size=vocab_size,
                       max_position_embeddings=block_size, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def gpt2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """GPT-2 at a given shape (Hugging Face's ``GPT2LMHeadModel``: Pre-LN, tied head, its own initialisation)."""
    from transformers import GPT2Config

    return GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=block_size, vocab_size=vocab_size,
                      bos_token_id=0, eos_token_id=0)


# family -> (config at a shape, the model class's name in transformers, the family's name in words)
HF_FAMILIES = {
    "gemma2": (gemma2_config, "Gemma2ForCausalLM", "Gemma 2"),
    "llama": (llama_config, "LlamaForCausalLM", "Llama"),
    "olmo2": (olmo2_config, "Olmo2ForCausalLM", "OLMo 2"),
    "gpt2": (gpt2_config, "GPT2LMHeadModel", "GPT-2"),
}


@dataclass(frozen=True)
class Supplement:
    """A re-run of (some of) the validation set under other arguments, with its question and what was predicted,
    both fixed (committed) before it was first run (``lnstab check --validate --supplement ID`` runs it). The
    expected verdicts are the rows' own, unless the supplement's protocol is one under which the literature reports
    another outcome for a row (Post-LN with a long warmup trains): then ``rows`` holds that row again, same id and
    model, with the outcome, source and verdict for this protocol, fixed with the supplement.

    Attributes:
        id: Directory under ``<out>/supplements/``.
        args: ``lnstab check --validate`` arguments beyond the data (shape or protocol).
        question: What the re-run asks.
        prediction: What was expected of it before it ran.
        rows: Rows whose published outcome differs under this protocol (replacing the set's rows of the same id).
    """

    id: str
    args: tuple[str, ...]
    question: str
    prediction: str
    rows: tuple[Row, ...] = ()


SUPPLEMENTS: tuple[Supplement, ...] = (
    Supplement(
        "depth16", ("--rows", "post-ln,deepnorm", "--model.n_layer", "16"),
        "Is DeepNorm's disagreement the depth? DeepNet's evidence is at 18–1,000 layers, Liu et al.'s Post-LN "
        "diverges at 18 layers and not at 6; at 16 layers (α = 2.38, β = 0.30 instead of 1.68, 0.42; references "
        "at 16 layers too) Post-LN should fail and DeepNorm pass or warn.",
        "Post-LN FAIL (gradient spread); DeepNorm uncertain: if it still fails on gradient spread at 16 layers, the "
        "criterion, not the depth, misjudges it."),
    Supplement(
        "seeds-rungs", ("--seeds", "2,3", "--lrs", "3e-4,3e-3,3e-2,3e-1"),
        "Do the verdicts hold on seeds (2, 3) and learning rates (half a decade off every default rung, one rung "
        "wider at both ends) that the thresholds were never run on?",
        "The 10 agreeing rows agree again; ReZero still fails (it diverges at 0.1, so at 0.3 too) and DeepNorm "
        "still fails on gradient spread; verdicts near a band's edge (LayerScale's overflow warning, the "
        "LR-sensitivity warnings) may move between PASS and WARN."),
    Supplement(
        "deep-regime", ("--rows", "post-ln,deepnorm,rezero", "--model.n_layer", "18", "--warmup-steps", "0",
                        "--lrs", "5e-4,1e-3", "--steps", "120"),
        "Do DeepNorm's and ReZero's disagreements come from the regime? Their sources report them for deep models "
        "at ordinary Adam rates, not for 4 layers at a ladder topped by 0.1. At 18 layers (the depth at which "
        "Liu et al.'s Post-LN fails and DeepNet compares; α = 2.45, β = 0.29), without warmup (Xiong et al.'s "
        "failing condition for Post-LN), at 5e-4 and 1e-3 (rates of Xiong et al.'s Post-LN comparison) and for 120 "
        "steps instead of 30, references at 18 layers too: does the card fail Post-LN and pass or warn DeepNorm "
        "and ReZero?",
        "Post-LN FAIL (gradient spread; without warmup its loss may also lag the references', as Xiong et al. "
        "report); ReZero PASS or WARN (no divergence at these rates; its gates start at 0, so LR sensitivity or "
        "loss may warn); DeepNorm uncertain: FAIL on gradient spread if that criterion sees Post-LN's mechanism "
        "whatever the outcome, as at 16 layers, PASS or WARN if its spread at ordinary rates stays within a decade "
        "of the references'. If DeepNorm fails on gradient spread here while its loss matches the references', "
        "gradient spread cannot decide a design's verdict on its own."),
    Supplement(
        "no-clip", ("--rows", "post-ln,deepnorm", "--model.n_layer", "18", "--warmup-steps", "0",
                    "--lrs", "5e-4,1e-3", "--steps", "120", "--grad-clip", "0"),
        "Did gradient clipping hide the difference? The check clips every subject's gradient norm at 1, a "
        "mitigation in itself; the fairseq recipes of the Post-LN comparisons (Xiong et al., Liu et al.) train "
        "without it (--clip-norm 0). deep-regime's protocol with clipping off, references too: does Post-LN now "
        "diverge or fall further behind, and DeepNorm train like the references?",
        "Post-LN FAIL (gradient spread; without the clip some runs may diverge, or its loss lag Pre-LN's by more "
        "than deep-regime's). DeepNorm: FAIL again more likely than not, as in all three regimes so far, where it "
        "trained exactly as Post-LN did; PASS or WARN only if clipping was what held Post-LN back to DeepNorm's "
        "behaviour. If both diverge or both train alike again, clipping is not the reason the check cannot tell "
        "them apart."),
    Supplement(
        "no-warmup-6", ("--rows", "post-ln,deepnorm", "--model.n_layer", "6", "--warmup-steps", "0",
                        "--lrs", "5e-4,1e-3", "--steps", "120"),
        "The twin of long-warmup-6 without its warmup: 6 layers (the Transformer's and Xiong et al.'s), 120 steps at "
        "5e-4 and 1e-3, no warmup (Xiong et al.'s failing condition), references at 6 layers too. Its Post-LN card "
        "is what long-warmup-6's is compared with.",
        "Post-LN FAIL (gradient spread, as at 4 and 18 layers); DeepNorm FAIL as Post-LN, as in every regime so "
        "far."),
    Supplement(
        "long-warmup-6", ("--rows", "post-ln,deepnorm", "--model.n_layer", "6", "--warmup-steps", "40",
                          "--lrs", "5e-4,1e-3", "--steps", "120"),
        "Does the check credit the recipe that makes Post-LN train? Published Post-LN trains with a long warmup "
        "(the original Transformer; BERT), so under a protocol with one the outcome implies PASS or WARN, not "
        "FAIL. no-warmup-6's protocol with a warmup of 40 steps, 2/(1 − β₂) for the check's AdamW β₂ = 0.95 (Ma & "
        "Yarats' rule for an adequate warmup), a third of the run.",
        "Post-LN uncertain, FAIL more likely than not: gradient spread is read off the trained model, median over "
        "steps, and is the profile of LN(x + f(x)), which a warmup changes in the early steps only; if it fails, "
        "the check cannot credit a recipe that makes Post-LN train, and the main set's Post-LN row agrees on the "
        "mechanism, not the outcome. PASS or WARN if the spread narrows to within a decade of the references' "
        "(compare no-warmup-6). DeepNorm as Post-LN, as in every regime so far.",
        rows=(Row("post-ln", "Post-LN with a long warmup (40 of 120 steps: 2/(1 − β₂), β₂ = 0.95), 6 layers",
                  ("--model.norm_placement", "post"),
                  "trains: Post-LN is the original Transformer, trained with Adam and a 4,000-step warmup; with a "
                  "warmup, 6-layer Post-LN converges where it fails without one",
                  "Vaswani et al. 2017, Attention Is All You Need, §5.3; Xiong et al. 2020, Fig. 2 (Post-LN with "
                  "warm-up); Liu et al. 2020, Fig. 1 (6-layer Post-LN); warmup length: Ma & Yarats 2021, On the "
                  "Adequacy of Untuned Warmup for Adaptive Optimization",
                  STABLE),)),
)
SUPPLEMENT_IDS = {s.id: s for s in SUPPLEMENTS}


def supplement_argv(sup_id: str, argv: list[str]) -> list[str]:
    """``argv`` (a ``--validate`` command line) with supplement ``sup_id``'s arguments appended.

    Raises:
        LNStabError: ``sup_id`` is not a supplement, or ``argv`` gives a flag the supplement sets itself.
    """
    sup = SUPPLEMENT_IDS.get(sup_id)
    if sup is None:
        raise LNStabError(f"--supplement {sup_id} is not allowed; supplements: {', '.join(SUPPLEMENT_IDS)}")
    own = [a for a in sup.args if a.startswith("--")]
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    clash = [a for a in own if a in given]
    if clash:
        raise LNStabError(f"--supplement {sup_id} sets {', '.join(own)} itself; {clash[0]} is not allowed with it "
                          "(give only the data, output and machine options)")
    return [*argv, *sup.args]


def supplement_rows(sup: Supplement | None, rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """``rows`` with supplement ``sup``'s own rows (its protocol's outcomes) in place of theirs."""
    own = {r.id: r for r in sup.rows} if sup is not None else {}
    return tuple(own.get(r.id, r) for r in rows)
