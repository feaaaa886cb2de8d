"""Replies in, failures out: which clients answered, which failed and why, malformed replies.

:class:`ReplyBook` is a strategy's collaborator (``strategy.replies``). A failed or
missing reply is logged and left out (the round goes on); privacy events still name every
selected client, so a failure never makes the accounting optimistic. With a secret cohort no line
about a failure reaches the published ``run.log`` (the console still shows it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.common import log

from fl_app import keys
from fl_app.learning.sums import PartialSum, Summand, is_partial_sum
from fl_app.learning.train_results import TrainResult
from fl_app.run.context import RunContext
from fl_app.run.log import withheld_from_file
from fl_app.run.roster import ClientInfo


class RecentRounds(dict):  # type: ignore[type-arg]
    """A per-round store that keeps only the latest :attr:`KEEP` rounds.

    Strategies keep per-round state (the cohort, the arrays a round started from, norms for the
    diagnostics) until the round is reported. A plain dict grows with every round, and the whole
    strategy is checkpointed after every round, so the checkpoint grew with the run: at 1000
    clients, 100 per round, round 170 pickled 17,000 cohort entries (writing the checkpoint was 234
    of the server thread's ~520 busy py-spy samples there).
    Setting a round's entry drops the entries older than the latest ``KEEP`` rounds.
    """

    KEEP = 2

    def __setitem__(self, server_round: int, value: Any) -> None:
        super().__setitem__(server_round, value)
        for old in [r for r in self if r <= server_round - self.KEEP]:
            del self[old]


@dataclass(frozen=True)
class Replies:
    """A round's valid train replies, sorted by client id, and the clients that failed.

    What :meth:`strategies.base.FederatedStrategy.aggregate` receives: failures are logged once and left
    out. Read a declared sum with :meth:`sum` (the engine may have added the clients' terms where they
    ran), each reply decoded with :meth:`results`, or the messages themselves in :attr:`valid`.
    """

    valid: list[tuple[ClientInfo, Message]]
    failed: list[ClientInfo]
    #: Sums a summand's terms over some of the replies (the strategy's blocks of the round's cohort).
    summer: Callable[[list[tuple[ClientInfo, Message]], Summand], PartialSum]

    def __len__(self) -> int:
        return len(self.valid)

    def __iter__(self) -> Iterator[tuple[ClientInfo, Message]]:
        return iter(self.valid)

    @property
    def clients(self) -> list[ClientInfo]:
        """The clients whose replies are valid, in client order."""
        return [info for info, _ in self.valid]

    def only(self, keep: Callable[[ClientInfo, Message], bool]) -> Replies:
        """These replies but those ``keep`` refuses (their sum too: :meth:`sum` adds the kept ones only)."""
        kept = [(info, reply) for info, reply in self.valid if keep(info, reply)]
        return Replies(valid=kept, failed=self.failed, summer=self.summer)

    def sum(self, summand: Summand) -> PartialSum:
        """The sum of ``summand``'s terms over the valid replies (:func:`fl_app.learning.sums.summed`)."""
        return self.summer(self.valid, summand)

    def results(self, like: Any) -> list[tuple[ClientInfo, TrainResult]]:
        """Each valid reply decoded (arrays shaped like ``like``, metrics, other records), in client order.

        ``ValueError`` for a packed reply: a strategy whose round the engine packs reads :meth:`sum`.
        """
        if any(is_partial_sum(reply) for _, reply in self.valid):
            raise ValueError("a packed round's replies are sums: read them with Replies.sum")
        return [(info, TrainResult.of_reply(reply, like)) for info, reply in self.valid]


class ReplyBook:
    """Who was asked in a round, who answered and who failed (a strategy's collaborator).

    Parameters
    ----------
    run : RunContext
        The run (its roster maps a reply's sender to a client).
    secret_cohort : bool
        True when the privacy accounting relies on the cohort being secret (amplification by
        sampling): failures are then logged to the console only, never to the published run.log.

    """

    def __init__(self, run: RunContext, *, secret_cohort: bool = False) -> None:
        self.run = run
        self.secret_cohort = secret_cohort
        self._selected: dict[int, list[ClientInfo]] = RecentRounds()
        self._failed: dict[int, list[int]] = RecentRounds()
        self._failure_reasons: dict[int, list[str]] = RecentRounds()
        self._by_node: dict[int, ClientInfo] | None = None

    def forget(self) -> ReplyBook:
        """A copy without the rounds it holds (what a checkpoint keeps: nothing of finished rounds)."""
        return ReplyBook(self.run, secret_cohort=self.secret_cohort)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the node index (rebuilt from the roster a resumed run binds)."""
        return {**self.__dict__, "_by_node": None}

    def record_selected(self, server_round: int, clients: list[ClientInfo]) -> None:
        """The clients sent a train message in ``server_round``."""
        self._selected[server_round] = clients

    def selected(self, server_round: int) -> list[ClientInfo]:
        """The clients sent a train message in ``server_round``."""
        return self._selected.get(server_round, [])

    def split(
        self, server_round: int, replies: Iterable[Message], *, stage: str = "train"
    ) -> tuple[list[tuple[ClientInfo, Message]], list[ClientInfo]]:
        """Separate good replies from failures (logged), mapped to roster entries."""
        if self._by_node is None:
            self._by_node = {info.node_id: info for info in self.run.roster}
        by_node = self._by_node
        valid: list[tuple[ClientInfo, Message]] = []
        failed: list[ClientInfo] = []
        reasons: list[str] = []
        for reply in replies:
            info = by_node.get(int(reply.metadata.src_node_id))
            if info is None:
                log(WARNING, "%s: reply from unknown node %s ignored", stage, reply.metadata.src_node_id)
                continue
            if reply.has_error():
                failed.append(info)
                reasons.append(reply.error.reason or "?")
                reason = reply.error.reason.strip().splitlines()[-1] if reply.error.reason else "?"
                secret = self.secret_cohort and stage == "train"
                log(
                    WARNING,
                    "%s round %d: client %s failed: %s",
                    stage,
                    server_round,
                    info.client_id,
                    reason[:300],
                    # the operator draws the cohort and sees it; run.log is published with the results
                    extra=withheld_from_file() if secret else None,
                )
            elif is_partial_sum(reply):  # a packed message's sum: valid for each of its members
                valid.extend((by_node[node], reply) for node in PartialSum.members_of(reply))
            else:
                valid.append((info, reply))
        # Replies arrive in an order that depends on timing: aggregate them by client id, so a
        # seeded run sums its floating-point updates in the same order every time.
        valid.sort(key=lambda pair: pair[0].client_id)
        if stage == "train":
            expected = {c.client_id for c in self.selected(server_round)}
            answered = {info.client_id for info, _ in valid} | {info.client_id for info in failed}
            failed += [self.run.info(c) for c in sorted(expected - answered)]
            self._failed[server_round] = sorted(info.client_id for info in failed)
            self._failure_reasons[server_round] = reasons
            if expected - answered:
                log(
                    WARNING,
                    "train round %d: %d clients did not reply in time",
                    server_round,
                    len(expected - answered),
                    extra=withheld_from_file() if self.secret_cohort else None,
                )
        return valid, failed

    def mark_failed(self, server_round: int, clients: list[int], reason: str) -> None:
        """Count ``clients`` of ``server_round`` as failed after all (e.g. a malformed upload)."""
        self._failed[server_round] = sorted(set(self._failed.get(server_round, [])) | set(clients))
        self._failure_reasons[server_round] = [*self._failure_reasons.get(server_round, []), reason]

    def set_failures(self, server_round: int, clients: list[int], reason: str) -> None:
        """The clients of ``server_round`` that failed are exactly ``clients`` (a protocol knows better).

        E.g. a secure aggregation discarded before its train messages: the clients that dropped out
        of its first stages failed, the others did not.
        """
        self._failed[server_round] = sorted(set(clients))
        self._failure_reasons[server_round] = [reason] if clients else []

    def failures(self, server_round: int) -> list[int]:
        """Ids of the clients that failed in ``server_round``."""
        return self._failed.get(server_round, [])

    def failure_reasons(self, server_round: int) -> list[str]:
        """The error reasons of the train replies that failed in ``server_round`` (for the health check)."""
        return self._failure_reasons.get(server_round, [])


def echo_mismatch(reply: Message, expected: dict[str, float | int]) -> str:
    """Empty when the reply's metrics echo every ``expected`` mechanism parameter, else what differs.

    A client that applied other parameters than it was sent (an old client, a tampered config)
    would release under another guarantee than the one accounted: its reply is rejected.
    """
    metrics = reply.content.metric_records.get(keys.METRICS)
    if metrics is None:
        return "no metrics"
    for key, value in expected.items():
        if key not in metrics or not math.isclose(float(metrics[key]), float(value), rel_tol=1e-9):
            return f"{key}={metrics.get(key)!r}, expected {float(value)!r}"
    return ""
