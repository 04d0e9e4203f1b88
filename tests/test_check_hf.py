"""Hugging Face families in ``lnstab check``: where Gemma 2's and OLMo 2's output norms are (and that Llama's
``post_attention_layernorm`` is not one), Gemma's ``1 + weight`` gain in Theorem 4's sum, the bound checked end to end
on directories built from configs (no downloads), and dropout switched off for train-mode stress runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.check import SHAPE, TINY, check, olmo2, rows
from torch import nn

from lnstab.check.hf import HFCausalLM, LayerUpdates
from lnstab.check.subjects import hf_subject


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)
    config._attn_implementation = "eager"
    return Gemma2ForCausalLM(config)


def gemma3() -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)
    config._attn_implementation = "eager"
    return Gemma3ForCausalLM(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=2))


def residual_updates(model: nn.Module, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's output minus its input, and the sum of the outputs of the two named norms, on one batch."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, value: torch.Tensor) -> None:
        seen.setdefault(name, value[0] if isinstance(value, tuple) else value)

    layer = model.model.layers[0]
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: keep("in", a[0] if a else k["hidden_states"]),
                                             with_kwargs=True),
             layer.register_forward_hook(lambda m, a, o: keep("out", o))]
    hooks += [getattr(layer, n).register_forward_hook(lambda m, a, o, n=n: keep(n, o)) for n in names]
    torch.manual_seed(0)
    with torch.no_grad():
        for norm in names:  # away from init, so a gain read as weight instead of 1 + weight would show
            getattr(layer, norm).weight.normal_(0, 0.3)
        model(input_ids=torch.randint(0, 128, (2, 8)), use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen["out"] - seen["in"], seen[names[0]] + seen[names[1]]


@pytest.mark.parametrize("build", [gemma2, gemma3, olmo2])
def test_the_located_norms_are_the_residual_updates(build) -> None:
    update, norms = residual_updates(build(), ("post_attention_layernorm", "post_feedforward_layernorm"))
    torch.testing.assert_close(update, norms, rtol=1e-5, atol=1e-5)  # x_out = x_in + N_attn(·) + N_mlp(·)


def test_llamas_post_attention_layernorm_is_not_an_output_norm() -> None:
    model = llama()
    update, norms = residual_updates(model, ("post_attention_layernorm", "input_layernorm"))
    assert not torch.allclose(update, norms, atol=1e-3)  # the name is Llama's MLP *input* norm
    assert HFCausalLM(model).output_norms() == []  # so no output norms are located, and Theorem 4 is n/a


@pytest.mark.parametrize(("build", "offset"), [(gemma2, 1.0), (gemma3, 1.0), (olmo2, 0.0)])
def test_theorem_4_reads_each_layers_two_gains(build, offset) -> None:
    model = build()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.post_attention_layernorm.weight.fill_(0.5 + i)
            layer.post_feedforward_layernorm.weight.fill_(-3.0)
    updates = HFCausalLM(model).output_norms()
    assert [dt for _, dt in updates] == [1.0, 1.0] and all(isinstance(u, LayerUpdates) for u, _ in updates)
    for i, (u, _) in enumerate(updates):  # Gemma: |1 + w|; OLMo 2: |w|
        expected = abs(offset + 0.5 + i) + abs(offset - 3.0)
        assert u.weight.item() == pytest.approx(expected) and u.bias is None


def test_gemma_rmsnorm_scales_by_one_plus_weight() -> None:
    norm = gemma2().model.layers[0].post_attention_layernorm
    with torch.no_grad():
        norm.weight.fill_(0.25)
    x = torch.randn(3, 32)
    rms = x / x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt()
    torch.testing.assert_close(norm(x), rms * 1.25)


@pytest.mark.parametrize("build", [gemma2, gemma3, olmo2])
def test_theorem_4_is_checked_on_directories_built_from_configs(build, tmp_path) -> None:
    build().save_pretrained(tmp_path / "model")
    code, report = check(tmp_path / "card", "--hf", str(tmp_path / "model"), "--hf-init", "--lrs", "1e-2", *TINY)
    bound = rows(report)["bound"]
    assert bound["status"] == "pass" and bound["measured"] == 0 and "holds" in bound["why"]
    assert report["summaries"]["checked"]["bound"]["min_slack"] > 0
    assert "post_attention_layernorm" in report["model"]["sites"]["norm_pattern"]
    assert rows(report)["attention"]["status"] != "n/a"  # q and k found in each family's attention


def test_hugging_face_dropout_is_switched_off_in_the_config(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.1,
                        embd_pdrop=0.2, attn_pdrop=0.3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    subject = hf_subject(str(tmp_path / "gpt2"), init=True)
    overrides = dict(subject.recipe.overrides)
    assert {k: overrides[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")} == {
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    model = subject.build()
    assert model.hf.config.attn_pdrop == 0.0
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert "attn_pdrop" in subject.dropout and "train mode" in subject.dropout
    trained = hf_subject(str(tmp_path / "gpt2"), init=False)  # trained weights keep their own vocabulary
    assert trained.with_vocab(10) is None and subject.with_vocab(10).shape.vocab_size == 10


def saved(tmp_path, name: str, model: nn.Module) -> str:
    directory = tmp_path / name
    model.save_pretrained(directory)
    return str(directory)


def test_an_encoder_and_a_multimodal_model_are_refused_in_one_line(tmp_path, capsys) -> None:
    """BERT's LM head trained as if causal: it read the next token (exit 0, PASS before); a multimodal Gemma 3 config
    has its depth in text_config (a TypeError, exit 3 before)."""
    from transformers import BertConfig, BertForMaskedLM, Gemma3Config, Gemma3ForConditionalGeneration

    bert = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32))
    multimodal = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(SHAPE, num_key_value_heads=2, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8), mm_tokens_per_image=4, image_token_index=127,
        boi_token_index=126, eoi_token_index=125))
    cases = ((saved(tmp_path, "bert", bert), "checked (bert, init) is not causal: changing tokens"),
             (saved(tmp_path, "mm", multimodal), "is a multimodal model (gemma3)"))
    capsys.readouterr()  # save_pretrained's progress bars
    for directory, said in cases:
        code, _ = check(tmp_path / "card", "--hf", directory, "--hf-init", "--lrs", "1e-2", "--no-reference", *TINY)
        err = capsys.readouterr().err.strip()
        assert code == 2 and said in err and "\n" not in err, err
        assert not (tmp_path / "card").exists()


def test_a_model_whose_forward_fails_is_one_line_and_an_unread_context_is_read(tmp_path, capsys) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, MptConfig, MptForCausalLM

    broken = LlamaForCausalLM(LlamaConfig(**SHAPE))
    broken.config.num_key_value_heads = 3  # 2 query heads cannot share 3 key heads: its own forward fails
    mpt = MptForCausalLM(MptConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=12, vocab_size=128))
    cases = ((saved(tmp_path, "broken", broken), [], "checked (llama, init) failed on token ids"),
             (saved(tmp_path, "mpt", mpt), ["--seq-len", "16"], "context of 12"))
    capsys.readouterr()  # save_pretrained's progress bars
    for directory, args, said in cases:
        code, _ = check(tmp_path / "card", "--hf", directory, "--hf-init", "--lrs", "1e-2", "--no-reference",
                        *TINY, *args)  # before: exit 3 with no traceback file, and MPT's context unknown
        err = capsys.readouterr().err.strip()
        assert code == 2 and said in err and "\n" not in err, err


def test_the_decoder_of_an_encoder_decoder_is_what_is_shaped_and_the_pad_token_trains(tmp_path) -> None:
    """BART's num_hidden_layers is its encoder's; a relabelled token that was the config's pad_token_id had a zero,
    frozen embedding row."""
    from transformers import BartConfig, BartForCausalLM

    bart = BartForCausalLM(BartConfig(vocab_size=128, d_model=32, encoder_layers=6, decoder_layers=2,
                                      encoder_attention_heads=8, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=1))
    subject = hf_subject(saved(tmp_path, "bart", bart), True)
    assert (subject.shape.n_layer, subject.shape.n_head) == (2, 4)  # before: 6 and 8, the encoder's
    for model in (subject.with_vocab(100).build(), hf_subject(saved(tmp_path, "olmo2", olmo2()), True).build()):
        embedding = model.hf.get_input_embeddings()
        assert embedding.padding_idx is None and embedding.weight[:2].norm(dim=1).min() > 0
        model.train()(torch.tensor([[0, 1, 2, 3]])).sum().backward()
        assert embedding.weight.grad[:2].norm(dim=1).min() > 0  # rows 0 and 1 (the pad ids) learn


def test_training_only_branches_and_ignored_custom_code_are_said_on_the_card(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                   num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                   layerdrop=0.2))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    gpt2.config.auto_map = {"AutoModelForCausalLM": "modeling_mine.MyLM"}
    assert "left on as training-only branches: layerdrop 0.2" in hf_subject(saved(tmp_path, "opt", opt), True).dropout
    assert "its auto_map (custom code) is ignored" in hf_subject(saved(tmp_path, "gpt2", gpt2), True).dropout


def test_trained_weights_load_without_a_progress_bar(tmp_path, capfd) -> None:
    """Each process that built an --hf model with trained weights (the parent's probes, every worker) printed
    transformers' 'Loading weights: 100%|████' bar on stderr: three on a one-run check, with --no-progress too."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    directory = saved(tmp_path, "gpt2", GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                   n_positions=16)))
    capfd.readouterr()  # save_pretrained's own bars
    before = hf_logging.is_progress_bar_enabled()  # process-wide: an earlier test in this worker may have set it
    hf_logging.enable_progress_bar()
    try:
        hf_subject(directory, init=False).build()
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()  # given back as it was
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def test_a_file_given_as_hf_is_one_line_saying_so(tmp_path, capsys) -> None:
    """--hf of a model's config.json (not its directory) read the file as the config, then torch.load-ed it as the
    weights: 'Weights only load failed. In PyTorch 2.6, we changed the default value of ... weights_only', with 'not
    a local directory; without network only local directories work', as if the network were the matter."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()
    code, _ = check(tmp_path / "card", "--hf", str(tmp_path / "gpt2" / "config.json"), "--lrs", "1e-2",
                    "--no-reference", *TINY)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "config.json' is a file; give the directory save_pretrained wrote" in err, err
    assert "\n" not in err and "weights_only" not in err and not (tmp_path / "card").exists()


def unreachable_hub(tmp_path: Path) -> dict[str, str]:
    """An environment whose Hugging Face hub refuses every connection (a local port nothing listens on: refused at
    once, whatever the machine's network), ``HF_HUB_OFFLINE`` unset, and an empty cache of its own."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "HF_DATASETS_OFFLINE")}
    return {**env, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1"}


def hf_check(tmp_path: Path, env: dict[str, str], name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lnstab", "check", "--hf", name, "--lrs", "1e-2", "--no-reference",
                           *TINY, "--out", str(tmp_path / "card")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_hub_name_with_the_hub_unreachable_is_one_line_at_once(tmp_path) -> None:
    """Without network, --hf gpt2 waited through huggingface_hub's five retries, a warning each ('Retrying in 8s
    [Retry 5/5]'), then said only that transformers could not connect."""
    done = hf_check(tmp_path, unreachable_hub(tmp_path), "someone/tiny-gpt2")
    err = done.stderr.strip()
    assert done.returncode == 2 and err == (
        "lnstab: error: --hf 'someone/tiny-gpt2' cannot be loaded: the Hugging Face hub cannot be reached "
        "(ConnectError) and the model is not in the local Hugging Face cache; give --hf a local directory of the "
        "model (what save_pretrained wrote), which works offline"), err
    assert not (tmp_path / "card").exists()


def test_a_cached_hub_model_is_checked_with_the_hub_unreachable(tmp_path) -> None:
    """A hub name in the local Hugging Face cache loads from it, in the check's process and in its worker, without a
    word about the hub."""
    from transformers import GPT2Config, GPT2LMHeadModel

    env = unreachable_hub(tmp_path)
    repo, commit = Path(env["HF_HUB_CACHE"]) / "models--someone--tiny-gpt2", "0" * 40
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    done = hf_check(tmp_path, env, "someone/tiny-gpt2")
    assert done.returncode in (0, 1), done.stderr
    assert "Hub" not in done.stderr and "Retry" not in done.stderr, done.stderr
    report = json.loads((tmp_path / "card" / "report.json").read_text())
    assert report["model"]["shape"]["n_layer"] == 2
