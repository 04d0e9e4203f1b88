"""The placement table: which norms a Block has under each ``norm_placement``, one frozen row per placement.

:mod:`lnstab.model` (which re-exports these names and draws the table in its docstring), the Hugging Face export
(:mod:`lnstab.hf`) and the growth bound (through ``GPT.output_norms``) all read a row; adding a placement is one row
here plus its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One LayerNorm placement: which of a block's norms are real modules (the others are ``nn.Identity()``).

    Attributes:
        name: The ``norm_placement`` value that selects it.
        input: ``ln_1``/``ln_2`` normalise each sublayer's input.
        output: ``ln_1_out``/``ln_2_out`` normalise each sublayer's output before it is added to the stream.
        post: ``ln_1_post``/``ln_2_post`` normalise the stream after each residual add.
        final: ``ln_f`` normalises the stream before the head.
        doc: What the placement is and where it comes from (its docstring).
        stream_scale: ``α(n_layer)``, the weight of the stream in every residual update ``α·x + Δt·f``; ``None``: 1.
        init_gain: ``β(n_layer)`` of DeepNet's initialisation (:meth:`lnstab.model.GPT.reset_parameters`);
            ``None``: GPT-2's.
    """

    name: str
    input: bool
    output: bool
    post: bool
    final: bool
    doc: str
    stream_scale: Callable[[int], float] | None = None
    init_gain: Callable[[int], float] | None = None

    @property
    def norms(self) -> frozenset[str]:
        """The norms that exist, by field name (``{"input", "final"}`` for ``pre``)."""
        return frozenset(k for k in ("input", "output", "post", "final") if getattr(self, k))

    @property
    def normalised_updates(self) -> bool:
        """Whether every residual update is ``x + Δt·N(y)`` with an output norm ``N`` that nothing renormalises
        afterwards (nor weights the stream): the form Theorem 4's growth bound needs."""
        return self.output and not self.post and self.stream_scale is None


def deepnorm_alpha(n_layer: int) -> float:
    """DeepNorm's stream weight for an ``n_layer``-layer decoder-only model: α = (2N)^(1/4)."""
    return (2 * n_layer) ** 0.25


def deepnorm_beta(n_layer: int) -> float:
    """DeepNorm's initialisation gain for an ``n_layer``-layer decoder-only model: β = (8N)^(-1/4)."""
    return (8 * n_layer) ** -0.25


DEEPNORM_DOC = (
    "DeepNorm (Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers): Post-LN with the stream "
    "up-weighted, LN(α·x + Δt·f(x)), α = (2N)^(1/4), and Xavier-normal init with gain β = (8N)^(-1/4) on the value, "
    "attention-output and both MLP projections, gain 1 on the query and key projections (N = n_layer; the "
    "decoder-only column of the paper's Figure 2(b), the initialisation of its pseudocode in Figure 2(a); Microsoft's "
    "torchscale uses the same constants). Δt still scales f: with LayerNorm or RMSNorm, which are invariant to the "
    "scale of their input (up to eps), LN(α·x + Δt·f) = LN(x + (Δt/α)·f), so the forward pass is Post-LN at step "
    "Δt/α and Δt = 1 is DeepNet's rule."
)

PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement("pre", input=True, output=False, post=False, final=True,
                  doc="Pre-LN (GPT-2): x + Δt·f(LN(x)); the stream itself is never normalised until ln_f."),
        Placement("peri", input=True, output=True, post=False, final=True,
                  doc="Peri-LN (Gemma 2, Kan et al. §4): x + Δt·LN_out(f(LN_in(x))); every update is normalised."),
        Placement("post", input=False, output=False, post=True, final=False,
                  doc="Post-LN (the original Transformer): LN(x + Δt·f(x)); renormalises the stream each half-step."),
        Placement("output", input=False, output=True, post=False, final=True,
                  doc="Output-LN (OLMo 2's reordered norm): x + Δt·LN(f(x)); the sublayer sees the raw stream."),
        Placement("none", input=False, output=False, post=False, final=False,
                  doc="No normalisation at all: x + Δt·f(x) (the unstable baseline)."),
        Placement("deepnorm", input=False, output=False, post=True, final=False, doc=DEEPNORM_DOC,
                  stream_scale=deepnorm_alpha, init_gain=deepnorm_beta),
    )
}
NORM_PLACEMENTS = tuple(PLACEMENTS)
