"""The ``point_set_mlp`` encoder: a tiny MLP from a vector to a weighted point set, the tower of
every PMI-fidelity entry (``model.pair: vectors``)."""

from __future__ import annotations

from torch import Tensor, nn

from clipkit.contract.types import PointSet


class PointSetMLP(nn.Module):
    """A vector [B, in_dim] -> PointSet of M unit points in R^d (and M positive weights).

    Two hidden GELU layers of width ``hidden``; the output layer emits M·d point coordinates
    (each row L2-normalised) plus, if ``weighted``, M weights w = softplus(·) + 1e-6 (the floor
    keeps log w finite for KME's log-weights, METHODS §3).
    """

    def __init__(self, in_dim: int, embed_dim: int, points: int, *, weighted: bool, hidden: int = 64):
        super().__init__()
        if points < 1 or embed_dim < 1:
            raise ValueError("points and embed_dim must be >= 1")
        self.embed_dim, self.points, self.weighted = embed_dim, points, weighted
        outputs = points * embed_dim + (points if weighted else 0)
        self.body = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, outputs),
        )

    def forward(self, x: Tensor) -> PointSet:
        """[B, in_dim] -> PointSet(points [B, M, d], weights [B, M] or None)."""
        out = self.body(x)
        count = self.points * self.embed_dim
        points = nn.functional.normalize(out[:, :count].view(-1, self.points, self.embed_dim), dim=-1)
        weights = nn.functional.softplus(out[:, count:]) + 1e-6 if self.weighted else None
        return PointSet(points, weights)


def point_set_mlp(*, embed_dim: int, in_dim: int, points: int = 8, weighted: bool = False, hidden: int = 64):
    """The ``point_set_mlp`` encoder: :class:`PointSetMLP` for ``model.pair: vectors`` recipes."""
    return PointSetMLP(in_dim, embed_dim, points, weighted=weighted, hidden=hidden)
