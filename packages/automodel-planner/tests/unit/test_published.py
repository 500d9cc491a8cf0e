"""The time model against published runs: every row plans, and its prediction stays within the bound."""

from __future__ import annotations

import pytest

from automodel_planner import PublishedRun, published_runs
from automodel_planner.published import predict

CALIBRATION_BOUND = 0.10
"""The goal of the planner issue: within 10% of published tokens/s. The calibration rows are fitted."""
EVALUATION_BOUND = 0.65
"""The evaluation rows (never fitted on): the largest error the committed model makes on them, rounded
up (docs/throughput.md lists each row's; long-context CP over 4 and 8 ranks is the worst). A change
to the model that makes any of them worse than that fails here."""


FAST_SHAPES = ("llama3-8b", "qwen2.5-7b")
"""The models whose rows the default run predicts (beside every calibration row); the rest, the
larger models (a fake forward of 80 to 126 layers each), run under ``models`` (``uvx nox -s models``)."""


def _rows() -> list[object]:
    return [
        run
        if run.role == "calibration" or run.shape in FAST_SHAPES
        else pytest.param(run, marks=pytest.mark.models)
        for run in published_runs()
    ]


@pytest.mark.parametrize("run", _rows(), ids=lambda run: getattr(run, "id", None))
def test_every_published_run_is_predicted_within_its_bound(run: PublishedRun) -> None:
    step = predict(run)
    error = step.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1
    bound = CALIBRATION_BOUND if run.role == "calibration" else EVALUATION_BOUND
    assert abs(error) <= bound, (
        f"{run.id}: predicted {step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {error:+.1%}"
    )
    assert 0 < step.mfu < 1 and step.step_seconds > 0


def test_the_rows_are_sourced_and_their_roles_known() -> None:
    runs = published_runs()
    assert len({r.id for r in runs}) == len(runs)
    assert {r.role for r in runs} == {"calibration", "evaluation"}
    assert all(r.source.startswith("https://") for r in runs)
