"""Shamir secret recombination for SecAgg+'s unmasking, with the Lagrange weights computed once.

SecAgg+ (Bell et al., CCS 2020; Bonawitz et al., CCS 2017, Sec. 4) shares every client's mask seed and
secret key among its neighbours with Shamir's scheme (Shamir, CACM 1979); after the collect stage the
server recombines one secret per survivor (its self-mask seed) and one per dropped client (its key).
Flower (flwr 1.41 ``flwr.common.secure_aggregation.crypto.shamir``) splits each padded secret into
16-byte chunks and shares every chunk over GF(2^128) with pycryptodome's ``Shamir`` (no "ssss"
diffusion): a share is ``<4-byte little-endian index><16-byte share of chunk 1><chunk 2>...``.

pycryptodome's ``Shamir.combine`` recomputes the Lagrange basis at 0 for every chunk: ``k`` field
inversions and ``k^2`` multiplications per 16 bytes, in pure Python (milliseconds per 32-byte secret
with 5 shares, a fifth of a second with 51: docs/benchmarks/shamir_combine.md). The weights depend
only on the share indices, which are the same for every chunk of a secret and, in SecAgg+, repeat
across the secrets of a round:
:func:`combine_shares` computes them once per set of indices (:func:`lagrange_weights`, cached) and
recombines each chunk with ``k`` multiplications. Same field (x^128 + x^7 + x^2 + x + 1, the LSB the
constant coefficient, values big-endian as pycryptodome encodes them), same bytes out; the tests check
it against pycryptodome's and Flower's ``combine_shares`` (``tests/test_shamir.py``).

The weights are public (they follow from the indices alone); nothing here touches a secret but the
chunks being recombined.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from Crypto.Util.Padding import unpad

#: The field's modulus x^128 + x^7 + x^2 + x + 1 (pycryptodome's ``_Element.irr_poly``).
IRREDUCIBLE = (1 << 128) | 0b1000_0111
#: Bytes of one chunk (a field element).
CHUNK = 16
#: Bytes of a share's index prefix.
INDEX_BYTES = 4


def _multiply(a: int, b: int, *, reduce: bool) -> int:
    """The product of two binary polynomials, reduced modulo :data:`IRREDUCIBLE` as it goes if ``reduce``."""
    if a < b:
        a, b = b, a
    product = 0
    while b:
        if b & 1:
            product ^= a
        b >>= 1
        a <<= 1
        if reduce and a >> 128:
            a ^= IRREDUCIBLE
    return product


def gf_multiply(a: int, b: int) -> int:
    """The product of two elements of GF(2^128) (carry-less multiplication, reduced as it goes)."""
    return _multiply(a, b, reduce=True)


def gf_inverse(a: int) -> int:
    """The inverse of a non-zero element of GF(2^128) (extended Euclid over binary polynomials)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^128)")
    remainder, next_remainder = IRREDUCIBLE, a
    coefficient, next_coefficient = 0, 1
    while next_remainder:
        quotient, rest = 0, remainder
        degree = next_remainder.bit_length()
        while rest.bit_length() >= degree:
            shift = rest.bit_length() - degree
            quotient ^= 1 << shift
            rest ^= next_remainder << shift
        remainder, next_remainder = next_remainder, rest
        coefficient, next_coefficient = (
            next_coefficient,
            coefficient ^ _multiply(quotient, next_coefficient, reduce=False),
        )
    return coefficient


@functools.lru_cache(maxsize=1024)
def lagrange_weights(indices: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange basis at 0 for shares at ``indices``: ``w_j = prod_m x_m / prod_m (x_j + x_m)``, m != j.

    (In characteristic 2, ``x_j - x_m = x_j + x_m`` and ``0 - x_m = x_m``.) Raises ``ValueError`` on
    a repeated index, as pycryptodome does.
    """
    if len(set(indices)) != len(indices):
        raise ValueError("Duplicate share")
    weights = []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = gf_multiply(numerator, x_m)
                denominator = gf_multiply(denominator, x_j ^ x_m)
        weights.append(gf_multiply(numerator, gf_inverse(denominator)))
    return tuple(weights)


def combine_shares(share_list: Sequence[bytes]) -> bytes:
    """The secret Flower's ``create_shares`` shared, from its shares (Flower's ``combine_shares``).

    Raises ``ValueError`` when the recombined bytes are not a padded secret (wrong or too few shares).
    """
    chunks = (len(share_list[0]) - INDEX_BYTES) // CHUNK
    indices = tuple(int.from_bytes(share[:INDEX_BYTES], "little") for share in share_list)
    weights = lagrange_weights(indices)
    padded = bytearray()
    for chunk in range(chunks):
        start = INDEX_BYTES + chunk * CHUNK
        value = 0
        for weight, share in zip(weights, share_list, strict=True):
            value ^= gf_multiply(weight, int.from_bytes(share[start : start + CHUNK], "big"))
        padded += value.to_bytes(CHUNK, "big")
    try:
        return unpad(bytes(padded), CHUNK)
    except ValueError:
        raise ValueError("Failed to combine shares") from None
