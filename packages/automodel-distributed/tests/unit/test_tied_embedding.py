"""The tied input embedding's in-place rows: autograd's gradients bit for bit, one full-size tensor fewer."""

from __future__ import annotations

import copy
import platform

import pytest
import torch
import torch.nn as nn

from automodel_distributed.tied_embedding import accumulate_tied_embedding_rows, tied_input_embedding
from automodel_testing import build_tiny_model


class _Tied(nn.Module):
    def __init__(self, vocab: int = 50, hidden: int = 8, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden, padding_idx=padding_idx)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor, use_head: bool = True) -> torch.Tensor:
        hidden = torch.tanh(self.emb(ids))
        if not use_head:  # only the embedding's rows reach the weight
            return hidden.float().pow(2).mean()
        return self.head(hidden).float().logsumexp(-1).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("use_head", [True, False])
def test_gradients_equal_autograds_bit_for_bit(
    dtype: torch.dtype, padding_idx: int | None, use_head: bool
) -> None:
    torch.manual_seed(0)
    plain = _Tied(padding_idx=padding_idx).to(dtype)
    ours = _Tied(padding_idx=padding_idx).to(dtype)
    ours.load_state_dict(plain.state_dict())
    assert accumulate_tied_embedding_rows(ours)
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[0, :5] = 3  # repeated ids (and the padding id) sum several rows
    if use_head:  # a deep copy keeps the in-place rows, bound to its own embedding
        ours = copy.deepcopy(ours)
    for step in range(2):  # the second backward accumulates onto the first: the plain path
        plain(ids, use_head).backward()
        ours(ids, use_head).backward()
        assert torch.equal(plain.emb.weight.grad, ours.emb.weight.grad), f"backward {step}"


def test_only_a_plain_embedding_shared_with_the_head_is_changed() -> None:
    tied = build_tiny_model("llama_tied")
    assert tied_input_embedding(tied) is tied.get_input_embeddings()
    assert tied_input_embedding(build_tiny_model("llama")) is None  # untied

    class Scaled(nn.Embedding):  # a subclass with its own forward (Gemma's scaled embedding) is left alone
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 2.0

    model = _Tied()
    model.emb = Scaled(50, 8)
    model.head.weight = model.emb.weight
    assert tied_input_embedding(model) is None and not accumulate_tied_embedding_rows(model)
    assert not accumulate_tied_embedding_rows(nn.Linear(2, 2))
    stage = build_tiny_model("llama_tied")  # a later pipeline stage: its embedding was removed
    stage.model.embed_tokens = None
    assert tied_input_embedding(stage) is None
    head_only = build_tiny_model("llama_tied")  # an earlier one: no head
    head_only.lm_head = None
    assert tied_input_embedding(head_only) is None

    class NoBase(nn.Module):  # transformers' default accessors raise NotImplementedError
        def get_input_embeddings(self) -> nn.Module:
            raise NotImplementedError

        def get_output_embeddings(self) -> None:
            return None

    assert tied_input_embedding(NoBase()) is None


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) >> 10


@pytest.mark.skipif(platform.system() != "Linux", reason="peak memory from /proc/self")
def test_backward_holds_one_full_size_gradient_fewer() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 65536, (1, 64))
    peaks = {}
    for name in ("autograd", "ours"):
        # fp32: a bf16 head's weight gradient goes through an fp32 temporary on CPUs without native bf16
        # matmuls (seen on AMD EPYC), as large as two such gradients, which hides the difference.
        model = _Tied(vocab=65536, hidden=1024)  # a 256 MiB weight
        if name == "ours":
            accumulate_tied_embedding_rows(model)
        loss = model(ids)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        before = _status_mib("VmRSS")
        loss.backward()
        peaks[name] = _status_mib("VmHWM") - before
        del model, loss
    # autograd: the head's gradient, the embedding's full-size one and their sum (3 x 256 MiB)
    assert peaks["autograd"] - peaks["ours"] >= 256, peaks
