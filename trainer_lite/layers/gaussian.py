"""Gaussian-basis GLM of PFL-DA Table 4, in the paper's form and in the authors' code's form."""

from __future__ import annotations

import numpy as np

from trainer_lite.layers.base import Cache, Layer, check_features
from trainer_lite.layers.basic import Linear
from trainer_lite.layers.containers import Sequential
from trainer_lite.params import Params

_FORMS = ("paper", "code")


class GaussianBasis(Layer):
    """``K`` Gaussian bumps per input feature with learnable centres and widths.

    Each input feature ``x_j`` is expanded into ``φ_jk(x) = exp(-½·(x_j − μ_jk)²·a_jk)``
    and the output is ``(batch, d_in·K)``, feature-major (``φ_j1 … φ_jK`` for each ``j``).

    Parameters
    ----------
    n_basis
        ``K``, the number of bumps per feature (the authors' ``h_dim``; 16 in their
        printer study).
    d_in
        Number of input features (PFL-DA's printer models use 1).
    form
        ``"paper"``: PFL-DA Table 4, ``exp(-(x − μ)² / (2σ²))`` with learnable
        ``widths`` σ (``a = 1/σ²``).
        ``"code"``: the authors' ``Decoder_kernel``, ``exp(-(μ − x)²·0.5·s²)`` with
        learnable ``stds`` s that *multiply* (``a = s²``), so a larger s is a
        narrower bump despite the name.
    center_range
        Centres start U(low, high); the authors draw ``torch.rand``, i.e. U(0, 1).
    width
        Initial σ (paper) or s (code); the authors start s at 1.

    Notes
    -----
    Parameters are ``centers`` and ``widths`` (paper) or ``stds`` (code), each of
    shape ``(d_in, K)``.  The two forms coincide at initialisation when ``width=1``
    and differ in how a gradient step moves the width.
    """

    def __init__(
        self,
        n_basis: int = 16,
        d_in: int = 1,
        *,
        form: str = "paper",
        center_range: tuple[float, float] = (0.0, 1.0),
        width: float = 1.0,
    ) -> None:
        if n_basis < 1 or d_in < 1:
            raise ValueError(f"GaussianBasis needs n_basis >= 1 and d_in >= 1, got {n_basis}, {d_in}")
        if form not in _FORMS:
            raise ValueError(f"unknown form {form!r}; choose one of {list(_FORMS)}")
        if not width > 0:
            raise ValueError(f"width must be > 0, got {width}")
        if not center_range[0] <= center_range[1]:
            raise ValueError(f"center_range must be (low, high) with low <= high, got {center_range}")
        self.n_basis, self.d_in, self.form = n_basis, d_in, form
        self.center_range, self.width = center_range, width
        self._width_name = "widths" if form == "paper" else "stds"

    @property
    def d_out(self) -> int:
        return self.d_in * self.n_basis

    def param_names(self) -> list[str]:
        return ["centers", self._width_name]

    def init(self, rng: np.random.Generator) -> Params:
        shape = (self.d_in, self.n_basis)
        low, high = self.center_range
        return {"centers": rng.uniform(low, high, size=shape), self._width_name: np.full(shape, self.width)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        check_features(x, self.d_in, "GaussianBasis")
        w = p[self._width_name]
        # a is the inverse variance: 1/σ² (paper) or s² (code).
        a = 1.0 / (w * w) if self.form == "paper" else w * w
        d = x[:, :, None] - p["centers"]
        phi = d * d
        phi *= -0.5 * a
        np.exp(phi, out=phi)
        return phi.reshape(len(x), -1), (d, phi, a, w)

    def _grads(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        d, phi, a, w = cache
        # g = dL/dφ · φ; then dφ/dμ = φ·d·a and dφ/da = -½·φ·d².
        g = dy.reshape(phi.shape) * phi
        gd = g * d
        gda = gd * a
        d_centers = gda.sum(axis=0)
        d_a = -0.5 * (gd * d).sum(axis=0)
        # Chain through a(w): paper a = w⁻² (da/dw = −2a/w), code a = w² (da/dw = 2w).
        d_w = d_a * (-2.0 * a / w) if self.form == "paper" else d_a * (2.0 * w)
        return {"centers": d_centers, self._width_name: d_w}, gda

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return self._grads(p, cache, dy)[0]

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        grads, gda = self._grads(p, cache, dy)
        # dφ/dx = −dφ/dμ.
        return grads, -gda.sum(axis=2)

    def input_width(self) -> int | None:
        return self.d_in


class GaussianGLM(Sequential):
    """Gaussian-basis decoder: a :class:`GaussianBasis` named ``rbf`` followed by linear maps.

    Parameters
    ----------
    n_basis, d_in, form, center_range, width
        Passed to :class:`GaussianBasis`.
    d_out
        Output width.
    hidden
        ``None`` or ``0``: one linear map ``fc`` from the bumps to the output, PFL-DA
        Table 4's ``Σ_k w_k φ_k``.  A positive width: two linear maps ``fc1``
        (``d_in·K → hidden``) and ``fc2`` (``hidden → d_out``) with nothing in
        between, as in the authors' ``Decoder_kernel`` (``fcn2(fc2n(Φ))`` with
        hidden = 1024; their unused ``fc2`` is left out).
    bias
        Bias on the linear maps; ``None`` means the paper's formula for ``hidden``
        unset (no bias) and the authors' ``nn.Linear`` defaults otherwise (bias).
    """

    def __init__(
        self,
        n_basis: int = 16,
        d_in: int = 1,
        d_out: int = 1,
        *,
        form: str = "paper",
        hidden: int | None = None,
        bias: bool | None = None,
        center_range: tuple[float, float] = (0.0, 1.0),
        width: float = 1.0,
    ) -> None:
        rbf = GaussianBasis(n_basis, d_in, form=form, center_range=center_range, width=width)
        if hidden is not None and hidden < 0:
            raise ValueError(f"hidden must be None, 0 or a positive width, got {hidden}")
        if not hidden:
            use_bias = False if bias is None else bias
            super().__init__([("rbf", rbf), ("fc", Linear(rbf.d_out, d_out, bias=use_bias))])
        else:
            use_bias = True if bias is None else bias
            super().__init__(
                [
                    ("rbf", rbf),
                    ("fc1", Linear(rbf.d_out, hidden, bias=use_bias)),
                    ("fc2", Linear(hidden, d_out, bias=use_bias)),
                ]
            )
