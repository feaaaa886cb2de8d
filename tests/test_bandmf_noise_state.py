"""DP-BandMF's noise from a secret key: the stored recursion's output, a resume, a checkpoint without vectors.

Layers: the keyed stream (:mod:`fl_app.privacy.keyed_noise`) on its own; :class:`CorrelatedNoise`'s
keyed draws against its stored recursion (:meth:`CorrelatedNoise.draw`, tested against the dense
``C`` in ``tests/test_dp_bandmf.py``) fed the same ``z``, both ways of keeping the state (the last
``b - 1`` vectors in memory, or every ``z_s`` drawn again); the strategy on constructed replies
(no Ray): a run stopped after a checkpoint and resumed releases what an uninterrupted run releases,
with OS-entropy keys (a key drawn again would not); the private state holds the key and no noise
vector, and nothing else the run writes or logs holds the key.
"""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest
from conftest import build_run_context, dense_lower_toeplitz, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from fl_app import keys
from fl_app.privacy.keyed_noise import (
    CHUNK,
    KeyedNoiseStream,
    NoiseKey,
    NoiseStream,
    SeededNoiseStream,
    noise_stream,
)
from fl_app.privacy.rng import RandomSource
from fl_app.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from strategies import STRATEGIES
from strategies.dp_bandmf.factorization import CorrelatedNoise, optimal_banded_toeplitz

DIGITS = ["dataset=digits", "partition=iid", "num_clients=12", "clients_per_round=3", "strategy=dp_bandmf"]


class StreamAsGenerator:
    """A stand-in for ``numpy.random.Generator``: its round-t normals are the stream's ``z_t``, in order."""

    def __init__(self, stream: NoiseStream, server_round: int, size: int) -> None:
        self.normals, self.used = stream.normals(server_round, size), 0

    def normal(self, loc: float, scale: float, size: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(size))
        self.used += count
        return loc + scale * self.normals[self.used - count : self.used].reshape(size)


def stream(seed: int = 5, purpose: str = "test") -> KeyedNoiseStream:
    return KeyedNoiseStream(NoiseKey(np.random.default_rng(seed).bytes(32)), purpose=purpose)


# ----------------------------------------------------------------------------- the keyed stream


def test_a_rounds_normals_are_a_function_of_key_purpose_and_round_and_any_chunk_is_drawn_alone():
    z = stream()
    size = 2 * CHUNK + 7
    first = z.normals(3, size)
    assert np.array_equal(first, stream().normals(3, size))  # the same key: the same vector
    assert np.array_equal(first[:100], z.normals(3, 100))  # a prefix is the shorter draw
    assert not np.array_equal(first, z.normals(4, size))
    assert not np.array_equal(first, stream(purpose="other").normals(3, size))
    assert not np.array_equal(first, stream(seed=6).normals(3, size))
    chunks = first.reshape(-1)[: 2 * CHUNK].reshape(2, CHUNK)
    assert abs(np.corrcoef(chunks)[0, 1]) < 0.02  # chunks are not shifted copies of one stream
    assert abs(first.mean()) < 0.01 and first.std() == pytest.approx(1.0, abs=0.01)
    combined = z.weighted_sum([(1, 0.5), (2, 0.0), (3, -2.0)], size, threads=3)
    assert np.allclose(combined, 0.5 * z.normals(1, size) - 2.0 * z.normals(3, size), rtol=0, atol=1e-12)
    assert np.array_equal(combined, z.weighted_sum([(1, 0.5), (2, 0.0), (3, -2.0)], size, threads=1))


def test_a_seeded_streams_weighted_sum_is_the_same_with_any_number_of_threads():
    z = SeededNoiseStream(RandomSource(seed=3), purpose="p")
    terms = [(s, 0.1 * s - 0.35) for s in range(1, 12)]
    sums = [z.weighted_sum(terms, 1000, threads=n) for n in (1, 2, 5)]
    assert np.array_equal(sums[0], sums[1]) and np.array_equal(sums[0], sums[2])
    direct = sum(w * z.normals(s, 1000) for s, w in terms)
    assert np.allclose(sums[0], direct, rtol=0, atol=1e-12)
    assert np.array_equal(z.weighted_sum([(4, 1.0)], 1000), z.normals(4, 1000))


def test_secure_randomness_keys_the_stream_from_os_entropy_and_a_seeded_one_draws_the_seeds_generators(
    monkeypatch,
):
    drawn: list[int] = []

    def token_bytes(n: int) -> bytes:
        drawn.append(n)
        return bytes(range(n))

    monkeypatch.setattr("fl_app.privacy.keyed_noise.secrets.token_bytes", token_bytes)
    secure = noise_stream(RandomSource(seed=None, secure=True), "p")
    assert isinstance(secure, KeyedNoiseStream) and secure.key.secret == bytes(range(32)) and drawn == [32]
    assert secure.key.secret.hex() not in repr(secure) + repr(secure.key)
    seeded = noise_stream(RandomSource(seed=9), "p")
    assert isinstance(seeded, SeededNoiseStream) and drawn == [32]
    reference = RandomSource(seed=9).generator("p", server_round=4).normal(0.0, 1.0, size=300)
    assert np.array_equal(seeded.normals(4, 300), reference)  # what the round's generator draws
    with pytest.raises(ValueError, match="secure"):
        SeededNoiseStream(RandomSource(seed=None, secure=True), purpose="p")
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseKey(b"\x01" * 16)


# ----------------------------------------------------------------------------- the correlated noise


@pytest.mark.parametrize("kind", ["keyed", "seeded"])
@pytest.mark.parametrize(("bands", "size"), [(1, 50), (4, 2 * CHUNK + 3), (9, 300)])
def test_keyed_noise_is_the_stored_recursions_output_for_the_same_stream(bands, size, kind):
    """Kept in memory: bit for bit :meth:`draw` fed the stream's ``z`` (seeded: fed the round's own
    generator, as the strategy drew before); drawn again: to float rounding. Both whiten to
    ``sigma z`` through the dense ``C``."""
    rounds, sigma = 14, 1.7
    c = optimal_banded_toeplitz(rounds=rounds, bands=bands).coefficients
    like = [np.zeros((3, size // 3)), np.zeros(size - 3 * (size // 3))]
    source = RandomSource(seed=11)
    z: NoiseStream = stream() if kind == "keyed" else SeededNoiseStream(source, purpose="bandmf-noise")
    reference, kept, drawn_again = (CorrelatedNoise(c, sigma=sigma) for _ in range(3))
    outputs = {"reference": [], "kept": [], "again": []}
    for t in range(1, rounds + 1):
        generator = (
            StreamAsGenerator(z, t, size)
            if kind == "keyed"
            else source.generator("bandmf-noise", server_round=t)
        )
        outputs["reference"].append(reference.draw(like, generator))
        outputs["kept"].append(kept.at_round(like, z, t, keep_bytes=float("inf")))
        outputs["again"].append(drawn_again.at_round(like, z, t, keep_bytes=0))
    flat = {
        name: np.array([np.concatenate([a.ravel() for a in y]) for y in ys]) for name, ys in outputs.items()
    }
    assert np.array_equal(flat["kept"], flat["reference"])
    assert np.allclose(flat["again"], flat["reference"], rtol=1e-10, atol=1e-12)
    assert not drawn_again._kept and (bands == 1 or len(kept._kept) == bands - 1)
    whitened = dense_lower_toeplitz(c, rounds) @ flat["again"]
    assert np.allclose(
        whitened, sigma * np.array([z.normals(t, size) for t in range(1, rounds + 1)]), atol=1e-9
    )


def test_kept_vectors_are_not_pickled_and_are_replayed_bit_for_bit():
    c = optimal_banded_toeplitz(rounds=12, bands=5).coefficients
    like, z = [np.zeros(1000)], stream()
    straight = CorrelatedNoise(c, sigma=0.8)
    expected = [straight.at_round(like, z, t, keep_bytes=1e9)[0] for t in range(1, 13)]
    noise = CorrelatedNoise(c, sigma=0.8)
    for t in range(1, 7):
        noise.at_round(like, z, t, keep_bytes=1e9)
    data = pickle.dumps(noise)
    assert len(data) < 1000 * 8  # the coefficients, not four vectors of 1000
    resumed = pickle.loads(data)
    assert not resumed._kept
    assert all(
        np.array_equal(resumed.at_round(like, z, t, keep_bytes=1e9)[0], expected[t - 1]) for t in range(7, 13)
    )


# ----------------------------------------------------------------------------- the strategy


def zero_round(strategy, server_round: int, current: ArrayRecord) -> ArrayRecord:
    """Every selected client returns the global model (zero updates): the release is the noise."""
    messages = list(strategy.configure_train(server_round, current, ConfigRecord(), grid=None))
    arrays, _ = strategy.aggregate_train(
        server_round, [reply_to(m, arrays=current, metrics={keys.TRAIN_LOSS: 0.0}) for m in messages]
    )
    assert arrays is not None
    return arrays


def released(strategy, rounds: range, start: ArrayRecord) -> list[np.ndarray]:
    models, current = [], start
    for t in rounds:
        current = zero_round(strategy, t, current)
        models.append(current["w"].numpy().astype(np.float64))
    return models


SECURE = ["privacy.secure_rng=true", "privacy.noise_seed=null"]


@pytest.mark.parametrize("randomness", ["secure", "seeded"])
@pytest.mark.parametrize("memory", ["1", "0"], ids=["vectors kept in memory", "drawn again"])
def test_a_resumed_run_continues_the_same_noise_stream(tmp_path, memory, randomness):
    """With an OS-entropy key, a resume that drew a new key (or lost the kept vectors) releases other ones."""
    size = 5000
    overrides = [*DIGITS, "num_rounds=8", "strategy.bands=4", *(SECURE if randomness == "secure" else [])]
    run = build_run_context([*overrides, f"strategy.noise_memory_gib={memory}"], tmp_path)
    start = ArrayRecord({"w": Array(np.zeros(size, dtype=np.float32))})
    stopped = STRATEGIES.get("dp_bandmf")(run)
    before = released(stopped, range(1, 5), start)
    last = ArrayRecord({"w": Array(before[-1].astype(np.float32))})
    save_checkpoint(tmp_path, Checkpoint(4, 8, "incomplete", [], "", last, stopped, {}, 0.0), run)
    resumed = load_checkpoint(tmp_path, run).strategy
    after = released(resumed, range(5, 9), last)
    # the uninterrupted run: the stopped strategy, which kept going
    assert all(np.array_equal(a, b) for a, b in zip(after, released(stopped, range(5, 9), last), strict=True))
    sums = np.diff(np.array([np.zeros(size), *before, *after]), axis=0) * 3  # m = 3, lr 1: the noise
    c = stopped.matrix.coefficients
    whitened = dense_lower_toeplitz(c, 8) @ sums  # C y = z: white, at the calibrated scale, across the resume
    assert np.allclose(np.std(whitened, axis=1), stopped.noise_multiplier * 1.0, rtol=0.06)
    assert np.abs(np.corrcoef(whitened)[np.triu_indices(8, 1)]).max() < 0.1


def test_the_private_state_holds_the_key_and_no_noise_vector_and_nothing_else_holds_the_key(tmp_path, caplog):
    size, bands = 20_000, 4
    overrides = [*DIGITS, "num_rounds=5", f"strategy.bands={bands}", *SECURE]
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get("dp_bandmf")(run)
    start = ArrayRecord({"w": Array(np.zeros(size, dtype=np.float32))})
    with caplog.at_level(logging.DEBUG):
        models = released(strategy, range(1, 4), start)
    assert len(strategy.noise._kept) == bands - 1  # in memory (fits the default 1 GiB)
    last = ArrayRecord({"w": Array(models[-1].astype(np.float32))})
    path = save_checkpoint(tmp_path, Checkpoint(3, 5, "incomplete", [], "", last, strategy, {}, 0.0), run)
    state = path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o600  # readable by the server's owner only
    secret = strategy.noise_stream.key.secret
    assert secret in state  # the key: in the private state only
    assert len(state) < 2 * size * 8  # the model and small things, not bands - 1 = 3 float64 vectors
    for vector in strategy.noise._kept:
        assert vector[:8].tobytes() not in state and vector[:8].astype(np.float32).tobytes() not in state
    loaded = load_checkpoint(tmp_path, run).strategy
    assert not loaded.noise._kept and not loaded.noise.history and loaded.noise_stream.key.secret == secret
    assert "noise key" in loaded.declaration.checkpoint_holds
    published = json.dumps(
        [
            strategy.privacy_summary(),
            strategy.ledgers(),
            [strategy.report_round(t) for t in range(1, 4)],
            str(strategy.randomness()),
            str(strategy.report_run({})),
        ],
        default=str,
    )
    published += caplog.text + repr(strategy.noise_stream) + repr(strategy.noise_stream.key)
    for form in (secret.hex(), secret.hex().upper(), str(int.from_bytes(secret, "big")), str(list(secret))):
        assert form not in published
    assert secret not in published.encode("latin-1", errors="replace")


def test_a_checkpoint_that_kept_noise_vectors_continues_them(tmp_path):
    """A strategy whose noise object holds stored vectors (an earlier version's checkpoint) continues
    its recursion with the run's per-round generator, as that version did."""
    run = build_run_context([*DIGITS, "num_rounds=4", "strategy.bands=3"], tmp_path)
    earlier = STRATEGIES.get("dp_bandmf")(run)
    like = [np.zeros(10)]
    for t in range(1, 3):  # what the earlier version drew in rounds 1 and 2
        earlier.noise.draw(like, run.noise.generator("bandmf-noise", server_round=t))
    reference = pickle.loads(pickle.dumps(earlier.noise))
    expected = reference.draw(like, run.noise.generator("bandmf-noise", server_round=3))[0]
    assert np.array_equal(earlier._round_noise(like, 3)[0], expected)
    assert earlier.noise_stream is None
