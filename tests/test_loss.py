"""The step's optimisations change no numbers: chunked head loss, vocabulary padding, fused AdamW, torch.compile."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lnstab.check.subjects import check_z_loss
from lnstab.loss import lm_head_loss, lm_head_losses, reference_lm_loss
from lnstab.model import GPT, GPTConfig

VOCAB = 97


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=16, **overrides)


def batch(seed: int = 0, b: int = 3, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g)


@pytest.mark.parametrize("chunk_rows", [1, 7, 48, 1000])
@pytest.mark.parametrize("padded_rows", [0, 31])
def test_chunked_head_loss_equals_logits_then_cross_entropy(chunk_rows: int, padded_rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 16, 24, generator=g, requires_grad=True)
    w = torch.randn(VOCAB + padded_rows, 24, generator=g, requires_grad=True)
    y = torch.randint(0, VOCAB, (3, 16), generator=g)
    expected = reference_lm_loss(h, w, y, VOCAB)
    eh, ew = torch.autograd.grad(2.5 * expected, (h, w))
    got = lm_head_loss(h, w, y, VOCAB, chunk_rows=chunk_rows)
    gh, gw = torch.autograd.grad(2.5 * got, (h, w))  # a non-unit upstream gradient reaches both inputs
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, eh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-7)
    assert gw[VOCAB:].abs().max() == 0 if padded_rows else True
    with torch.no_grad():  # the evaluation path forms no gradients
        torch.testing.assert_close(lm_head_loss(h, w, y, VOCAB, chunk_rows=chunk_rows), expected)


def test_chunked_head_loss_under_autocast_matches_the_usual_path() -> None:
    # Products in the autocast dtype, softmax and loss in fp32, gradients in the inputs' dtype. fp16 stands in for
    # bf16 here: the code path is the same and bf16 is emulated (slow) on CPUs without native bf16.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 16, 24, generator=g, requires_grad=True)
    w = torch.randn(128, 24, generator=g, requires_grad=True)
    y = torch.randint(0, VOCAB, (3, 16), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        expected, got = reference_lm_loss(h, w, y, VOCAB), lm_head_loss(h, w, y, VOCAB, chunk_rows=7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(expected, (h, w)), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_chunked_head_loss_refuses_bad_arguments() -> None:
    h, w, y = torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_rows=0 is not allowed"):
        lm_head_loss(h, w, y, chunk_rows=0)
    with pytest.raises(ValueError, match=r"vocab_size=6 is not allowed; it must be in \[1, 5\]"):
        lm_head_loss(h, w, y, vocab_size=6)
    with pytest.raises(ValueError, match=r"z_loss=-0.1 is not allowed; it must be a finite number >= 0"):
        lm_head_loss(h, w, y, z_loss=-0.1)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_a_z_loss_coefficient_is_refused_alike_by_the_config_the_head_and_the_check(bad) -> None:
    h, w, y = torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)
    said = []
    for call in (lambda: GPTConfig(z_loss=bad), lambda: lm_head_loss(h, w, y, z_loss=bad), lambda: check_z_loss(bad)):
        with pytest.raises(ValueError) as refused:
            call()
        said.append(str(refused.value).split("=", 1)[1])  # the field's name differs: z_loss, --z-loss
    assert said == [f"{bad!r} is not allowed; it must be a finite number >= 0"] * 3


def direct_z_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, c: float) -> tuple[torch.Tensor, ...]:
    """Cross-entropy and c·mean (log Z)² written out on the materialised logits, and their sum."""
    logits = (h @ w[:VOCAB].T).float().flatten(0, 1)  # (N, V)
    log_z = logits.exp().sum(-1).log()  # (N,), the definition (no max shift: these logits are small)
    ce = (log_z - logits.gather(1, y.flatten()[:, None])[:, 0]).mean()
    z = c * log_z.square().mean()
    return ce + z, ce, z


@pytest.mark.parametrize("chunk_rows", [10, 48])  # five chunks with the last one short (48 rows), and one chunk
def test_z_loss_value_and_gradients_equal_autograd_of_the_direct_expression(chunk_rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 16, 24, generator=g, requires_grad=True)
    w = torch.randn(VOCAB + 31, 24, generator=g).mul_(0.3).requires_grad_()
    y = torch.randint(0, VOCAB, (3, 16), generator=g)
    c = 0.05  # large enough that the z-loss term's gradient is far above the tolerance (PaLM's 1e-4 would hide it)
    expected, ce, z = direct_z_loss(h, w, y, c)
    eh, ew = torch.autograd.grad(1.7 * expected, (h, w), retain_graph=True)
    (ce_h,) = torch.autograd.grad(ce, h)
    parts = lm_head_losses(h, w, y, VOCAB, chunk_rows=chunk_rows, z_loss=c)
    gh, gw = torch.autograd.grad(1.7 * parts.loss, (h, w))
    torch.testing.assert_close(parts.loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.cross_entropy, ce.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.z_loss, z.detach(), rtol=1e-6, atol=1e-7)
    assert not parts.cross_entropy.requires_grad and not parts.z_loss.requires_grad
    torch.testing.assert_close(gh, eh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-7)
    assert gw[VOCAB:].abs().max() == 0
    assert (gh - 1.7 * ce_h).abs().max() > 1e-3  # the z-loss really moved the gradient
    torch.testing.assert_close(lm_head_loss(h, w, y, VOCAB, chunk_rows, z_loss=c), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference_lm_loss(h, w, y, VOCAB, z_loss=c), expected, rtol=1e-6, atol=1e-6)


def test_z_loss_under_bf16_autocast_matches_the_direct_expression() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 16, 24, generator=g, requires_grad=True)
    w = torch.randn(128, 24, generator=g).mul_(0.3).requires_grad_()
    y = torch.randint(0, VOCAB, (3, 16), generator=g)
    c = 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = direct_z_loss(h, w, y, c)[0]  # bf16 products, fp32 softmax, as the chunked path
        parts = lm_head_losses(h, w, y, VOCAB, chunk_rows=10, z_loss=c)
    assert parts.loss.dtype == parts.z_loss.dtype == torch.float32
    torch.testing.assert_close(parts.loss, expected, rtol=1e-3, atol=1e-3)
    for a, b in zip(torch.autograd.grad(parts.loss, (h, w)), torch.autograd.grad(expected, (h, w)), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_without_z_loss_the_objective_is_the_cross_entropy_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(40, 24, generator=g), torch.randn(VOCAB, 24, generator=g)
    y = torch.randint(0, VOCAB, (40,), generator=g)
    parts = lm_head_losses(h, w, y, chunk_rows=7)
    assert torch.equal(parts.loss, parts.cross_entropy) and parts.z_loss.item() == 0.0


def test_model_with_z_loss_trains_like_the_logits_path_with_z_loss() -> None:
    # every parameter's gradient, not only the head's: the z-loss reaches the whole model through the hidden states
    c = 0.05
    torch.manual_seed(0)
    model = GPT(tiny(pad_vocab_multiple=64, z_loss=c))
    model.loss_chunk_rows = 10
    reference = copy.deepcopy(model)

    def logits_path(m: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(x).flatten(0, 1).float()
        return F.cross_entropy(logits, y.flatten()) + c * torch.logsumexp(logits, -1).square().mean()

    for i in range(3):
        x, y = batch(i)
        model(x, y).backward()
        logits_path(reference, x, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"step {i} {name}")
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            m.zero_grad(set_to_none=True)


OPTIMIZERS = {
    # SGD for comparing two computations of the loss: its update is linear in the gradient. Adam divides by √v, so
    # gradients that are zero in exact arithmetic (attention key biases) become ±lr steps of rounding noise that
    # differs between any two summation orders.
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
}


def train(model: GPT, steps: int, fused_loss: bool, optimizer: str = "sgd", loss_parts: bool = False
          ) -> tuple[list, list, dict]:
    """Losses and gradients of a few steps with clipping, and the final parameters (``loss_parts``: the objective
    taken from the loss and its parts, as ``GPTModule.training_step`` takes it)."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses, grads = [], []
    for i in range(steps):
        x, y = batch(i)
        if loss_parts:
            loss = model(x, y, loss_parts=True).loss
        else:
            loss = model(x, y) if fused_loss else F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_training(a: tuple, b: tuple, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=1e-5, atol=atol)
    for step, (ga, gb) in enumerate(zip(a[1], b[1], strict=True)):
        for name in gb:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=atol, msg=f"step {step} grad {name}")
    for name in b[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("placement", ["pre", "peri", "post"])
def test_training_with_the_chunked_loss_equals_the_logits_path(placement: str) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(norm_placement=placement, pad_vocab_multiple=64))
    model.loss_chunk_rows = 10  # 48 rows: five chunks, the last one short
    reference = copy.deepcopy(model)
    x, _ = batch()
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)  # logits: the same path as before
    assert_same_training(train(model, 4, fused_loss=True), train(reference, 4, fused_loss=False))


def test_vocabulary_padding_changes_no_output() -> None:
    torch.manual_seed(0)
    plain = GPT(tiny())
    padded = GPT(tiny(pad_vocab_multiple=64))  # 97 -> 128 rows
    state = plain.state_dict()
    for key in ("transformer.wte.weight", "lm_head.weight"):
        state[key] = torch.cat([state[key], torch.randn(128 - VOCAB, state[key].size(1))])  # junk padded rows
    padded.load_state_dict(state)
    x, _ = batch()
    torch.testing.assert_close(padded(x), plain(x), rtol=1e-6, atol=1e-6)
    a, b = train(padded, 3, fused_loss=True), train(plain, 3, fused_loss=True)
    for grads in a[1]:  # the padded rows get no gradient: their tokens are never predicted nor embedded
        assert grads["transformer.wte.weight"][VOCAB:].abs().max() == 0
        grads["transformer.wte.weight"] = grads["transformer.wte.weight"][:VOCAB]  # tied: lm_head.weight too
    for key in ("transformer.wte.weight", "lm_head.weight"):
        a[2][key] = a[2][key][:VOCAB]
    assert_same_training(a, b)


def test_fused_adamw_equals_foreach() -> None:
    # Each step both optimizers get the same parameters and gradients (training two copies apart would let Adam blow
    # up rounding noise in gradients that are zero in exact arithmetic), so this compares the update itself.
    torch.manual_seed(0)
    fused_model = GPT(tiny())
    foreach_model = copy.deepcopy(fused_model)
    fused = OPTIMIZERS["fused"](fused_model.parameters())
    foreach = OPTIMIZERS["foreach"](foreach_model.parameters())
    for i in range(3):
        x, y = batch(i)
        fused_model(x, y).backward()
        for p, q in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
            q.grad = p.grad.clone()
        fused.step()
        foreach.step()
        for (name, p), q in zip(fused_model.named_parameters(), foreach_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {i} {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(fused.state[p][key], foreach.state[q][key], rtol=1e-6, atol=1e-9)
            with torch.no_grad():
                q.copy_(p)
        fused.zero_grad(set_to_none=True)
        foreach.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("loss_parts", "z_loss"), [(False, 0.0), (True, 0.0), (True, 1e-4)])
def test_compiled_model_trains_like_eager_with_the_same_hook_names(loss_parts, z_loss) -> None:
    # loss_parts is GPTModule.training_step's call: compiled without z-loss, its objective had no gradient (Inductor
    # folded it into the cross-entropy the loss marked non-differentiable), and every compiled fit failed at step 1
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:  # pragma: no cover - a build without the compiler
        pytest.skip(f"torch.compile is unavailable here: {exc}")
    torch.manual_seed(0)
    eager = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=16, n_layer=1, z_loss=z_loss))
    eager.loss_chunk_rows = 20  # 48 rows: the compiled loss loops over three chunks
    compiled = copy.deepcopy(eager)
    names = [n for n, _ in eager.named_modules()]
    seen: list[str] = []
    for name, module in compiled.named_modules():
        if name.endswith(("resid_attn", "resid_mlp", "transformer.drop")):
            module.register_forward_hook(lambda m, a, o, name=name: seen.append(name))
    compiled.compile()  # in place, as GPTModule(compile=True) does
    assert [n for n, _ in compiled.named_modules()] == names
    assert_same_training(train(compiled, 3, fused_loss=True, loss_parts=loss_parts),
                         train(eager, 3, fused_loss=True, loss_parts=loss_parts), atol=1e-5)
    assert seen[:3] == ["transformer.drop", "transformer.h.0.resid_attn", "transformer.h.0.resid_mlp"]
    assert len(seen) == 3 * 3  # the hooks fire on every compiled step
