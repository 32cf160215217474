"""Optimisation on the Stiefel manifold St(d, r) = {U in R^{d x r} : U^T U = I_r}.

Riemannian steepest descent with momentum (embedded metric):

    xi  = G - U sym(U^T G)            tangent projection of the Euclidean gradient G
    m   = beta * m + xi, then m -= U sym(U^T m)   (momentum transported by projection)
    U  <- qf(U - lr * m)              QR retraction back onto the manifold

``qf`` is the Q factor with the signs fixed so diag(R) > 0 (Cholesky QR), computed in
float64: orthogonality holds to ~1e-7 in fp32 after any number of steps. Every
step is deterministic, so replicas that see the same gradient stay
bit-identical.

Riemannian Adam (Becigneul & Ganea, ICLR 2019, one manifold factor per point): the same tangent first moment,
and one scalar second moment per point, the mean square of the Riemannian gradient (a scalar does not depend on
the basis chosen for U's span, where a per-entry one would), so the step's RMS per entry is about lr whatever the
gradient's scale:

    m = beta1 * m + (1 - beta1) * xi,   v = beta2 * v + (1 - beta2) * mean(xi^2)
    U <- qf(U - lr * m_hat / (sqrt(v_hat) + eps)),   then m -= U sym(U^T m)   (transport to the new point)
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = [
    "tangent_project",
    "retract_qr",
    "householder_q",
    "random_stiefel",
    "orthogonality_error",
    "StiefelMomentumSGD",
    "StiefelAdam",
]


def sym(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a + a.transpose(-1, -2))


def tangent_project(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Projection of ``g`` onto the tangent space of St(d, r) at ``u``."""
    return g - u @ sym(u.transpose(-1, -2) @ g)


def householder_q(y: torch.Tensor) -> torch.Tensor:
    """The Q of y = QR with diag(R) > 0, by Householder QR (y float64)."""
    q, r = torch.linalg.qr(y)
    signs = torch.sign(torch.diagonal(r))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs


# Cholesky QR's Q is orthonormal to ~1e-16 cond(y)^2 in float64: below this ratio of R's smallest to largest
# diagonal entry (cond(y) >~ 1e3) Householder QR takes over.
CHOLESKY_MIN_DIAGONAL_RATIO = 1e-3


def retract_qr(y: torch.Tensor) -> torch.Tensor:
    """Closest-in-orientation point of St(d, r): the Q of y = QR with diag(R) > 0 (float64 inside).

    R is the Cholesky factor of y^T y and Q = y R^-1 (Cholesky QR): two products and a triangular solve, where
    Householder QR works through r panels one after another (d = 2048, r = 768 on an H100: 1.3 ms against 4.9 ms,
    the same fp32 Q; benchmarks/results/mapl_step_time.md). A step's y = U - lr m has y^T y = I + lr^2 m^T m
    (m is tangent), so cond(y) ~ 1 and Q is orthonormal to ~1e-15; Householder QR where y^T y is not positive
    definite or y is ill-conditioned (``CHOLESKY_MIN_DIAGONAL_RATIO``)."""
    y64 = y.double()
    r, info = torch.linalg.cholesky_ex(y64.transpose(-1, -2) @ y64, upper=True)
    diagonal = torch.diagonal(r, dim1=-2, dim2=-1)
    if bool((info == 0) & (diagonal.min() > CHOLESKY_MIN_DIAGONAL_RATIO * diagonal.max())):  # one host sync
        return torch.linalg.solve_triangular(r, y64, upper=True, left=False).to(y.dtype)
    return householder_q(y64).to(y.dtype)


def random_stiefel(d: int, r: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random point of St(d, r) (Householder QR of a Gaussian), fp32."""
    if not 0 < r <= d:
        raise ValueError(f"a projection needs 0 < rank <= hidden size, got rank {r} for hidden size {d}")
    return householder_q(torch.randn(d, r, generator=generator, dtype=torch.float64)).float()


def orthogonality_error(u: torch.Tensor) -> float:
    """max |U^T U - I| (float64)."""
    u64 = u.double()
    return float(
        (u64.transpose(-1, -2) @ u64 - torch.eye(u.shape[-1], dtype=torch.float64, device=u.device)).abs().max()
    )


class StiefelMomentumSGD:
    """Manifold-constrained momentum SGD for a list of Stiefel points (updated in place, no weight decay).

    ``buffers``: the momentum tensors (zeros at the start, updated in place), e.g. buffers of the module that
    owns the points, so that checkpoints of that module keep them; created here when not given.
    """

    def __init__(
        self, points: List[torch.Tensor], lr: float, momentum: float = 0.9, buffers: Optional[List[torch.Tensor]] = None
    ) -> None:
        if lr <= 0:
            raise ValueError(f"manifold learning rate must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"manifold momentum must be in [0, 1), got {momentum}")
        self.points = points
        self.lr = lr
        self.momentum = momentum
        self.buffers = buffers if buffers is not None else [torch.zeros_like(p, requires_grad=False) for p in points]

    @torch.no_grad()
    def step(self, grads: List[torch.Tensor], lr_scale: float = 1.0) -> None:
        """One update of every point; the step length is ``lr * lr_scale`` (a learning-rate schedule's factor)."""
        lr = self.lr * lr_scale
        for u, g, buffer in zip(self.points, grads, self.buffers):
            xi = tangent_project(u, g.to(u.dtype))
            m = tangent_project(u, self.momentum * buffer + xi)
            buffer.copy_(m)
            if lr:  # at lr 0 (a warm-up's first step) U stays exactly put, as Adam leaves weights, not re-retracted
                u.copy_(retract_qr(u - lr * m))

    def state_dict(self) -> dict:
        """The hyper-parameters (the momentum is in ``buffers``, saved by their owner)."""
        return {"lr": self.lr, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.momentum = state["lr"], state["momentum"]


class StiefelAdam:
    """Riemannian Adam for a list of Stiefel points (updated in place, no weight decay): the module docstring's
    update. Its moments live here (a study's optimizer: not in checkpoints)."""

    def __init__(self, points: List[torch.Tensor], lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        if lr <= 0:
            raise ValueError(f"manifold learning rate must be > 0, got {lr}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Adam betas must be in [0, 1), got {betas}")
        self.points, self.lr, self.betas, self.eps = points, lr, betas, eps
        self.first = [torch.zeros_like(p, requires_grad=False) for p in points]
        self.second = [torch.zeros((), dtype=p.dtype, device=p.device) for p in points]
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: List[torch.Tensor], lr_scale: float = 1.0) -> None:
        """One update of every point; the step length is ``lr * lr_scale`` (a learning-rate schedule's factor)."""
        self.steps += 1
        beta1, beta2 = self.betas
        lr = self.lr * lr_scale
        for u, g, m, v in zip(self.points, grads, self.first, self.second):
            xi = tangent_project(u, g.to(u.dtype))
            m.mul_(beta1).add_(xi, alpha=1 - beta1)
            v.mul_(beta2).add_((xi * xi).mean(), alpha=1 - beta2)
            if lr:
                m_hat = m / (1 - beta1**self.steps)
                v_hat = v / (1 - beta2**self.steps)
                u.copy_(retract_qr(u - lr * m_hat / (v_hat.sqrt() + self.eps)))
            m.copy_(tangent_project(u, m))
