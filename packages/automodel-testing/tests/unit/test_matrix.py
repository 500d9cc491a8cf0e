"""The matrices' shared judgement and selection (`automodel_testing.matrix`), in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from automodel_testing.matrix import gradient_difference, judge, select_families, sgd_parity

FAMILIES = ["gemma3", "idefics3", "llava", "qwen2_5_vl"]


def test_select_families_by_name_or_slice() -> None:
    assert select_families(FAMILIES, None) == FAMILIES
    assert select_families(FAMILIES, "") == FAMILIES
    assert select_families(FAMILIES, "qwen2_5_vl, gemma3") == ["gemma3", "qwen2_5_vl"]  # the matrix's order
    assert select_families(FAMILIES, "1:3") == ["idefics3", "llava"]
    assert select_families(FAMILIES, "2:") == ["llava", "qwen2_5_vl"]
    with pytest.raises(ValueError, match=r"\['no_such'\] are not families"):
        select_families(FAMILIES, "llava,no_such")
    with pytest.raises(ValueError, match="START:STOP with integers"):
        select_families(FAMILIES, "a:b")


def _case(**changes: Any) -> dict[str, Any]:
    case: dict[str, Any] = {
        "losses": [2.0, 1.5, 1.2],
        "ref_losses": [2.0, 1.5, 1.2],
        "logits": 1e-7,
        "grad_norm": 1e-7,
        "grad_rel": 1e-7,
    }
    return {**case, **changes}


def test_judge_works_differs_and_does_not_train() -> None:
    assert judge(_case(), 1e-5)["status"] == "works"
    differs = judge(_case(losses=[2.0, 1.5, 1.21]), 1e-5)
    assert differs["status"] == "fails" and "differs from transformers" in differs["message"]
    assert differs["loss_diff"] == pytest.approx(0.01)
    flat = judge(_case(losses=[2.0] * 3, ref_losses=[2.0] * 3, grad_rel=0.5), 1e-5)
    assert flat["status"] == "fails" and "does not fall" in flat["message"]
    # The reference cannot move either (steps below float32's resolution), and the gradients agree.
    assert judge(_case(losses=[2.0] * 3, ref_losses=[2.0] * 3), 1e-5)["status"] == "works"
    # The reference falls by one float32 step (below the tolerance) while ours stays: still flat.
    ulp = judge(_case(losses=[4.8534093] * 3, ref_losses=[4.8534093, 4.8534093, 4.8534088]), 1e-5)
    assert ulp["status"] == "works", ulp
    fell = judge(_case(losses=[4.85] * 3, ref_losses=[4.85, 4.84, 4.83]), 1e-5)
    assert fell["status"] == "fails" and "does not fall" in fell["message"]
    mine = judge(_case(), 1e-5, ["frozen parameters changed"])
    assert mine["status"] == "fails" and mine["message"] == "frozen parameters changed"


def test_judge_compares_later_losses_with_the_reference_in_the_sharding_order() -> None:
    drifted = _case(losses=[2.0, 1.5, 1.20002])
    calls: list[int] = []

    def in_order(losses: list[float]) -> Any:
        return lambda: calls.append(1) or losses

    # The drift is the order's: transformers summing in that order lands where we do.
    works = judge(dict(drifted), 1e-5, reordered=in_order([2.0, 1.5, 1.200019]))
    assert works["status"] == "works" and "sharding's order" in works["message"], works
    assert works["loss_diff"] == pytest.approx(2e-5) and works["reordered_loss_diff"] < 1e-5
    # A defect differs from both references: still a failure, naming both differences.
    defect = judge(dict(drifted), 1e-5, reordered=in_order([2.0, 1.5, 1.2]))
    assert defect["status"] == "fails" and "sharding's order" in defect["message"]
    # Nothing reordered (None) or a first loss already off: the plain comparison stands.
    assert judge(dict(drifted), 1e-5, reordered=lambda: None)["status"] == "fails"
    calls.clear()
    first_off = judge(_case(losses=[2.0001, 1.5, 1.2]), 1e-5, reordered=in_order([2.0001, 1.5, 1.2]))
    assert first_off["status"] == "fails" and not calls
    # Only asked for when needed.
    assert judge(_case(), 1e-5, reordered=in_order([0.0] * 3))["status"] == "works" and not calls


def test_sgd_parity_runs_both_sides_and_the_gradient_difference() -> None:
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    seen: list[dict[str, float]] = []

    def step(model: torch.nn.Module) -> float:
        loss = model(x).square().mean()
        loss.backward()
        return float(loss)

    square = lambda: sum(float(p.grad.square().sum()) for p in ours.parameters())  # noqa: E731
    out = sgd_parity(
        2,
        lambda: step(ref),
        lambda: step(ours),
        optimizers,
        first=lambda: seen.append(gradient_difference(square(), ref)),
    )
    assert out["losses"] == out["ref_losses"] and len(out["losses"]) == 3
    assert out["losses"][-1] < out["losses"][0]
    (difference,) = seen  # the same gradients, summed in float32 here and float64 there
    assert difference == pytest.approx({"grad_norm": 0.0, "grad_rel": 0.0}, abs=1e-6)
