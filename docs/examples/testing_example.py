"""automodel-testing: prove a data-parallel gradient on 2 real gloo ranks against one process.

python testing_example.py        # or: pytest testing_example.py
"""

import torch
import torch.distributed as dist

from automodel_testing import build_tiny_model, run_distributed


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(seed))


def _rank_grad() -> torch.Tensor:
    """One rank (a module-level function): its own sample, gradients averaged over the ranks."""
    model = build_tiny_model("llama", seed=0, vocab_size=256)
    ids = _batch(dist.get_rank())
    model(input_ids=ids, labels=ids).loss.backward()
    grad = model.lm_head.weight.grad
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    return grad


def test_data_parallel_gradient_matches_one_process() -> None:
    """The mean of the per-rank gradients equals the gradient of the whole batch in one process."""
    grads = run_distributed(_rank_grad, 2)  # spawned ranks; a failure or a hang raises, naming the rank
    model = build_tiny_model("llama", seed=0, vocab_size=256)  # the reference: both samples at once
    ids = torch.cat([_batch(0), _batch(1)])
    model(input_ids=ids, labels=ids).loss.backward()
    for grad in grads:
        torch.testing.assert_close(grad, model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    test_data_parallel_gradient_matches_one_process()
    print("2 ranks match one process")
