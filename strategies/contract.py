"""What the platform asks of an algorithm: one declaration, and a strategy object with a narrow contract.

An algorithm is declared once (:class:`Declaration`: its name, paper, privacy unit and mechanism, its
client, its typed settings, its own network, what it supports), and its server side is an object
that satisfies :class:`Strategy`: Flower's round hooks, two typed reports and its ledgers. The
platform (:mod:`fl_app.run.server`, the checkpoint, the evaluation stages) calls nothing else.
:class:`strategies.base.FederatedStrategy` implements the contract for the usual case (seeded or
secret cohorts, reply triage, one accountant) with hooks a subclass overrides; a strategy may also
implement it from scratch (``tests/test_plugin.py`` does, in a test module).

Reports are data (:mod:`strategies.reporting`): a :class:`~strategies.reporting.RoundReport` after
every round and a :class:`~strategies.reporting.RunReport` (the privacy report and the final
fields) at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid

    from fl_app.config.settings import RunSettings
    from fl_app.run.context import RunContext
    from strategies.reporting import Randomness, RoundReport, RunReport
    from strategies.settings import StrategySettings

#: A value ``results.json`` can hold.
JSON = Any


def _never(settings: RunSettings) -> None:
    """No check beyond the settings."""


#: The comparison groups an algorithm can have an arm in (``conf/<group>/<name>.yaml``).
COMPARISONS = ("comparison", "cross_device", "record_level")


@dataclass(frozen=True)
class QuickExample:
    """A shape and a budget where the algorithm learns, and its one real simulation in the suite.

    ``python -m fl_app +experiment=quick strategy=<name>`` runs ``overrides`` (after the examples'
    common settings, ``conf/example/quick.yaml``; the command line still wins);
    ``tests/test_simulations.py`` runs it with ``suite_rounds`` rounds (and ``suite_overrides``) and
    requires the final accuracy to reach ``beats_chance``, the budget to be spent in the unit the
    results name and not more.

    Attributes
    ----------
    overrides : tuple[str, ...]
        Hydra overrides, e.g. ``("num_clients=100", "clients_per_round=10", "num_rounds=20")``.
    suite_rounds : int
        Rounds of the suite's run (the budget stays the example's: fewer releases, less noise each).
    suite_overrides : tuple[str, ...]
        What the suite adds (e.g. ``privacy.diagnostics=true`` to read secret cohort sizes).
    beats_chance : float
        The least final accuracy of the suite's run (chance is 0.1 on Fashion-MNIST).
    about : str
        One line: what the example shows (docs/algorithms/README.md's quick-example table).

    """

    overrides: tuple[str, ...]
    suite_rounds: int
    suite_overrides: tuple[str, ...] = ()
    beats_chance: float = 0.3
    about: str = ""


@dataclass(frozen=True)
class Declaration:
    """Everything the platform knows about an algorithm before a run starts.

    Attributes
    ----------
    name : str
        ``strategy=<name>`` (also its ``conf/strategy/<name>.yaml`` and registry name).
    paper : str
        The source: authors, title, venue.
    unit : str
        What one epsilon protects ("none": not private).
    mechanism : str
        The privacy mechanism, in words ("none").
    client : str
        Registry name of the client class that answers its train messages (``clients/<name>.py``).
    settings : type[StrategySettings] | None
        Its typed ``cfg.strategy`` (None: no settings of its own).
    model : Callable[[RunSettings, tuple[int, ...]], str | None] | None
        Its own network for ``model=auto`` given the run's settings and the input shape (None or
        returning None: the platform's default).
    canaries : str | None
        None when ``privacy.canaries`` applies; else why not (completes "strategy=<name> ...").
    resume : str | None
        None when ``resume=`` continues a run exactly; else why not.
    checkpoint_holds : str | None
        What its checkpoint holds that no epsilon covers (un-noised sums, secrets), said when a run
        stops; None: nothing beyond what it released.
    release_hint : str
        Appended to the refusal of federated evaluation for a private run (what to use instead).
    private : Callable[[RunSettings], bool] | None
        Whether a run with these settings claims a finite epsilon (None: ``unit != "none"``).
    check : Callable[[RunSettings], None]
        Checks beyond the settings (keys outside ``strategy.*``; raise ``ConfigError``). All three
        take the run's typed settings (``settings.strategy_settings`` is the algorithm's own).
    quick : QuickExample | None
        Its quick example and suite simulation (None: it has none; the repository test asks for one).
    comparisons : tuple[str, ...]
        The comparison groups (:data:`COMPARISONS`) with an arm of it (``conf/<group>/<name>.yaml``);
        empty: it is in no comparison.
    deploy : tuple[str, ...]
        Overrides a deployment of one round on two SuperNodes needs (``tests/test_deploy.py``), e.g.
        a model that fits the devices' data.
    min_clients : int
        The fewest clients a round needs (its check refuses smaller cohorts): one with more than two
        is deployed by a test of its own, not on the two-SuperNode federation.
    sequences : str | None
        None when it trains next-token networks on the text data sets (``dataset=shakespeare``,
        ``stackoverflow``); else why not (completes "does not run on dataset=<name>: ...").

    """

    name: str
    paper: str
    unit: str
    mechanism: str
    client: str
    settings: type[StrategySettings] | None = None
    model: Callable[[RunSettings, tuple[int, ...]], str | None] | None = None
    canaries: str | None = (
        "does not declare canary support (a canary needs the strategy to add its upload to what it "
        "aggregates: see docs/empirical_privacy.md)"
    )
    resume: str | None = None
    checkpoint_holds: str | None = None
    release_hint: str = ""
    private: Callable[[RunSettings], bool] | None = None
    check: Callable[[RunSettings], None] = field(default=_never)
    quick: QuickExample | None = None
    comparisons: tuple[str, ...] = ()
    deploy: tuple[str, ...] = ()
    min_clients: int = 1
    sequences: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.comparisons) - set(COMPARISONS))
        if unknown:
            raise ValueError(f"{self.name}: comparisons {unknown} unknown; allowed: {', '.join(COMPARISONS)}")

    def is_private(self, settings: RunSettings) -> bool:
        """Whether a run of this algorithm with ``settings`` claims a finite epsilon."""
        return self.private(settings) if self.private is not None else self.unit != "none"

    def model_name(
        self, settings: RunSettings, input_shape: tuple[int, ...], num_classes: int | None = None
    ) -> str:
        """The network to train: ``model`` unless ``auto``, then the algorithm's own or the default.

        ``num_classes``: the data's (a text data set's vocabulary: ``auto`` picks a network by it).
        """
        from fl_app.learning.models import resolve_model_name

        if settings.model == "auto" and self.model is not None:
            own = self.model(settings, input_shape)
            if own is not None:
                return own
        return resolve_model_name(settings.model, input_shape, num_classes)


@runtime_checkable
class Strategy(Protocol):
    """The server side of an algorithm, as the platform calls it (see the module docstring).

    ``declaration`` is the algorithm's :class:`Declaration`; ``run`` the
    :class:`~fl_app.run.context.RunContext` it was built with. Flower's round hooks come first; then
    what the platform reads: the reports, the randomness, the ledgers, the checkpoint.
    """

    declaration: ClassVar[Declaration]
    run: RunContext

    def describe(self) -> None:
        """Log the strategy's configuration, its unit and the budget asked for (the run's header)."""

    def initial_arrays(self) -> ArrayRecord:
        """The initial global model."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's train messages.

        A round that needs exchanges before them (SecAgg+'s key agreement in
        ``strategies/dp_fedavg_secagg``) runs them here through ``grid``; the platform then sends
        the returned messages and hands their replies to :meth:`aggregate_train`, which may use the
        same ``grid`` for exchanges after them (SecAgg+'s unmasking) within the round.
        """

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new global model from the replies (None: keep the previous one)."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation messages (usually none: private runs refuse them)."""

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Aggregate federated evaluation replies."""

    def arrays_for_evaluation(self, arrays: ArrayRecord) -> ArrayRecord:
        """What clients evaluate of the global model (a BNN: its binarized weights)."""

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Loss and accuracy of the global model on the server's evaluation split."""

    def report_round(self, server_round: int) -> RoundReport:
        """What the round released and cost (after its ``aggregate_train``)."""

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The run's privacy and final fields, for the released model ``final``."""

    def randomness(self) -> Randomness:
        """Where the privacy noise and the cohorts come from."""

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """Accountant states by file name (``privacy_ledger.json`` first; empty when not private)."""

    def for_checkpoint(self) -> Strategy:
        """What a checkpoint keeps of it (without what only lives within a round)."""
