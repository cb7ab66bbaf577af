"""lab/factored.py against TransformerLens' FactoredMatrix (the reference) on the same
factors: each attribute, product and spectrum. Singular vectors are compared up to sign."""

import pytest
import torch

from attnlab.lab.factored import FactoredMatrix

reference = pytest.importorskip("transformer_lens").FactoredMatrix
TOL = 1e-5


def _close(a, b, tol=TOL):
    assert a.shape == b.shape and (a - b).abs().max() <= tol, (a - b).abs().max()


@pytest.fixture
def pair():
    torch.manual_seed(0)
    A, B = torch.randn(3, 4, 6, 2), torch.randn(2, 5)  # B broadcast over (3, 4)
    return FactoredMatrix(A, B), reference(A, B)


def test_shapes_and_products(pair):
    ours, theirs = pair
    assert (ours.shape, ours.ldim, ours.mdim, ours.rdim, ours.ndim) == (
        theirs.shape,
        theirs.ldim,
        theirs.mdim,
        theirs.rdim,
        theirs.ndim,
    )
    assert repr(ours) == repr(theirs)
    _close(ours.AB, theirs.AB)
    _close(ours.T.AB, theirs.T.AB)
    for other in (torch.randn(5, 7), torch.randn(5, 1), torch.randn(5)):
        mine, expected = ours @ other, theirs @ other
        _close(getattr(mine, "AB", mine), getattr(expected, "AB", expected))
        assert getattr(mine, "mdim", None) == getattr(expected, "mdim", None)
    for other in (torch.randn(9, 6), torch.randn(6)):
        mine, expected = other @ ours, other @ theirs
        _close(getattr(mine, "AB", mine), getattr(expected, "AB", expected))
    square = reference(torch.randn(5, 3), torch.randn(3, 6))
    _close((ours @ FactoredMatrix(square.A, square.B)).AB, (theirs @ square).AB)
    _close((ours * 2.5).AB, (theirs * 2.5).AB)
    _close((2.5 * ours).AB, (2.5 * theirs).AB)


def test_spectra(pair):
    ours, theirs = pair
    _close(ours.S, theirs.S)
    _close(ours.norm(), theirs.norm())
    _close(ours.U.abs(), theirs.U.abs())
    _close(ours.Vh.abs(), theirs.Vh.abs())
    _close(ours.collapse_l(), theirs.collapse_l())
    _close(ours.collapse_r(), theirs.collapse_r())
    _close(ours.make_even().AB, theirs.make_even().AB)
    torch.manual_seed(1)
    A, B = torch.randn(2, 8, 3), torch.randn(2, 3, 8)
    _close(FactoredMatrix(A, B).eigenvalues, reference(A, B).eigenvalues)
    with pytest.raises(ValueError, match="square"):
        _ = ours.BA


def test_views(pair):
    ours, theirs = pair
    for index in (0, (0, 1), (0, 1, slice(2, 4)), (0, slice(None), slice(None), slice(1, 3))):
        _close(ours[index].AB, theirs[index].AB)
    _close(ours.get_corner(2), theirs.get_corner(2))
    assert ours.unsqueeze(0).shape == theirs.unsqueeze(0).shape
