"""Secure aggregation's masks from the whole agreed key: ChaCha20 keyed by HKDF-SHA256 of the secret.

SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020, Sec. 3; Bonawitz et al., CCS 2017,
Sec. 4) hides a client's vector behind masks expanded from secrets by a pseudorandom generator: a
self mask from the client's own 32-byte seed and one pairwise mask per neighbour from the key the
two agreed on (ECDH + HKDF, 32 bytes). The protocol is only as strong as that generator. Flower's
``pseudo_rand_gen`` (flwr 1.41) folds the secret into **32 bits** and seeds numpy's
``RandomState`` with them: a server that knows everything about a survivor's upload but one
pairwise mask finds that mask among 2^32 candidates in under a second on a GPU (the third privacy
audit did, on a real round), and it draws ``randint(0, 2^b - 1)``, which never yields ``2^b - 1``.

:func:`mask_arrays` is the generator dpfl uses instead, on the devices and on the server alike
(:mod:`fl_app.engine.secagg`):

* key: ``HKDF-SHA256(secret, salt=None, info=MASK_INFO, length=32)`` of the **whole** secret (the
  client's 32-byte seed, or the 44-byte URL-safe base64 of the 32-byte agreed key as Flower's
  ``generate_shared_key`` returns it), so that two secrets that differ anywhere give unrelated keys;
* stream: ChaCha20 (RFC 8439, OpenSSL through ``cryptography``) with that key and an all-zero
  16-byte nonce/counter block. Every secret is fresh per round (new key pairs and seeds in each
  setup stage) and expanded once, so a fixed nonce never repeats a (key, nonce) pair with
  different plaintexts;
* values: the stream read as little-endian unsigned words (4 bytes when ``modulus <= 2^32``, else
  8), each reduced mod ``modulus``, a power of two: exactly uniform on ``[0, modulus)``.

Security: 256-bit keys end to end (ChaCha20's key; the HKDF input carries the full 256 bits of the
agreed key or seed). :data:`MASK_GENERATOR` names this construction on the wire: the server asks
for it in the setup stage and refuses a device that does not confirm it (a device running Flower's
own mod would produce masks the server cannot remove: garbage sums, or worse, weak masks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: The construction's name, sent by the server in the setup stage and echoed by the devices.
MASK_GENERATOR = "dpfl-chacha20-hkdf-sha256-v1"
#: HKDF's ``info``: binds the derived key to this use (domain separation).
MASK_INFO = b"dpfl secagg+ mask stream v1"
#: The secret must carry at least this many bytes (256 bits).
MIN_SECRET_BYTES = 32


def mask_key(secret: bytes) -> bytes:
    """The 32-byte ChaCha20 key of ``secret``: HKDF-SHA256 over all of its bytes.

    Parameters
    ----------
    secret : bytes
        A client's self-mask seed (32 random bytes) or a pairwise agreed key (Flower's
        ``generate_shared_key``: 44 bytes of URL-safe base64 of 32 bytes).

    Returns
    -------
    bytes
        32 bytes.

    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a mask secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=MASK_INFO).derive(secret)


def mask_arrays(secret: bytes, modulus: int, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Masks of the given shapes, uniform on ``[0, modulus)``, from ChaCha20 keyed by ``secret``.

    Parameters
    ----------
    secret : bytes
        The whole secret (see :func:`mask_key`).
    modulus : int
        A power of two, at most ``2^62`` (the masks are int64 and sums of two must not overflow).
    shapes : Sequence[tuple[int, ...]]
        One shape per array (``()`` for a scalar), in the order the arrays are masked.

    Returns
    -------
    list[numpy.ndarray]
        int64 arrays of ``shapes``; the same secret always gives the same masks.

    """
    if modulus < 2 or modulus & (modulus - 1) or modulus > 1 << 62:
        raise ValueError(f"the modulus must be a power of two in [2, 2^62], got {modulus}")
    word = np.dtype("<u4") if modulus <= 1 << 32 else np.dtype("<u8")
    sizes = [math.prod(shape) for shape in shapes]
    cipher = Cipher(algorithms.ChaCha20(mask_key(secret), bytes(16)), mode=None).encryptor()
    stream = cipher.update(bytes(word.itemsize * sum(sizes)))
    values = (np.frombuffer(stream, dtype=word) & np.array(modulus - 1, dtype=word)).astype(np.int64)
    masks, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        masks.append(values[offset : offset + size].reshape(shape))
        offset += size
    return masks
