"""Orthogonal latent transforms R (d_c x d_c) for the TPLA reparameterization (DESIGN §1).

The cached latent in the new basis is `R^T n`. Every transform here is orthogonal, so the
rotation is exact for MLA; they differ only in how the latent's energy ends up distributed
over the contiguous shards that TPLA slices:

- `identity`: the checkpoint's own basis.
- `hadamard`: `diag(s) H / sqrt(d_c)` with Sylvester `H` and seeded random signs `s`; it mixes
  every coordinate into every other, so each shard's energy share tends to `1/r`.
- `pca`: eigenvectors of `E[n n^T]` by descending eigenvalue, so the leading shard carries
  most of the energy (the paper's best choice for sliced softmax at r = 2).
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.loading.side_file import Method


class TransformError(ValueError):
    """A transform cannot be built for this latent width or calibration data."""


def sylvester_hadamard(d: int) -> Tensor:
    """The unnormalized Sylvester Hadamard matrix of order d (a power of two), float64."""
    if d < 1 or d & (d - 1):
        raise TransformError(
            f"the Hadamard transform needs a power-of-two latent width, got d_c = {d}; "
            "use --method pca or identity for this model"
        )
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def random_hadamard(d: int, seed: int) -> Tensor:
    """Orthonormal `diag(s) H / sqrt(d)` with signs s drawn from `seed` (float64).

    The signs multiply rows, so the rotated latent is `H (s * n) / sqrt(d)`: the random sign
    flips happen before the mixing and decorrelate structured inputs from H's rows.
    """
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).to(torch.float64) * 2 - 1
    return signs[:, None] * sylvester_hadamard(d) / d**0.5


def pca_basis(second_moment: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvectors (columns) and eigenvalues of `E[n n^T]`, eigenvalues descending (float64).

    Each eigenvector's sign is fixed so its largest-magnitude entry is positive, making the
    basis a deterministic function of the statistics.
    """
    c = second_moment.to(torch.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise TransformError(f"second moment must be square, got shape {tuple(c.shape)}")
    if not torch.isfinite(c).all():
        raise TransformError("second moment has non-finite entries")
    values, vectors = torch.linalg.eigh((c + c.T) / 2)  # ascending
    values, vectors = values.flip(0), vectors.flip(1)
    pivot = vectors.abs().argmax(0)
    signs = torch.sign(vectors[pivot, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return vectors * signs, values


def rotation(
    method: Method, d_c: int, *, seed: int = 0, second_moment: Tensor | None = None
) -> Tensor:
    """The orthogonal R (d_c x d_c, float64) for `method`."""
    if method is Method.IDENTITY:
        return torch.eye(d_c, dtype=torch.float64)
    if method is Method.HADAMARD:
        return random_hadamard(d_c, seed)
    if second_moment is None:
        raise TransformError("pca needs calibration statistics (E[n n^T] per layer)")
    if second_moment.shape != (d_c, d_c):
        raise TransformError(
            f"second moment has shape {tuple(second_moment.shape)}, expected ({d_c}, {d_c})"
        )
    return pca_basis(second_moment)[0]


def rotated_spectrum(r: Tensor, second_moment: Tensor) -> Tensor:
    """E[n'_k^2] per rotated dimension: diag(R^T C R), float64."""
    r64, c64 = r.to(torch.float64), second_moment.to(torch.float64)
    return torch.einsum("ik,ij,jk->k", r64, c64, r64)
