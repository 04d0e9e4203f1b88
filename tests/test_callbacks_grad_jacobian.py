"""GradientStatistics equals direct norms; JacobianSensitivity's power iteration matches the exact Jacobian."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from support.callbacks import gpt, lit, loader, trainer
from torch.nn.attention import SDPBackend, sdpa_kernel

from lnstab.callbacks import GradientStatistics, JacobianSensitivity, spectral_norm


class DirectNorms(pl.Callback):
    """Per-layer norms computed the plain way, in the same hook, after GradientStatistics."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads: dict[str, list[torch.Tensor]] = {}
        weights: dict[str, list[torch.Tensor]] = {}
        for name, p in pl_module.named_parameters():
            if m := re.search(r"\.h\.(\d+)\.", name):
                tag = f"L{int(m.group(1)):02d}"
                grads.setdefault(tag, []).append(p.grad.flatten())
                weights.setdefault(tag, []).append(p.detach().flatten())
        out = {f"grad/norm/{t}": torch.cat(g).norm().item() for t, g in grads.items()}
        out.update({f"weight/norm/{t}": torch.cat(w).norm().item() for t, w in weights.items()})
        out["grad/norm/total"] = torch.cat([p.grad.flatten() for p in pl_module.parameters()]).norm().item()
        out["weight/norm/total"] = torch.cat([p.detach().flatten() for p in pl_module.parameters()]).norm().item()
        self.by_step[trainer.global_step] = out


def test_gradient_statistics_equal_direct_norms(tmp_path):
    module = lit("gpt", gpt={"n_layer": 3})
    callback, direct = GradientStatistics(every_n_steps=2), DirectNorms()
    seen = {}

    class Keep(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if callback.last:
                seen[trainer.global_step] = dict(callback.last)
                callback.last = {}

    trainer(tmp_path, [callback, direct, Keep()], max_steps=5).fit(module, loader(n=32))
    assert sorted(seen) == [0, 2, 4]
    for step, metrics in seen.items():
        expected = direct.by_step[step]
        assert set(metrics) == set(expected) and "grad/norm/L02" in metrics
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5), key
    csv = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "grad/norm/L00" in csv.splitlines()[0]


def test_gradient_statistics_arguments_and_foreign_layers(tmp_path):
    with pytest.raises(ValueError, match="layer_pattern="):
        GradientStatistics(layer_pattern=r"layers\.\d+\.")  # no capture group
    with pytest.raises(ValueError, match="every_n_steps=-1"):
        GradientStatistics(every_n_steps=-1)
    callback = GradientStatistics(every_n_steps=1)
    trainer(tmp_path, [callback], max_steps=1).fit(lit("encoder"), loader())
    assert callback.layers == ["L00", "L01"]
    assert callback.last["grad/norm/total"] >= max(callback.last["grad/norm/L00"], callback.last["grad/norm/L01"])
    # a group that captures the block's name, not its index, was said as 'matched no parameter'
    unnumbered = GradientStatistics(every_n_steps=1, layer_pattern=r"(h\.\d+)\.")
    with pytest.warns(UserWarning, match=r"^GradientStatistics: layer_pattern=.* captured 'h\.0' in "
                                         r"'model\.transformer\.h\.0\..*', no layer index .*; only totals"):
        unnumbered.setup(None, lit("gpt"), "fit")
    assert unnumbered.layers == []


def exact_norms(block: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    def fn(z):
        return block(z)[0]

    with sdpa_kernel(SDPBackend.MATH):
        jac = torch.autograd.functional.jacobian(fn, x).reshape(x.numel(), x.numel())
    eye = torch.eye(x.numel())
    return torch.linalg.matrix_norm(jac, ord=2).item(), torch.linalg.matrix_norm(jac - eye, ord=2).item()


@pytest.mark.parametrize("placement", ["peri", "pre"])
def test_power_iteration_within_5_percent_of_exact_spectral_norm(placement):
    torch.manual_seed(0)
    model = gpt(placement, n_embd=16, n_head=2).eval()
    block = model.transformer.h[0]
    with torch.no_grad():  # make the branch matter: larger output projections than at init
        for p in block.parameters():
            if p.dim() == 2:
                p.mul_(20.0)
    x = torch.randn(1, 6, 16)
    full_exact, branch_exact = exact_norms(block, x)
    with sdpa_kernel(SDPBackend.MATH):
        full = spectral_norm(lambda z: block(z)[0], x, n_iter=50).item()
        branch = spectral_norm(lambda z: block(z)[0] - z, x, n_iter=50).item()
    assert full == pytest.approx(full_exact, rel=0.05)
    assert branch == pytest.approx(branch_exact, rel=0.05)
    assert branch_exact > 0.1  # the test is not trivial


def test_jacobian_callback_matches_exact_and_leaves_training_state(tmp_path):
    module = lit("gpt", gpt={"n_embd": 16, "n_head": 2, "dropout": 0.1})
    callback = JacobianSensitivity(every_n_steps=3, probe_size=1, n_iter=50)
    x = loader().dataset.tensors[0][:1, :6]
    callback.probe = x
    callback.setup(None, module, "fit")
    module.train()
    assert all(p.grad is None for p in module.parameters())
    inputs = {}
    handle = module.model.transformer.h[1].register_forward_pre_hook(lambda m, a: inputs.update(x=a[0]))
    metrics = callback.measure(module)
    handle.remove()
    assert module.training and module.model.transformer.h[1].attn.training
    assert all(p.grad is None for p in module.parameters())  # nothing leaked into .grad
    full_exact, branch_exact = exact_norms(module.model.transformer.h[1].eval(), inputs["x"])
    assert metrics["jacobian/residual/L01"] == pytest.approx(full_exact, rel=0.05)
    assert metrics["jacobian/sensitivity/L01"] == pytest.approx(branch_exact, rel=0.05)
    assert metrics["jacobian/act_scale/L01"] == pytest.approx(inputs["x"].abs().mean().item(), rel=1e-6)


def test_jacobian_callback_in_training_uses_first_batch(tmp_path):
    module = lit("gpt")
    callback = JacobianSensitivity(every_n_steps=3, probe_size=2, n_iter=5)
    logged = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if callback.last:
                logged.append((trainer.global_step, sorted(callback.last)))
                callback.last = {}

    trainer(tmp_path, [callback, Spy()], max_steps=5).fit(module, loader())
    assert [s for s, _ in logged] == [0, 3]
    assert logged[0][1] == sorted(
        f"jacobian/{k}/L0{i}" for k in ("act_scale", "residual", "sensitivity") for i in (0, 1)
    )
    assert torch.equal(callback.probe, loader().dataset.tensors[0][:2])
    restored = JacobianSensitivity()
    restored.load_state_dict(callback.state_dict())
    assert torch.equal(restored.probe, callback.probe)


def test_jacobian_arguments():
    with pytest.raises(ValueError, match="probe_size=0"):
        JacobianSensitivity(probe_size=0)
    with pytest.raises(ValueError, match="probe="):
        JacobianSensitivity(probe=[1, 2])
    with pytest.raises(ValueError, match="n_iter="):
        JacobianSensitivity(n_iter=1.5)


def test_jacobian_refuses_a_lightning_module_without_forward_before_training(tmp_path):
    class NoForward(pl.LightningModule):  # a common shape: the step calls self.model, pl_module(x) is undefined
        def __init__(self):
            super().__init__()
            self.model = gpt()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = NoForward()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=r"model=NoForward is not allowed with JacobianSensitivity; it has no forward"):
        trainer(tmp_path, [JacobianSensitivity(every_n_steps=1)], max_steps=2).fit(module, loader())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # refused in setup


def test_a_probe_the_model_cannot_take_is_one_line_naming_probe(tmp_path):
    """Batches longer than the model's context (a user's batch of input and target in one tensor, say): the probe
    is the first tensor of the first batch, and the forward failed inside Hugging Face's embedding with a bare
    'IndexError: index out of range in self'."""
    from torch.utils.data import DataLoader, TensorDataset

    from lnstab.errors import ConfigError

    x = torch.randint(0, 100, (8, 33))  # HF GPT-2 of the tests has 32 positions
    too_long = DataLoader(TensorDataset(x, x), batch_size=4)
    with pytest.raises(ConfigError, match=r"^JacobianSensitivity: the model's forward on its probe \(shape \(2, 33\), "
                                          r"torch.int64;.*failed: IndexError: index out of range in self; give probe="):
        trainer(tmp_path, [JacobianSensitivity(every_n_steps=1, n_iter=2)], max_steps=1).fit(lit("hf"), too_long)


def test_a_hugging_face_batch_encoding_batch_gives_the_probe_its_input_ids(tmp_path):
    """Hugging Face's tokenizers and data collators (DataCollatorForLanguageModeling) give a ``BatchEncoding``, a
    mapping that is not a dict: the probe was refused at the first batch ('batch of type BatchEncoding is not
    allowed'), and ``unroll_repeats`` said it found no token ids."""
    from torch.utils.data import DataLoader
    from transformers import BatchEncoding

    from lnstab.callbacks import HiddenStateStatistics
    from lnstab.callbacks._unroll import example_of

    class DictLM(type(lit("gpt"))):
        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    x = loader().dataset.tensors[0]

    def collate(rows):
        ids = torch.stack(rows)
        return BatchEncoding({"attention_mask": torch.ones_like(ids), "input_ids": ids, "labels": ids.roll(-1, 1)})

    assert torch.equal(example_of(collate(list(x[:3])), 2), x[:2])
    callback = JacobianSensitivity(every_n_steps=2, probe_size=2, n_iter=2)
    hidden = HiddenStateStatistics(every_n_steps=1, unroll_repeats=True, series_file=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unroll_repeats")
        data = DataLoader(list(x), batch_size=4, collate_fn=collate)
        trainer(tmp_path, [callback, hidden], max_steps=2).fit(DictLM(gpt()), data)
    assert torch.equal(callback.probe, x[:2])  # the input ids, not the attention mask (its first tensor)
    assert "jacobian/residual/L01" in callback.last
