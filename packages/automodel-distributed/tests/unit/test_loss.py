"""`MaskedCrossEntropy` against ``torch.nn.functional.cross_entropy``.

Reference semantics (NeMo AutoModel's ``components/loss``): masked labels become ``ignore_index``, fp32
upcast, optional division by a token count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from automodel_distributed.loss import MaskedCrossEntropy

VOCAB = 11


def _data(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, VOCAB, generator=generator).to(dtype).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (3, 5), generator=generator)
    return logits, labels


def _ce(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction=reduction)


def test_default_is_the_summed_cross_entropy() -> None:
    logits, labels = _data()
    loss = MaskedCrossEntropy()(logits, labels)
    torch.testing.assert_close(loss, _ce(logits, labels, "sum"), rtol=0, atol=0)


def test_mean_matches_cross_entropy() -> None:
    logits, labels = _data()
    loss = MaskedCrossEntropy(reduction="mean")(logits, labels)
    torch.testing.assert_close(loss, _ce(logits, labels, "mean"), rtol=1e-6, atol=0)


def test_none_gives_one_value_per_position() -> None:
    logits, labels = _data()
    labels[0, 0] = -100
    losses = MaskedCrossEntropy(reduction="none")(logits, labels)
    assert losses.shape == labels.shape and losses[0, 0] == 0
    torch.testing.assert_close(losses[1], _ce(logits[1], labels[1], "none"), rtol=0, atol=0)


def test_mask_zero_positions_are_ignored() -> None:
    logits, labels = _data()
    mask = torch.ones_like(labels)
    mask[:, :2] = 0
    loss = MaskedCrossEntropy()(logits, labels, mask=mask)
    expected = _ce(logits[:, 2:], labels[:, 2:], "sum")
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert not torch.equal(loss, _ce(logits, labels, "sum"))
    loss.backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad[:, :2]) == 0
    assert torch.count_nonzero(logits.grad[:, 2:]) > 0


def test_mask_does_not_modify_the_labels() -> None:
    logits, labels = _data()
    before = labels.clone()
    MaskedCrossEntropy()(logits, labels, mask=torch.zeros_like(labels))
    assert torch.equal(labels, before)


def test_ignore_index() -> None:
    logits, labels = _data()
    labels[labels == 7] = 0
    labels[1, :] = 7  # only row 1 is ignored
    loss = MaskedCrossEntropy(ignore_index=7)(logits, labels)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=7, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(loss, _ce(logits[[0, 2]], labels[[0, 2]], "sum"), rtol=1e-6, atol=0)


def test_num_label_tokens_divides_the_sum() -> None:
    logits, labels = _data()
    loss = MaskedCrossEntropy()(logits, labels, num_label_tokens=30)
    torch.testing.assert_close(loss, _ce(logits, labels, "sum") / 30, rtol=1e-6, atol=0)
    as_tensor = MaskedCrossEntropy()(logits, labels, num_label_tokens=torch.tensor(30))
    torch.testing.assert_close(as_tensor, loss, rtol=0, atol=0)


def test_zero_label_tokens_gives_zero_and_keeps_the_graph() -> None:
    logits, labels = _data()
    loss = MaskedCrossEntropy()(logits, labels, num_label_tokens=0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()  # every rank can still run backward (collectives inside stay matched)
    assert logits.grad is not None and torch.count_nonzero(logits.grad) == 0


def test_everything_masked_is_zero_not_nan() -> None:
    logits, labels = _data()
    for reduction in ("sum", "mean"):
        loss = MaskedCrossEntropy(reduction=reduction)(logits, labels, mask=torch.zeros_like(labels))
        assert loss.item() == 0.0 and loss.requires_grad


def test_fp32_upcast() -> None:
    logits, labels = _data(dtype=torch.bfloat16)
    upcast = MaskedCrossEntropy()(logits, labels)
    assert upcast.dtype == torch.float32
    torch.testing.assert_close(upcast, _ce(logits, labels, "sum"), rtol=0, atol=0)
    raw = MaskedCrossEntropy(fp32_upcast=False)(logits, labels)
    assert raw.dtype == torch.bfloat16


def test_bad_arguments() -> None:
    logits, labels = _data()
    with pytest.raises(ValueError, match="reduction"):
        MaskedCrossEntropy(reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_label_tokens needs reduction='sum'"):
        MaskedCrossEntropy(reduction="mean")(logits, labels, num_label_tokens=3)
    with pytest.raises(ValueError, match="num_label_tokens needs reduction='sum'"):
        MaskedCrossEntropy(reduction="none")(logits, labels, num_label_tokens=3)
    with pytest.raises(ValueError, match="do not match labels"):
        MaskedCrossEntropy()(logits, labels[:, :4])
    with pytest.raises(ValueError, match="mask"):
        MaskedCrossEntropy()(logits, labels, mask=torch.ones(3, 4))


def test_compiled_loss_matches_eager_and_saves_the_logits_not_an_fp32_copy() -> None:
    """``compiled=True``: the same loss and gradients from bf16 logits; for backward it keeps the logits
    in bf16 (and per-token statistics) where the eager loss keeps an fp32 copy of them."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 48, 512, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 512, (2, 48), generator=generator)
    mask = (torch.rand(2, 48, generator=generator) > 0.2).long()
    results = {}
    for compiled in (False, True):
        x = logits.clone().requires_grad_(True)
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ce = MaskedCrossEntropy(compiled=compiled)
            loss = ce(x, labels, mask=mask, num_label_tokens=int(mask.sum()))
        loss.backward()
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        results[compiled] = (loss.detach(), x.grad, max(saved))
    (eager, eager_grad, eager_largest), (fused, fused_grad, fused_largest) = results[False], results[True]
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-4)
    assert eager_largest == logits.numel() * 4  # the fp32 log-probabilities
    assert fused_largest == logits.numel() * 2  # the bf16 logits themselves


def test_compiled_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="compiled must be a bool"):
        MaskedCrossEntropy(compiled="yes")  # type: ignore[arg-type]
