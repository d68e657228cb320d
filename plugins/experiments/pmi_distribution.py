"""The PMI-fidelity task: a latent-variable pair distribution whose PMI is known in closed form.

Seed 003's Assumption 2 (see :mod:`clipkit.plugins.experiments.pmi`): a latent z with prior π,
x | z and y | z independent isotropic Gaussians, so exp PMI(x, y) = Σ_z p(z|x) p(z|y) / π_z.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class LatentPairDistribution:
    """z ~ Categorical(π) over K values; x | z ~ N(μx_z, σx² I_dx), y | z ~ N(μy_z, σy² I_dy),
    x ⟂ y | z (seed 003 Assumption 2). Its PMI is closed form (:meth:`pmi`).

    num_latent: K.
    x_dim, y_dim: dx, dy.
    prior:      [K] positive probabilities (normalised here), or None for Zipf π_z ∝ 1/(z+1)
                (non-uniform, so the 1/π_z in exp PMI matters).
    separation: the component means are drawn μ ~ N(0, separation² I) (seeded by ``seed``).
    noise_x, noise_y: σx, σy; separation/noise sets how soft the posteriors p(z|x) are, hence the
                range of the PMI (well-separated components push PMI of mismatched pairs to −∞).
    seed:       seeds the means; the distribution is a pure function of its arguments.

    Parameters are stored in float64; samples are float32 (what encoders train on).
    """

    def __init__(
        self,
        num_latent: int = 8,
        x_dim: int = 8,
        y_dim: int = 8,
        *,
        prior: Sequence[float] | None = None,
        separation: float = 1.0,
        noise_x: float = 1.0,
        noise_y: float = 1.0,
        seed: int = 0,
    ) -> None:
        if num_latent < 1 or x_dim < 1 or y_dim < 1:
            raise ValueError("num_latent, x_dim and y_dim must be >= 1")
        if not (separation > 0 and noise_x > 0 and noise_y > 0):
            raise ValueError("separation, noise_x and noise_y must be > 0")
        if prior is None:
            prior_tensor = 1.0 / torch.arange(1, num_latent + 1, dtype=torch.float64)
        else:
            prior_tensor = torch.as_tensor(list(prior), dtype=torch.float64)
            if prior_tensor.shape != (num_latent,) or not bool((prior_tensor > 0).all()):
                raise ValueError(f"prior must be {num_latent} positive numbers, got {list(prior)}")
        self.prior = prior_tensor / prior_tensor.sum()  # π [K]
        generator = torch.Generator().manual_seed(seed)
        self.means_x = separation * torch.randn(num_latent, x_dim, generator=generator, dtype=torch.float64)
        self.means_y = separation * torch.randn(num_latent, y_dim, generator=generator, dtype=torch.float64)
        self.noise_x, self.noise_y = float(noise_x), float(noise_y)
        self.config = {
            "num_latent": num_latent,
            "x_dim": x_dim,
            "y_dim": y_dim,
            "prior": [float(p) for p in self.prior],
            "separation": float(separation),
            "noise_x": self.noise_x,
            "noise_y": self.noise_y,
            "seed": seed,
        }

    @property
    def num_latent(self) -> int:
        return self.prior.shape[0]

    def sample_latent(self, n: int, generator: torch.Generator) -> Tensor:
        """[n] long latent values z ~ π."""
        return torch.multinomial(self.prior, n, replacement=True, generator=generator)

    def sample_x(self, z: Tensor, generator: torch.Generator) -> Tensor:
        """[n] latents -> [n, dx] float32 x ~ p(x|z)."""
        noise = torch.randn(z.shape[0], self.means_x.shape[1], generator=generator, dtype=torch.float64)
        return (self.means_x[z] + self.noise_x * noise).float()

    def sample_y(self, z: Tensor, generator: torch.Generator) -> Tensor:
        """[n] latents -> [n, dy] float32 y ~ p(y|z)."""
        noise = torch.randn(z.shape[0], self.means_y.shape[1], generator=generator, dtype=torch.float64)
        return (self.means_y[z] + self.noise_y * noise).float()

    def sample_pairs(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """n pairs from the joint p(x, y) -> (x [n, dx], y [n, dy], z [n])."""
        z = self.sample_latent(n, generator)
        return self.sample_x(z, generator), self.sample_y(z, generator), z

    def sample_independent(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """n pairs from the product of marginals p(x)p(y) -> (x [n, dx], y [n, dy])."""
        x = self.sample_x(self.sample_latent(n, generator), generator)
        y = self.sample_y(self.sample_latent(n, generator), generator)
        return x, y

    def log_posterior_x(self, x: Tensor) -> Tensor:
        """[N, dx] -> [N, K] float64 log p(z|x). The Gaussian normalisers are the same for every z
        (shared isotropic σx), so they cancel in the softmax."""
        return _log_posterior(x, self.means_x, self.noise_x, self.prior)

    def log_posterior_y(self, y: Tensor) -> Tensor:
        """[N, dy] -> [N, K] float64 log p(z|y)."""
        return _log_posterior(y, self.means_y, self.noise_y, self.prior)

    def pmi(self, x: Tensor, y: Tensor, *, block_size: int = 1024) -> Tensor:
        """x [Na, dx], y [Nb, dy] -> [Na, Nb] float64 PMI(x_a, y_b) = log p(x, y)/(p(x) p(y))
        = lse_z( log p(z|x) + log p(z|y) − log π_z ), row blocks of ``block_size`` (memory
        O(block·Nb·K))."""
        log_x, log_y = self.log_posterior_x(x), self.log_posterior_y(y)
        log_y = log_y - self.prior.log()  # fold 1/π_z into one side
        rows = [
            torch.logsumexp(log_x[start : start + block_size, None, :] + log_y[None, :, :], dim=-1)
            for start in range(0, log_x.shape[0], block_size)
        ]
        return torch.cat(rows) if rows else log_x.new_zeros(0, log_y.shape[0])

    def pmi_paired(self, x: Tensor, y: Tensor) -> Tensor:
        """x [N, dx], y [N, dy] -> [N] float64 PMI(x_i, y_i) (the diagonal of :meth:`pmi`)."""
        log_x, log_y = self.log_posterior_x(x), self.log_posterior_y(y)
        return torch.logsumexp(log_x + log_y - self.prior.log(), dim=-1)

    def mutual_information(self, n: int, generator: torch.Generator) -> float:
        """Monte Carlo I(X; Y) = E_{p(x,y)} PMI(x, y) over n joint pairs (nats; ≤ H(Z))."""
        x, y, _ = self.sample_pairs(n, generator)
        return float(self.pmi_paired(x, y).mean())


def _log_posterior(v: Tensor, means: Tensor, noise: float, prior: Tensor) -> Tensor:
    """[N, D] points, [K, D] means -> [N, K] log p(z|v) for v | z ~ N(means_z, noise² I)."""
    # Exact differences, not cdist's |v|² + |μ|² − 2v·μ shortcut (cancellation far from the means).
    squared = (v.to(torch.float64)[:, None, :] - means[None, :, :]).square().sum(dim=-1)  # [N, K]
    return torch.log_softmax(prior.log() - squared / (2 * noise**2), dim=-1)
