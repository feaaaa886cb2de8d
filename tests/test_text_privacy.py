"""End-to-end privacy audit on a text client: DP-FedAvg, one user added or removed, one round.

As ``tests/test_privacy_end_to_end.py`` audits the image clients, here the platform builds a
``dataset=stackoverflow`` run (a converted corpus generated inside the test, the causal transformer,
next-token loss), the strategy calibrates its noise, ``configure_train`` sends its real message, the
real client trains on one user's token sequences and ``aggregate_train`` clips, noises and releases.
The unit is one user: the neighbours are the federation with the user (client 0) and without it (its
update missing, as a failure). The model starts at zero, so one user's training moves only the output
bias, deterministically (checked); the released model is projected on that user's update, the
optimal statistic for Gaussian noise, over many repetitions with fresh privacy randomness, and
:func:`fl_app.privacy.audit.audit_epsilon` lower-bounds epsilon. The strategy fails when the bound
exceeds the epsilon it reports; a bound too small to see a leak fails too, and so does the audit of a
strategy whose noise is halved (a mutant).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import error_reply, reply_to, settings_of
from flwr.app import ConfigRecord, Message
from test_privacy_end_to_end import (  # noqa: F401 - audit_setup: the audits' fixture (one thread, clean caches)
    GAUSSIAN_DELTA,
    audit,
    audit_setup,
    reseeded,
    run_client,
    train_message,
    zero_model,
)

from clients.base import FederatedClient
from fl_app import keys
from fl_app.config.data_choices import decide_vocabulary
from fl_app.data.federated import ClientDataset, federated_data
from fl_app.data.synthetic_text import write_token_corpus
from fl_app.learning.model_spec import ModelSpec
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from fl_app.run.server import make_run_context
from strategies import STRATEGIES
from strategies.arrays import flat_vector

pytestmark = pytest.mark.audit

#: Repetitions per neighbour.
TRIALS = 1500
#: A user's sentences: 9 sequences of 8 tokens, every target the word 1 (no pad: every position counts).
USER = ClientDataset(np.full((9, 8), 4, dtype=np.uint16), np.full((9, 8), 1, dtype=np.uint16))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[int, ClientDataset]:
    """What each client holds (by client id), in place of its partition of the corpus."""
    data: dict[int, ClientDataset] = {}
    monkeypatch.setattr(FederatedClient, "local_data", lambda self: data[self.client_id])
    return data


def text_run(tmp_path: Path, overrides: list[str]) -> RunContext:
    """DP-FedAvg on a generated Stack Overflow-like corpus: 6 words + 4 special tokens, sequences of 8."""
    corpus = tmp_path / "corpus"
    write_token_corpus(corpus, users=4, test_users=2, mean_sentences=3, cap=None, words=6, length=8, seed=0)
    settings = settings_of(
        [
            "dataset=stackoverflow",
            f"dataset.path={corpus}",
            "dataset.vocab_size=6",
            "dataset.sequence_length=8",
            "partition=natural",
            "model=causal_transformer",
            "strategy=dp_fedavg",
            "num_clients=1",
            "clients_per_round=1",
            "num_rounds=1",
            "lr=1.0",
            "batch_size=16",
            "local_epochs=1",
            "strategy.clip=0.1",
            "privacy.epsilon=2",
            f"privacy.delta={GAUSSIAN_DELTA}",
            *overrides,
        ]
    )
    settings = decide_vocabulary(settings, STRATEGIES.get("dp_fedavg").declaration)  # as validation does
    data = federated_data(settings.data)
    assert data.num_classes == 10
    spec = ModelSpec("causal_transformer", data.input_shape, data.num_classes, data.uncounted_targets)
    roster = [ClientInfo(0, 1000, len(USER))]
    return make_run_context(settings, roster=roster, data=data, model_spec=spec, output_dir=tmp_path)


def released_projections(run: RunContext, held: dict[int, ClientDataset]) -> tuple[list[np.ndarray], float]:
    """The released model's projection on the user's update, with and without the user; the epsilon."""
    strategy = STRATEGIES.get("dp_fedavg")(run)
    start = zero_model(run)
    held[0] = USER
    message = train_message(reseeded(strategy, 0), start, 0)
    assert message is not None
    first, second = run_client(message, 0, 1), run_client(message, 0, 1)
    trained = first.content.array_records[keys.ARRAYS]
    assert np.array_equal(flat_vector(trained), flat_vector(second.content.array_records[keys.ARRAYS]))
    update = flat_vector(trained) - flat_vector(start)
    moved = {name for name in trained if np.any(trained[name].numpy() != start[name].numpy())}
    assert moved == {"output_layer.bias"}, moved  # a zero model: only the output bias learns
    direction = update / np.linalg.norm(update)
    outputs = []
    for world, present in enumerate((True, False)):
        values = []
        for trial in range(TRIALS):
            fresh = reseeded(STRATEGIES.get("dp_fedavg")(run), 2 * trial + world)
            messages = list(fresh.configure_train(1, start, ConfigRecord(), grid=None))
            replies = [reply_to(m, arrays=trained) if present else absent(m) for m in messages]
            arrays, _ = fresh.aggregate_train(1, replies)
            values.append(float((flat_vector(arrays) - flat_vector(start)) @ direction))
        outputs.append(np.asarray(values))
    reported = STRATEGIES.get("dp_fedavg")(run)
    list(reported.configure_train(1, start, ConfigRecord(), grid=None))
    reported.aggregate_train(1, [])
    return outputs, float(reported.epsilon().epsilon)


def absent(message: Message) -> Message:
    """The user's reply when it is not in the federation: a failure."""
    return error_reply(message, "absent")


def test_dp_fedavg_on_a_text_client_meets_the_epsilon_it_reports(
    tmp_path: Path, held: dict[int, ClientDataset]
) -> None:
    outputs, reported = released_projections(text_run(tmp_path, []), held)
    result = audit(*outputs, delta=GAUSSIAN_DELTA)
    assert result.passes(reported), (result, reported)
    assert result.epsilon_lower_bound >= 0.3 * reported, (result, reported)  # it could see a leak


def test_the_text_audit_catches_noise_halved(
    tmp_path: Path, held: dict[int, ClientDataset], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mutant that adds half the calibrated noise (and accounts the full noise) fails the audit."""
    import strategies.dp_fedavg as dp_fedavg

    mechanism = dp_fedavg.gaussian_mechanism
    monkeypatch.setattr(
        dp_fedavg,
        "gaussian_mechanism",
        lambda *, values, sigma, rng: mechanism(values=values, sigma=sigma / 2, rng=rng),
    )
    outputs, reported = released_projections(text_run(tmp_path, []), held)
    assert not audit(*outputs, delta=GAUSSIAN_DELTA).passes(reported)
