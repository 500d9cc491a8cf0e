"""What the parts of a decoder cost to run, read from their parameters, for a balanced pipeline split.

A stage's step time is dominated by its matrix multiplications: every element of a weight matrix is
multiplied with every token once in forward (2 FLOPs) and twice in backward. So the cost of a module is
taken to be the number of elements of its matrix parameters (two or more dimensions), leaving out
embedding tables, whose forward is a lookup. This counts the LM head (``vocab x hidden``) against the
decoder layers the way its FLOPs do. What it leaves out: attention's score FLOPs (they grow with the
sequence length and add to the layers' side), the loss, and the routing of mixture-of-experts layers
(all experts count, not the ones a token visits: such layers look heavier than they run, so the head
and embeddings move fewer layers than their FLOPs would).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from automodel_pipelining.layout import DecoderLayout
from automodel_pipelining.split import split_layers_by_cost

__all__ = ["StageCosts", "matmul_elements", "read_stage_costs"]


def matmul_elements(module: nn.Module) -> int:
    """Elements of ``module``'s matrix parameters outside embedding tables (meta tensors work).

    A parameter shared by several submodules counts once.
    """
    tables = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(False)}
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2 and id(p) not in tables)


@dataclass(frozen=True)
class StageCosts:
    """Cost (`matmul_elements`) of each decoder layer and of the first and last stages' other modules."""

    layers: tuple[int, ...]
    """Per decoder layer, in forward order."""
    first: int
    """The modules the first stage runs before its layers (embeddings, an input projection)."""
    last: int
    """The modules the last stage runs after its layers (final norm, output projection, LM head)."""

    def layer_counts(self, num_stages: int) -> list[int]:
        """Layers per stage that make the most expensive stage cheapest (`split_layers_by_cost`)."""
        return split_layers_by_cost(self.layers, num_stages, first_cost=self.first, last_cost=self.last)


def read_stage_costs(model: nn.Module, layout: DecoderLayout) -> StageCosts:
    """The costs of ``model``'s parts, placed as ``layout`` says (``model`` is not mutated)."""

    def cost(fqns: tuple[str, ...]) -> int:
        return sum(matmul_elements(model.get_submodule(fqn)) for fqn in fqns)

    return StageCosts(
        layers=tuple(cost((fqn,)) for fqn in layout.layer_fqns),
        first=cost(layout.first_stage_fqns),
        last=cost(layout.last_stage_fqns),
    )
