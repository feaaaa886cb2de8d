"""The server's Shamir recombination against pycryptodome's field and Flower's ``combine_shares``."""

from __future__ import annotations

import random

import pytest
from Crypto.Protocol.SecretSharing import _Element  # the oracle: pycryptodome's own field element
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_app.engine import secagg
from fl_app.privacy import shamir

#: Flower's own Shamir functions (flwr 1.41), reached through the engine's seam.
create_shares = secagg.shamir.create_shares
flower_combine_shares = secagg.shamir.combine_shares
ELEMENTS = st.integers(min_value=0, max_value=(1 << 128) - 1)


@settings(max_examples=200, deadline=None)
@given(ELEMENTS, ELEMENTS)
def test_multiplication_is_pycryptodomes(a: int, b: int) -> None:
    assert shamir.gf_multiply(a, b) == int(_Element(a) * _Element(b))


@settings(max_examples=100, deadline=None)
@given(ELEMENTS.filter(bool))
def test_inverse_is_pycryptodomes_and_inverts(a: int) -> None:
    inverse = shamir.gf_inverse(a)
    assert inverse == int(_Element(a).inverse())
    assert shamir.gf_multiply(a, inverse) == 1


def test_zero_has_no_inverse() -> None:
    with pytest.raises(ZeroDivisionError):
        shamir.gf_inverse(0)


@settings(max_examples=40, deadline=None)
@given(
    secret=st.binary(min_size=1, max_size=100),
    threshold=st.integers(min_value=1, max_value=8),
    extra=st.integers(min_value=0, max_value=6),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_any_threshold_subset_of_flowers_shares_gives_the_secret(
    secret: bytes, threshold: int, extra: int, seed: int
) -> None:
    """Any ``threshold`` or more of the shares, in any order, give the secret, as Flower's own function."""
    shares = create_shares(secret, threshold, threshold + extra)
    subset = random.Random(seed).sample(shares, random.Random(seed + 1).randint(threshold, len(shares)))
    assert shamir.combine_shares(subset) == secret == flower_combine_shares(subset)


def test_too_few_shares_do_not_give_the_secret_and_the_output_matches_flowers() -> None:
    secret = bytes(range(32))
    shares = create_shares(secret, 4, 6)
    for subset in (shares[:3], [shares[5], shares[0], shares[2]]):
        try:
            ours: bytes | None = shamir.combine_shares(subset)
        except ValueError:
            ours = None
        try:
            theirs: bytes | None = flower_combine_shares(subset)
        except ValueError:
            theirs = None
        assert ours == theirs and ours != secret


def test_a_repeated_share_is_refused() -> None:
    shares = create_shares(b"s" * 32, 2, 3)
    with pytest.raises(ValueError, match="Duplicate share"):
        shamir.combine_shares([shares[0], shares[0]])


def test_weights_are_computed_once_per_index_set() -> None:
    shamir.lagrange_weights.cache_clear()
    for _ in range(3):
        shares = create_shares(bytes(32), 3, 5)
        shamir.combine_shares(shares[:3])
    info = shamir.lagrange_weights.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_the_secagg_seam_unmasks_with_it() -> None:
    assert secagg.combine_shares is shamir.combine_shares
