"""distill's token loss: the generalized Jensen-Shannon divergence of TRL 1.16's DistillationTrainer, checked
against its definitions (and TRL's own chunked function where TRL is installed), and the chunked path against
the whole one, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.methods.distill import chunked_divergence, divergence


def logits(seed: int, rows: int = 6, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def by_definition(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """In probabilities, float64: KL(q || s) at beta 0, KL(s || q) at 1, else beta KL(q || m) + (1 - beta)
    KL(s || m) with m = (1 - beta) s + beta q."""
    s = torch.softmax(student / temperature, -1)
    q = torch.softmax(teacher / temperature, -1)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * (a.log() - b.log())).sum(-1)

    if beta == 0:
        return kl(q, s)
    if beta == 1:
        return kl(s, q)
    m = (1 - beta) * s + beta * q
    return beta * kl(q, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_divergence_is_the_generalized_jsd(beta: float, temperature: float) -> None:
    student, teacher = logits(0), logits(1)
    value, entropy, teacher_entropy = divergence(student, teacher, beta, temperature)
    assert torch.allclose(value.double(), by_definition(student, teacher, beta, temperature), atol=1e-6)
    s = torch.softmax(student / temperature, -1)
    assert torch.allclose(entropy.double(), -(s * s.log()).sum(-1), atol=1e-5)
    assert (teacher_entropy > 0).all()
    if beta in (0.0, 1.0):  # torch's own KL: the same numbers
        target, inputs = (teacher, student) if beta == 0 else (student, teacher)
        torch_kl = F.kl_div(
            F.log_softmax(inputs / temperature, -1),
            F.log_softmax(target / temperature, -1),
            log_target=True,
            reduction="none",
        ).sum(-1)
        assert torch.allclose(value.double(), torch_kl, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_equals_trls_chunked_function(beta: float) -> None:
    """TRL's ChunkedDivergenceFunction on the same hidden states and heads (skipped where TRL is absent: it
    is not a dependency)."""
    pytest.importorskip("trl")
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    generator = torch.Generator().manual_seed(3)
    hidden_s, hidden_t = torch.randn(7, 16, generator=generator), torch.randn(7, 24, generator=generator)
    weight_s, weight_t = torch.randn(40, 16, generator=generator), torch.randn(40, 24, generator=generator)
    theirs, their_entropy = ChunkedDivergenceFunction.apply(
        hidden_s, weight_s, None, hidden_t, weight_t, None, beta, 0.8, 1.0, None, 1.0, None
    )
    ours, entropy, _ = divergence(hidden_s @ weight_s.T, hidden_t @ weight_t.T, beta, 0.8)
    assert torch.allclose(ours, theirs, atol=1e-6) and torch.allclose(entropy, their_entropy, atol=1e-5)


def test_chunks_give_the_whole_values_and_gradients() -> None:
    generator = torch.Generator().manual_seed(5)
    head, teacher_head = torch.nn.Linear(16, 40), torch.nn.Linear(24, 40)
    hidden = torch.randn(11, 16, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(11, 24, generator=generator)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    whole, _, _ = divergence(head(hidden), teacher_logits, 0.5, 1.0)
    whole.sum().backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    teacher_weights = (teacher_head.weight.detach(), teacher_head.bias.detach())
    value, entropy, teacher_entropy = chunked_divergence(
        hidden, head, teacher_hidden, teacher_weights, 0.5, 1.0, 4
    )
    value.sum().backward()
    assert torch.allclose(value, whole.detach(), atol=1e-6) and entropy.shape == teacher_entropy.shape == (
        11,
    )
    assert torch.allclose(hidden.grad, expected[0], atol=1e-6) and torch.allclose(
        head.weight.grad, expected[1], atol=1e-6
    )
    assert not math.isnan(float(value.sum()))
