"""How many micro-batches each schedule keeps in flight per pipeline rank."""

from __future__ import annotations

from automodel_pipelining.schedules import SCHEDULES, in_flight_microbatches


def test_in_flight_microbatches_per_schedule() -> None:
    gpipe, one, interleaved = SCHEDULES["gpipe"], SCHEDULES["1f1b"], SCHEDULES["interleaved1f1b"]
    assert in_flight_microbatches(gpipe, pp_size=4, rank=0, n_microbatches=8, stages_per_rank=1) == 8
    held = [
        in_flight_microbatches(one, pp_size=4, rank=r, n_microbatches=8, stages_per_rank=1) for r in range(4)
    ]
    assert held == [4, 3, 2, 1]
    assert in_flight_microbatches(one, pp_size=4, rank=0, n_microbatches=2, stages_per_rank=1) == 2
    # torch's interleaved warm-up: (v - 1) * pp + 2 * (pp - 1 - rank) forwards, then one more.
    assert in_flight_microbatches(interleaved, pp_size=4, rank=0, n_microbatches=8, stages_per_rank=2) == 11
    assert in_flight_microbatches(interleaved, pp_size=4, rank=3, n_microbatches=8, stages_per_rank=2) == 5
    assert in_flight_microbatches(None, pp_size=2, rank=0, n_microbatches=4, stages_per_rank=2) == 8
