"""Gaussian noise drawn again on demand: ``z_t`` a pure function of the run's noise source and the round.

A mechanism whose noise spans rounds (a matrix factorization's ``C^{-1} z``: round t's noise is a
combination of every ``z_s``, ``s <= t``) either keeps earlier noise vectors or draws ``z_s`` again.
A :class:`NoiseStream` makes drawing again possible, so the server keeps what determines the stream
instead of vectors, and a resumed run continues with the same stream. :func:`noise_stream` picks
one of two, after the run's privacy randomness (:mod:`fl_app.privacy.rng`):

* **Secure** (``privacy.secure_rng``, always on real devices): :class:`KeyedNoiseStream`, a 256-bit
  key (:class:`NoiseKey`) from the operating system's CSPRNG (:mod:`secrets`). Round t's
  128-bit Philox4x64-10 key (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2,
  3", SC 2011; the counter-based generator :mod:`fl_app.privacy.rng` uses for secure noise) is the
  keyed BLAKE2b (a PRF; RFC 7693, Sec. 2.9) of the purpose and the round under the key. The round's
  vector comes in chunks of :data:`CHUNK` coordinates, chunk ``i`` from the counter ``i * 2^192``
  (the counter's highest word; a chunk uses far fewer than ``2^64`` blocks, so chunks never share
  one), standard normals by numpy's ziggurat. Any chunk of any round is drawn on its own:
  :meth:`KeyedNoiseStream.weighted_sum` forms ``sum_s w_s z_s`` one chunk at a time in threads
  (numpy releases the GIL while it draws and adds). The key is the run's secret: with the released
  models it gives back the un-noised sums, so it lives only in the server's private state (the
  checkpoint, mode 0600), and its ``repr`` hides it.
* **Seeded** (a simulation's default): :class:`SeededNoiseStream`, round t's generator of the run's
  noise seed for the purpose (``RandomSource.generator(purpose, server_round=t)``), the same draws a
  per-round generator gives: the published configuration reproduces them, as it does every draw of
  a seeded run, and a seeded run keeps the noise it had when its noise vectors were stored. A round's
  vector is one generator's sequence, so :meth:`SeededNoiseStream.weighted_sum` splits the rounds, not
  the coordinates, among threads (a fixed split: the same sum with any number of threads).

Like every floating-point Gaussian sampler neither is hardened against floating-point side channels
(Mironov 2012).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fl_app.privacy.rng import RandomSource

#: Coordinates per independently drawn chunk of a round's vector (512 KiB of float64).
CHUNK = 1 << 16
#: The key's length: 256 bits.
KEY_BYTES = 32
#: Consecutive parts a seeded stream's weighted sum is split into (drawn by parallel threads).
PARTS = 4


@dataclass(frozen=True)
class NoiseKey:
    """A 256-bit secret; its ``repr`` hides it (it must never reach a log or a result)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"a noise key has {KEY_BYTES} bytes, got {len(self.secret)}")

    @classmethod
    def from_os(cls) -> NoiseKey:
        """A fresh key from the operating system's CSPRNG."""
        return cls(secrets.token_bytes(KEY_BYTES))


class NoiseStream(Protocol):
    """Standard normals ``z_t`` per round, each a pure function of the stream's state and the round."""

    def normals(self, server_round: int, size: int) -> np.ndarray:
        """``z_t``: ``size`` standard normals (float64) of round ``server_round``."""
        ...

    def weighted_sum(self, terms: Sequence[tuple[int, float]], size: int) -> np.ndarray:
        """``sum_s w_s z_s`` over ``terms = [(s, w_s), ...]``, added in that order (a weight 0: skipped)."""
        ...


def noise_stream(source: RandomSource, purpose: str) -> NoiseStream:
    """The stream of ``purpose`` for a run's noise ``source``: keyed from OS entropy when it is secure."""
    if source.secure:
        return KeyedNoiseStream(NoiseKey.from_os(), purpose=purpose)
    return SeededNoiseStream(source, purpose=purpose)


class KeyedNoiseStream:
    """Normals from a 256-bit key, by round and chunk of coordinates (see the module).

    Parameters
    ----------
    key : NoiseKey
        The secret.
    purpose : str
        What the noise is for: streams of different purposes under one key are independent.

    """

    def __init__(self, key: NoiseKey, *, purpose: str) -> None:
        self.key = key
        self.purpose = purpose

    def __repr__(self) -> str:
        return f"KeyedNoiseStream(purpose={self.purpose!r}, key=<secret>)"

    def round_key(self, server_round: int) -> int:
        """The 128-bit Philox key of ``server_round``: keyed BLAKE2b of the purpose and the round."""
        message = self.purpose.encode() + b"\x00" + int(server_round).to_bytes(8, "little", signed=True)
        digest = hashlib.blake2b(message, key=self.key.secret, digest_size=16).digest()
        return int.from_bytes(digest, "little")

    def normals(self, server_round: int, size: int) -> np.ndarray:
        """``z_t``: ``size`` standard normals (float64) of round ``server_round``."""
        return self.weighted_sum([(server_round, 1.0)], size)

    def weighted_sum(
        self, terms: Sequence[tuple[int, float]], size: int, *, threads: int | None = None
    ) -> np.ndarray:
        """``sum_s w_s z_s`` over ``terms = [(s, w_s), ...]`` in that order, without a vector per round.

        Parameters
        ----------
        terms : Sequence[tuple[int, float]]
            (round, weight) pairs; a weight of exactly 0 is skipped (its draw never made).
        size : int
            Coordinates of each ``z_s``.
        threads : int, optional
            Chunks drawn at once (default: the CPUs this process may use, at most 8).

        """
        kept = [(self.round_key(s), float(w)) for s, w in terms if w != 0.0]
        out = np.zeros(int(size), dtype=np.float64)
        starts = range(0, int(size), CHUNK)
        if threads is None:
            threads = min(8, usable_cpus())
        if threads <= 1 or len(starts) <= 1:
            for start in starts:
                _add_chunk(out, start, kept)
            return out
        with ThreadPoolExecutor(
            max_workers=min(threads, len(starts)), thread_name_prefix="dpfl-noise"
        ) as pool:
            for done in [pool.submit(_add_chunk, out, start, kept) for start in starts]:
                done.result()
        return out


class SeededNoiseStream:
    """Normals from a seeded run's generator of ``purpose`` for each round (see the module).

    Parameters
    ----------
    source : RandomSource
        The run's seeded noise source (``run.noise``).
    purpose : str
        The generators' purpose.

    """

    def __init__(self, source: RandomSource, *, purpose: str) -> None:
        if source.secure:
            raise ValueError("a secure noise source cannot draw a round again: use a KeyedNoiseStream")
        self.source = source
        self.purpose = purpose

    def normals(self, server_round: int, size: int) -> np.ndarray:
        """``z_t``: the first ``size`` standard normals of round ``server_round``'s generator."""
        return self.source.generator(self.purpose, server_round=server_round).standard_normal(int(size))

    def weighted_sum(
        self, terms: Sequence[tuple[int, float]], size: int, *, threads: int | None = None
    ) -> np.ndarray:
        """``sum_s w_s z_s`` over ``terms = [(s, w_s), ...]`` (a weight of exactly 0 skipped).

        A round's normals come from one generator in sequence, so the work is split by rounds: the
        terms in :data:`PARTS` consecutive parts, each summed in order (by up to ``threads`` threads:
        default the CPUs this process may use), the parts' sums added in order. The split does not
        depend on ``threads``: the result is the same bit for bit with any number of threads.
        """
        kept = [(s, float(w)) for s, w in terms if w != 0.0]
        bounds = [len(kept) * i // PARTS for i in range(PARTS + 1)]
        parts = [kept[lo:hi] for lo, hi in itertools.pairwise(bounds) if hi > lo]
        threads = min(8, usable_cpus()) if threads is None else threads
        if threads <= 1 or len(parts) <= 1:
            sums = [self._part_sum(part, size) for part in parts]
        else:
            with ThreadPoolExecutor(
                max_workers=min(threads, len(parts)), thread_name_prefix="dpfl-noise"
            ) as pool:
                sums = list(pool.map(lambda part: self._part_sum(part, size), parts))
        out = np.zeros(int(size), dtype=np.float64)
        for part_sum in sums:
            out += part_sum
        return out

    def _part_sum(self, terms: list[tuple[int, float]], size: int) -> np.ndarray:
        """``sum w_s z_s`` over ``terms`` in order, one vector drawn at a time."""
        out = np.zeros(int(size), dtype=np.float64)
        for server_round, weight in terms:
            draw = self.normals(server_round, size)
            if weight != 1.0:
                draw *= weight
            out += draw
        return out


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _add_chunk(out: np.ndarray, start: int, terms: list[tuple[int, float]]) -> None:
    """``out[start : start + CHUNK] += sum_s w_s z_s[chunk]``, the terms in order."""
    target = out[start : start + CHUNK]
    draw = np.empty(target.size, dtype=np.float64)
    counter = (start // CHUNK) << 192
    for round_key, weight in terms:
        generator = np.random.Generator(np.random.Philox(key=round_key, counter=counter))
        generator.standard_normal(out=draw)
        if weight != 1.0:
            draw *= weight
        target += draw
