"""How many micro-batches each schedule keeps in flight per pipeline rank."""

from __future__ import annotations

import pytest

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


def _torch_order(schedule: str, pp: int, n: int, v: int, rank: int) -> list[tuple[str, tuple[int, int]]]:
    """The op order torch computes for ``rank`` of an interleaved 1F1B schedule (no process group:
    its ``_calculate_single_rank_operations`` needs only these counts)."""
    from torch.distributed.pipelining import schedules

    assert schedule == "interleaved1f1b"
    plan = object.__new__(schedules.ScheduleInterleaved1F1B)
    plan.pp_group_size, plan.n_local_stages, plan._n_microbatches = pp, v, n
    plan.number_of_rounds = max(1, n // pp)
    plan.microbatches_per_round = n // plan.number_of_rounds
    actions = [a for a in plan._calculate_single_rank_operations(rank) if a is not None]
    kinds = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], (a.stage_index // pp, a.microbatch_index)) for a in actions]


def test_the_peak_with_gradients_follows_torchs_own_interleaved_order() -> None:
    """`peak_with_gradients` against the peak over the op order torch itself computes, on every rank."""
    from automodel_pipelining.schedules import peak_over_order, peak_with_gradients

    interleaved = SCHEDULES["interleaved1f1b"]
    act, grads = [1.0, 1.5], [12.0, 10.0]
    for pp, n in ((4, 8), (8, 8), (4, 4), (2, 8)):
        for rank in range(pp):
            order = _torch_order("interleaved1f1b", pp, n, 2, rank)
            assert [k for k, _ in order].count("F") == 2 * n
            ours = peak_with_gradients(
                interleaved, pp_size=pp, rank=rank, n_microbatches=n, activations=act, gradients=grads
            )
            assert ours == peak_over_order(order, n, act, grads), (pp, n, rank)
            assert ours < n * sum(act) + sum(grads)  # less than both peaks together
    one = SCHEDULES["1f1b"]  # one stage per rank: the warm-up's activations beside all the gradients
    peak = peak_with_gradients(one, pp_size=4, rank=1, n_microbatches=8, activations=[2.0], gradients=[9.0])
    assert peak == 3 * 2.0 + 9.0


def _looped_order(stages: int, n: int, per_round: int, held: int) -> list[tuple[str, tuple[int, int]]]:
    """The op order `peak_with_gradients` describes, written out op by op."""
    rounds = [range(s, min(s + per_round, n)) for s in range(0, n, per_round)]
    forwards = [(c, m) for r in rounds for c in range(stages) for m in r]
    backwards = [(c, m) for r in rounds for c in reversed(range(stages)) for m in r]
    order = [("F", op) for op in forwards[:held]]
    for index, backward in enumerate(backwards):
        order.append(("B", backward))
        if held + index < len(forwards):
            order.append(("F", forwards[held + index]))
    return order


def test_the_looped_peak_is_the_peak_over_the_written_out_order() -> None:
    """The closed form against a walk of the order, with partial rounds, both looped schedules, any sizes."""
    import random

    from automodel_pipelining.schedules import in_flight_microbatches, peak_over_order, peak_with_gradients

    rng = random.Random(0)
    for name in ("interleaved1f1b", "loopedbfs"):
        spec = SCHEDULES[name]
        for pp, n, stages in ((4, 8, 2), (4, 10, 3), (2, 7, 4), (8, 8, 2), (3, 1, 2), (2, 33, 5)):
            act = [rng.uniform(0.5, 3.0) for _ in range(stages)]
            grads = [rng.uniform(1.0, 20.0) for _ in range(stages)]
            for rank in range(pp):
                held = in_flight_microbatches(
                    spec, pp_size=pp, rank=rank, n_microbatches=n, stages_per_rank=stages
                )
                per_round = n if name == "loopedbfs" else min(pp, n)
                expected = peak_over_order(_looped_order(stages, n, per_round, held), n, act, grads)
                ours = peak_with_gradients(
                    spec, pp_size=pp, rank=rank, n_microbatches=n, activations=act, gradients=grads
                )
                assert ours == pytest.approx(expected, rel=1e-12), (name, pp, n, stages, rank)


def test_each_stage_of_a_rank_sends_its_activations_and_gradients() -> None:
    from types import SimpleNamespace

    from automodel_pipelining.config import PipelineConfig
    from automodel_pipelining.memory import PipelineMemory

    config = PipelineConfig(pp_schedule="interleaved_1f1b", pp_batch_size=8, pp_microbatch_size=1)
    one = 100 * 16 * 2  # a micro-batch's 100 tokens of hidden 16 in bf16

    def sent(stages: int, first: bool = False, last: bool = False) -> tuple[float, float]:
        facts = SimpleNamespace(
            index=0, first_stage=first, last_stage=last, tokens=100, sequence_shards=1, hidden_size=16,
            element_size=2,
        )  # fmt: skip
        term = PipelineMemory(config, pp_size=4, stages=stages)
        (collective,) = term.collectives(facts)
        assert (
            term.buffers(facts)["PP receive buffers"] == collective.bytes_per_call * 8
        )  # one per micro-batch
        return collective.bytes_per_call, collective.calls

    assert sent(4) == (2 * one, 8)  # a middle rank: its output forward, its input's gradient back
    assert sent(4, first=True) == (one, 8)  # the first stage has no input to send a gradient for
    assert sent(8) == (4 * one, 8)  # two stages per rank send twice as much
    assert sent(8, first=True, last=True)[0] == 2 * one  # the rank holding the first and last stages
