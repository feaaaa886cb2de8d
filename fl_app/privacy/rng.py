"""Random generators for noise and sampling: reproducible or from OS entropy.

Simulations derive every generator from a seed, separately per purpose,
client and round, so a run is reproducible and no two uses share a stream:
``SeedSequence(seed, spawn_key=(purpose, client, round))``. The privacy noise of
a seeded simulation uses its own seed, by default :func:`derive_noise_seed` of
the run seed and the experiment (its validated settings, not its label, tracker,
output folder or the spelling of a number), so that two runs of a sweep never
share a noise stream (their noises would otherwise be equal up to scale and
cancel between two released models) and two runs of one experiment draw the same.
Such noise is still reproducible from the published configuration: a seeded
simulation says so in its results.

``secure=True`` (``privacy.secure_rng``, forced on real devices) keys each
generator with 128 fresh bits from the operating system's CSPRNG
(:mod:`secrets`) and refuses a fixed seed: noise is then unpredictable to
anyone, the server included, and not reproducible. It uses numpy's Philox
counter-based generator; like every floating-point implementation of Laplace or
Gaussian sampling it is not hardened against floating-point side channels
(Mironov 2012).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import numpy as np


def purpose_id(purpose: str) -> int:
    """A stable 32-bit id for a purpose name (independent of Python's hash seed)."""
    return int.from_bytes(hashlib.blake2b(purpose.encode(), digest_size=4).digest(), "big")


def derive_noise_seed(*, seed: int, fingerprint: str) -> int:
    """The default privacy-noise seed of a seeded simulation: a hash of the run seed and the experiment.

    Parameters
    ----------
    seed : int
        The run seed (``seed``), >= 0.
    fingerprint : str
        A digest of the experiment's validated settings
        (:meth:`fl_app.config.settings.RunSettings.fingerprint`).

    Returns
    -------
    int
        A 63-bit seed that changes whenever the seed or the experiment changes.

    Notes
    -----
    This makes runs of one sweep (same ``seed``, e.g. different ``privacy.epsilon``)
    draw independent noise. It does *not* make the noise secret: anyone holding
    the published configuration can recompute it. Secret noise needs OS entropy
    (``privacy.secure_rng=true``; always on real devices).

    """
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    digest = hashlib.blake2b(f"dpfl-privacy-noise|{int(seed)}|{fingerprint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def make_generator(
    *,
    seed: int | None,
    secure: bool,
    purpose: str,
    client: int | None = None,
    server_round: int | None = None,
) -> np.random.Generator:
    """Return a generator for one purpose, client and round.

    Parameters
    ----------
    seed : int or None
        Run seed; must be ``None`` when ``secure``.
    secure : bool
        Draw the key from OS entropy instead of the seed.
    purpose : str
        What the randomness is for (e.g. ``"uplink-noise"``, ``"client-sampling"``).
    client : int, optional
        Client id (``None`` for server-side randomness).
    server_round : int, optional
        Round number.

    Raises
    ------
    ValueError
        When ``secure`` is combined with a seed, or neither is given.

    """
    if secure:
        if seed is not None:
            raise ValueError("secure randomness refuses a fixed seed (set privacy.noise_seed=null)")
        return np.random.Generator(np.random.Philox(key=secrets.randbits(128)))
    if seed is None:
        raise ValueError("a seed is required unless secure randomness is requested")
    if int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    spawn_key = (
        purpose_id(purpose),
        0 if client is None else int(client) + 1,
        0 if server_round is None else int(server_round) + 1,
    )
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=spawn_key)))


@dataclass(frozen=True)
class RandomSource:
    """The run's randomness policy: a seed, or OS entropy.

    Attributes
    ----------
    seed : int or None
        Seed of every derived generator (``None`` with ``secure``).
    secure : bool
        Use OS entropy (see module docstring).

    """

    seed: int | None
    secure: bool = False

    def __post_init__(self) -> None:
        if self.secure and self.seed is not None:
            raise ValueError("secure randomness refuses a fixed seed (set privacy.noise_seed=null)")
        if not self.secure and self.seed is None:
            raise ValueError("a seed is required unless secure randomness is requested")

    def generator(
        self, purpose: str, *, client: int | None = None, server_round: int | None = None
    ) -> np.random.Generator:
        """Derive the generator for ``purpose`` (and a client and round)."""
        return make_generator(
            seed=self.seed,
            secure=self.secure,
            purpose=purpose,
            client=client,
            server_round=server_round,
        )
