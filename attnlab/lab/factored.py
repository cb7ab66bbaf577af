"""A matrix kept as the product of two thin ones, M = A @ B, as circuits analysis reads heads.

An attention head's two circuits are low-rank products (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits"):

    QK = W_Q @ W_K^T   (C, D) @ (D, C)     where a head reads from
    OV = W_V @ W_O     (C, D) @ (D, C)     what it writes there

so the (C, C) matrix, or the (V, V) one through the embeddings, W_E @ OV @ W_U, never needs to
be formed: its non-zero eigenvalues are those of the small (D, D) product B @ A, its singular
values follow from the SVDs of A and B, and a product with a third matrix stays factored,
along whichever inner size is smaller. `FactoredMatrix` is TransformerLens' class of that
name, written from the algebra: the same attributes, shapes and results (tests/lab/
test_factored.py checks each against it). Leading dimensions (layers, heads) broadcast.

Shapes: A (..., ldim, mdim), B (..., mdim, rdim); M = A @ B is (..., ldim, rdim).
"""

import torch
from torch import Tensor


class FactoredMatrix:
    """M = A @ B, never formed unless asked for (`AB`)."""

    def __init__(self, A: Tensor, B: Tensor):
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} do not multiply")
        lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.A = A.broadcast_to(*lead, *A.shape[-2:])
        self.B = B.broadcast_to(*lead, *B.shape[-2:])
        self.ldim, self.mdim = A.shape[-2:]
        self.rdim = B.shape[-1]
        self.shape = torch.Size([*lead, self.ldim, self.rdim])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def AB(self) -> Tensor:
        """The whole matrix (..., ldim, rdim)."""
        return self.A @ self.B

    @property
    def BA(self) -> Tensor:
        """The small product (..., mdim, mdim); a square M only."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix, this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    # --- products: stay factored along the smaller inner size -----------------------------------
    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.dim() == 1:  # a vector: a vector back
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Tensor):
        if other.dim() == 1:
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: float | Tensor) -> "FactoredMatrix":
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # --- spectra ---------------------------------------------------------------------------------
    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """M = U diag(S) V^T, thin (mdim singular values), from the SVDs of A and B:
        A = Ua Sa Va^T, B = Ub Sb Vb^T, so M = Ua (Sa Va^T Ub Sb) Vb^T and the small middle
        matrix's SVD finishes it. U (..., ldim, mdim), S (..., mdim), V (..., rdim, mdim)."""
        Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)
        Ub, Sb, Vhb = torch.linalg.svd(self.B, full_matrices=False)
        middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
        Um, S, Vhm = torch.linalg.svd(middle)
        return Ua @ Um, S, (Vhm @ Vhb).transpose(-2, -1)

    @property
    def U(self) -> Tensor:
        return self.svd()[0]

    @property
    def S(self) -> Tensor:
        return self.svd()[1]

    @property
    def V(self) -> Tensor:
        return self.svd()[2]

    Vh = V  # TransformerLens' name for the same (..., rdim, mdim) matrix

    @property
    def eigenvalues(self) -> Tensor:
        """M's mdim eigenvalues that can be non-zero: those of B @ A (complex)."""
        return torch.linalg.eigvals(self.BA)

    def norm(self) -> Tensor:
        """The Frobenius norm of each matrix: sqrt(sum S^2)."""
        return self.S.pow(2).sum(-1).sqrt()

    # --- views -----------------------------------------------------------------------------------
    def __getitem__(self, index) -> "FactoredMatrix":
        """Leading dimensions first; an index into the last two picks rows of A, columns of B."""
        index = index if isinstance(index, tuple) else (index,)
        lead = len(self.shape) - 2
        A, B = self.A[index[:lead]], self.B[index[:lead]]
        if len(index) > lead:
            A = A[..., index[lead], :]
        if len(index) > lead + 1:
            B = B[..., index[lead + 1]]
        return FactoredMatrix(A, B)

    def get_corner(self, k: int = 3) -> Tensor:
        """The first k entries of every dimension of M."""
        M = self.A[..., :k, :] @ self.B[..., :, :k]
        return M[tuple(slice(0, k) for _ in M.shape)]

    def collapse_l(self) -> Tensor:
        """B scaled by the singular values (..., mdim, rdim): M with its left side folded in."""
        U, S, V = self.svd()
        return S[..., :, None] * V.transpose(-2, -1)

    def collapse_r(self) -> Tensor:
        """U scaled by the singular values (..., ldim, mdim)."""
        U, S, V = self.svd()
        return U * S[..., None, :]

    def make_even(self) -> "FactoredMatrix":
        """The same M split evenly: A = U sqrt(S), B = sqrt(S) V^T."""
        U, S, V = self.svd()
        root = S.sqrt()
        return FactoredMatrix(U * root[..., None, :], root[..., :, None] * V.transpose(-2, -1))

    def unsqueeze(self, dim: int = 0) -> "FactoredMatrix":
        """A new leading dimension (dim counts among the leading ones)."""
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"
