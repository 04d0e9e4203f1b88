"""``lnstab check --factory`` with a user's vocabulary (issue 39, items 5 and 6): a factory without ``vocab_size``
is told, before any run, what training its own 50,257-token vocabulary costs and how to take ``vocab_size``; one
with it is not; a Hugging Face model from a factory has its context read from its config (``n_positions``) and is
built with the protocol vocabulary without transformers' warnings about bos/eos ids outside it."""

from __future__ import annotations

import re

import pytest
import torch
from support.check import TINY, check

from lnstab.check.factory import factory_subject

QUIET = [a for a in TINY if a != "--no-progress"]  # the progress bar shows when the first run starts
LAYERS = ["--layer-pattern", r"layers\.(\d+)$"]
NOTE = "takes no vocab_size argument"


def test_a_factory_without_vocab_size_is_told_its_cost_before_any_run(tmp_path, capsys) -> None:
    import check_factories

    code, report = check(tmp_path / "card", "--factory", "check_factories:gpt2_vocab_lm", *LAYERS, "--lrs", "1e-2",
                         *QUIET, "--no-reference")
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if NOTE in line]
    assert len(notes) == 1, err  # one line
    note = notes[0]
    assert code == 0 and report["data"]["vocab"]["mode"] == "model"  # it trained its own vocabulary
    protocol = int(re.search(r"the ([\d,]+) tokens of the protocol vocabulary", note).group(1).replace(",", ""))
    assert 1 < protocol < 50257
    total = sum(p.numel() for p in check_factories.gpt2_vocab_lm().parameters())
    assert f"its 50,257 × 32 head alone is {50257 * 32 / 1e6:.3g}M of its {total / 1e6:.3g}M parameters" in note
    assert f"{50257 / protocol:.3g}×" in note and "50,257-token vocabulary" in note
    assert "gpt2_vocab_lm(vocab_size: int = 50257)" in note  # how to take it
    assert err.index(note) < err.index("0%|"), err  # before the progress bar's first line: before any run


def test_a_factory_taking_vocab_size_is_not_told(tmp_path, capsys) -> None:
    code, report = check(tmp_path / "card", "--factory", "check_factories:gpt2_vocab_sized_lm", *LAYERS, "--lrs",
                         "1e-2", *QUIET, "--no-reference")
    err = capsys.readouterr().err
    assert code == 0 and report["data"]["vocab"]["mode"] == "protocol" and NOTE not in err
    assert "0%|" in err  # the progress bar was there to be preceded


HF_GPT2 = ["--factory", "check_factories:hf_gpt2_lm", "--lrs", "1e-2", *TINY, "--no-reference"]


def test_a_hugging_face_factory_states_its_context(tmp_path, capsys) -> None:
    """GPT-2's config holds its context as n_positions: the card said "context unknown", and a --seq-len beyond it
    failed inside the model instead of being refused."""
    code, report = check(tmp_path / "card", *HF_GPT2)
    assert code == 0 and report["model"]["shape"]["block_size"] == 32
    assert "2 layers × 32 wide, context 32" in (tmp_path / "card" / "report.md").read_text()
    capsys.readouterr()
    code, _ = check(tmp_path / "long", *HF_GPT2, "--seq-len", "64")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--seq-len=64 is not allowed" in err and "context of 32" in err and "\n" not in err, err


def test_a_hugging_face_factory_is_built_with_bos_and_eos_ids_in_the_protocol_vocabulary(tmp_path, capfd) -> None:
    """GPT2Config keeps bos/eos 50256 whatever vocab_size it is given: transformers warned of both in every process
    that built the model with the protocol vocabulary. The ids are None in the model trained, its weights those
    the factory builds."""
    import check_factories

    code, report = check(tmp_path / "card", *HF_GPT2)
    err = capfd.readouterr().err
    assert code == 0 and report["data"]["vocab"]["mode"] == "protocol"
    assert "integer within the vocabulary" not in err, err
    subject = factory_subject("check_factories:hf_gpt2_lm", None, None, 16).with_vocab(100)
    torch.manual_seed(0)
    built = subject.build()
    assert built.config.bos_token_id is None and built.config.eos_token_id is None
    torch.manual_seed(0)
    own = check_factories.hf_gpt2_lm(vocab_size=100)  # what is trained is what the factory builds
    capfd.readouterr()
    for (name, a), (_, b) in zip(built.state_dict().items(), own.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_an_unanchored_site_pattern_is_refused_under_its_own_flag() -> None:
    """A site pattern giving one index to a block and its submodule was refused as --layer-pattern, a flag the user
    may not have given (this one was anchored)."""
    from lnstab.errors import LNStabError

    layers = r"unit_(\d+)$"
    with pytest.raises(LNStabError, match=r"^--norm-pattern 'unit_\(\\d\+\)' is not allowed; it gives layer index 3"):
        factory_subject("check_factories:reversed_lm", layers, None, 16, norm_pattern=r"unit_(\d+)")
    assert factory_subject("check_factories:reversed_lm", layers, None, 16, norm_pattern=layers).sites.norm_pattern


def test_module_types_whose_modules_have_no_submodules_are_refused_by_name() -> None:
    """--module-types torch.nn.LayerNorm was taken as the blocks' class: the card graded the norms as layers. Each
    class is judged alone: a leaf class beside the blocks' own is refused under its own name."""
    from lnstab.errors import LNStabError

    blocks = "torch.nn.TransformerEncoderLayer"
    with pytest.raises(LNStabError, match=r"^--module-types 'torch\.nn\.Linear' is not allowed; it matched 7 modules "
                                          r"with no submodules \(encoder\.layers\.0\.self_attn\.out_proj, "
                                          r"encoder\.layers\.0\.linear1, …\), .*give the class of the blocks"):
        factory_subject("check_factories:encoder_lm", None, f"{blocks}, torch.nn.Linear", 16)
    assert factory_subject("check_factories:encoder_lm", None, blocks, 16).shape.n_layer == 2


def test_a_users_own_block_class_with_bare_parameters_is_taken() -> None:
    """The leaf refusal is for torch's own layers: a block a user wrote with bare parameters and functional ops has
    no submodules either, and is a block."""
    import torch
    from torch import nn

    from lnstab.check.factory import check_block_types
    from lnstab.errors import LNStabError

    class BareBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x @ self.w

    model = nn.Sequential(BareBlock(), nn.LayerNorm(8), BareBlock())
    check_block_types(model, "BareBlock", (BareBlock,))  # taken
    with pytest.raises(LNStabError, match=r"^--module-types 'torch\.nn\.LayerNorm' is not allowed; it matched 1 module "
                                          r"with no submodules \(1\)"):
        check_block_types(model, "torch.nn.LayerNorm", (nn.LayerNorm,))


def test_a_layer_pattern_that_selects_torch_layers_without_submodules_is_refused() -> None:
    """--layer-pattern 'layers\\.(\\d+)\\.norm1$' was graded as the blocks, as --module-types torch.nn.LayerNorm was."""
    from lnstab.errors import LNStabError

    norms = r"layers\.(\d+)\.norm1$"
    said = re.escape(f"--layer-pattern {norms!r} is not allowed; it matched 2 modules with no submodules "
                     "(encoder.layers.0.norm1, encoder.layers.1.norm1)")
    with pytest.raises(LNStabError, match=f"^{said}.*give a pattern of the blocks that hold them$"):
        factory_subject("check_factories:encoder_lm", norms, None, 16)
    assert factory_subject("check_factories:encoder_lm", r"layers\.(\d+)$", None, 16).shape.n_layer == 2
