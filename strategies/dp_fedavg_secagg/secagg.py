"""The server side of one SecAgg+ round, driven from the strategy's own round.

SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) as Flower 1.41 implements it: the clients run Flower's
``secaggplus_mod`` unchanged, and this class sends them the same four stages, with the same
records, as Flower's ``SecAggPlusWorkflow``:

1. **setup**: the parameters (cohort size, shares, threshold, modulus); each client answers with
   two public keys;
2. **share keys**: each client gets its neighbours' public keys and answers with Shamir shares
   of its mask seed and of its key-agreement secret key, encrypted for each neighbour;
3. **collect masked vectors**: each client gets the shares meant for it plus the train message,
   trains, encodes (the client class) and uploads its vector plus a private mask plus pairwise
   masks, mod ``2^b``;
4. **unmask**: the clients still there send the shares that remove the survivors' private masks
   and the dropped clients' pairwise masks.

The server never holds a client's vector unmasked: what a client uploads is its vector plus
uniformly random masks mod ``2^b``, and only the sum over the survivors loses the masks. Why not
``SecAggPlusWorkflow`` itself: it is built around the legacy strategy API (``configure_fit``,
``aggregate_fit``, a ``LegacyContext``) and ends by dequantising the sum as a weighted average,
which a modular distributed-DP sum must not be (its weight factor overflows mod ``2^b``). The
neighbour graph differs from Flower's in one way: it is drawn from a generator the strategy
passes (Flower uses the global ``random``), and a client that dropped before sharing its keys is
not listed as dead in stage 4 (no neighbour holds its shares; Flower would ask for them).

Flower's primitives (:mod:`fl_app.engine.secagg`) do the key agreement and the secret sharing;
the masks come from :func:`fl_app.privacy.masks.mask_arrays` (ChaCha20 keyed by the whole agreed
key), on the devices (dpfl's mod) and here alike. The setup stage names that generator and a device
that does not confirm it (Flower's own mod, whose masks come from 32-bit seeds) is refused.

Two checks beyond Flower's, so that the server can compute no sum of fewer than ``min_sum``
clients (the fewest whose noise the plan is calibrated for) from what it holds:

* a round starts only with at least ``min_sum`` clients;
* before the unmask stage, the survivors' neighbour graph (pairs that share a mask, both still in)
  must fall into parts of at least ``min_sum`` clients each: the sum of a part with no mask to the
  rest is what unmasking reveals, and a sparse graph (``shares`` below the cohort) can break into
  small parts when neighbouring clients drop together.

**When a round is charged.** From the moment the unmask requests go out, the server may hold
enough shares to open a sum even if the stage then fails: a survivor's reply carries shares of its
neighbours' mask seeds and of the dropped clients' keys, so a part of the survivors' graph whose
shares all came back can be unmasked on its own (20 clients, ``shares=5``: dropouts at ring
positions 0, 1, 8 and 9 leave parts of 6 and 10; if positions 14-16 then do not answer, the
10-client part cannot be opened but the 6-client part can). :meth:`SecAggRound.unmask` therefore
calls its ``charge`` argument right before it sends the requests, whatever the stage's outcome.
Sound: any linear combination of the survivors' uploads the server can unmask is a union of whole
parts (a mask between two survivors stays: no survivor's key-agreement secret is ever asked
for), each part holds at least ``min_sum`` survivors (checked before the requests), and a client
is in one part only, so the charge of one sum of ``min_sum`` noise shares covers whatever opens.
Before the requests the server holds only masked vectors, uniform mod ``2^b``: nothing to charge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import ERROR
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log

from fl_app.engine.secagg import (
    MASK_GENERATOR,
    MASK_GENERATOR_KEY,
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
    bytes_to_private_key,
    bytes_to_public_key,
    combine_shares,
    generate_shared_key,
    mask_arrays,
)


class SecAggAbortedError(RuntimeError):
    """The round's secure aggregation cannot complete (too few clients stayed); nothing is released."""


@dataclass
class SecAggRound:
    """One round of SecAgg+ over ``nodes`` (see the module docstring).

    Parameters
    ----------
    nodes : list[int]
        Node ids of the round's cohort.
    bits : int
        The modulus is ``2^bits``; the clients' vectors are integers in ``[0, 2^bits)``.
    shares : int
        Number of shares of each secret (the size of a client's neighbourhood, itself included;
        odd, or the whole cohort).
    threshold : int
        Shares needed to rebuild a secret (more than half of ``shares``).
    send : Callable[[list[Message]], Iterable[Message]]
        Sends messages and returns the replies (the grid's ``send_and_receive`` with the round's timeout).
    graph_rng : np.random.Generator
        Draws the neighbour graph (public; it decides only which pairs share masks).
    group : str
        The messages' group id (the round).
    min_sum : int
        The fewest clients whose sum the server may be able to compute (at least 3: with 2, each
        learns the other's vector from the sum; the plan's ``survivors``).

    """

    nodes: list[int]
    bits: int
    shares: int
    threshold: int
    send: Callable[[list[Message]], Iterable[Message]]
    graph_rng: np.random.Generator
    group: str = ""
    min_sum: int = 3
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, list[bytes]] = field(default_factory=dict)
    keyed: set[int] = field(default_factory=set)
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    #: The neighbour graph's ring: each node's neighbours are the ``shares // 2`` on either side.
    ring: list[int] = field(default_factory=list)
    #: Nodes refused in the setup stage, with why (they did not confirm dpfl's mask generator).
    refused: dict[int, str] = field(default_factory=dict)

    @property
    def modulus(self) -> int:
        """``2^bits``."""
        return 1 << self.bits

    # ------------------------------------------------------------------ stages 0 and 1

    def setup_and_share_keys(self) -> set[int]:
        """Stages 0 and 1; returns the nodes that completed both (the ones stage 2 may ask)."""
        count = len(self.nodes)
        if count < max(3, self.min_sum):
            raise SecAggAbortedError(f"secure aggregation needs at least {max(3, self.min_sum)} clients")
        self.shares = min(self.shares, count)
        order = [int(self.nodes[i]) for i in self.graph_rng.permutation(count)]  # node ids exceed int64
        self.ring = order
        half = self.shares // 2
        self.neighbours = {
            nid: {order[(i + offset) % count] for offset in range(-half, half + 1)}
            if self.shares < count
            else set(order)
            for i, nid in enumerate(order)
        }
        setup = {
            Key.STAGE: Stage.SETUP,
            Key.SAMPLE_NUMBER: count,
            Key.SHARE_NUMBER: self.shares,
            Key.THRESHOLD: self.threshold,
            # identity quantisation: the clients' vectors are already integers in [0, 2^b)
            Key.CLIPPING_RANGE: float(self.modulus // 2),
            Key.TARGET_RANGE: self.modulus,
            Key.MOD_RANGE: self.modulus,
            Key.MAX_WEIGHT: 1.0,
            MASK_GENERATOR_KEY: MASK_GENERATOR,
        }
        replies = self._confirmed(self._exchange({nid: ConfigRecord(dict(setup)) for nid in self.nodes}))
        for nid, configs in replies.items():
            self.public_keys[nid] = [
                cast(bytes, configs[Key.PUBLIC_KEY_1]),
                cast(bytes, configs[Key.PUBLIC_KEY_2]),
            ]
        active = set(replies)
        self._check(active, "setup")

        def share_keys(nid: int) -> ConfigRecord:
            record = ConfigRecord({str(n): self.public_keys[n] for n in self.neighbours[nid] & active})
            record[Key.STAGE] = Stage.SHARE_KEYS
            return record

        replies = self._exchange({nid: share_keys(nid) for nid in sorted(active)})
        self.keyed = set(replies)
        self.forward = {nid: ([], []) for nid in self.keyed}
        for src, configs in sorted(replies.items()):
            destinations = cast(list[int], configs[Key.DESTINATION_LIST])
            ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
            for dst, ciphertext in zip(destinations, ciphertexts, strict=True):
                if dst in self.forward:
                    self.forward[dst][0].append(src)
                    self.forward[dst][1].append(ciphertext)
        self._check(self.keyed, "share keys")
        return set(self.keyed)

    def _confirmed(self, replies: dict[int, ConfigRecord]) -> dict[int, ConfigRecord]:
        """The setup replies that confirm dpfl's mask generator; the others are refused (:attr:`refused`)."""
        for nid, configs in replies.items():
            confirmed = configs.get(MASK_GENERATOR_KEY)
            if confirmed != MASK_GENERATOR:
                self.refused[nid] = (
                    f"its SecAgg+ mod did not confirm the mask generator {MASK_GENERATOR!r} (it answered "
                    f"{confirmed!r}: a device running Flower's own secaggplus_mod, whose masks come from "
                    "32-bit seeds, or an older dpfl): refused"
                )
        if self.refused:
            log(
                ERROR,
                "SecAgg+ setup: %d node(s) refused: %s",
                len(self.refused),
                next(iter(self.refused.values())),
            )
        return {nid: configs for nid, configs in replies.items() if nid not in self.refused}

    # ------------------------------------------------------------------ stage 2

    def collect_messages(self, content_for: Callable[[int], RecordDict]) -> list[Message]:
        """Stage 2's messages: each keyed node's train content plus the shares forwarded to it."""
        messages = []
        for nid in sorted(self.keyed):
            sources, ciphertexts = self.forward[nid]
            content = content_for(nid)
            content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
                {
                    Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                    Key.CIPHERTEXT_LIST: ciphertexts,
                    Key.SOURCE_LIST: sources,
                }
            )
            messages.append(
                Message(content=content, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=self.group)
            )
        self.forward = {}
        return messages

    def masked_sum(self, uploads: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
        """The sum mod ``2^b`` of the masked uploads (what the server can compute before stage 4)."""
        total: list[np.ndarray] | None = None
        for nid in sorted(uploads):
            arrays = [np.asarray(a, dtype=np.int64) for a in uploads[nid]]
            total = arrays if total is None else [t + a for t, a in zip(total, arrays, strict=True)]
            total = [np.mod(t, self.modulus) for t in total]
        if total is None:
            raise SecAggAbortedError("no masked vector arrived")
        return total

    # ------------------------------------------------------------------ stage 3

    def unmask(
        self, masked_total: list[np.ndarray], survivors: set[int], *, charge: Callable[[], None]
    ) -> list[np.ndarray]:
        """Stage 4: remove the survivors' private masks and the dropped clients' pairwise masks.

        Parameters
        ----------
        masked_total : list[np.ndarray]
            The modular sum of the survivors' masked vectors.
        survivors : set[int]
            The nodes whose masked vectors are in ``masked_total``.
        charge : Callable[[], None]
            Called once, right before the unmask requests go out (and only if they do): from then on
            the replies may open a sum, whether or not this stage completes (module docstring).

        Returns
        -------
        list[np.ndarray]
            The sum of the survivors' unmasked vectors mod ``2^b``.

        Raises
        ------
        SecAggAbortedError
            Before the requests, when the survivors fail the checks; after them, when too few shares
            came back to rebuild a secret (the round was charged all the same).

        """
        self._check(survivors, "collect masked vectors")
        self.check_parts(survivors)
        dead = self.keyed - survivors

        def request(nid: int) -> ConfigRecord:
            return ConfigRecord(
                {
                    Key.STAGE: Stage.UNMASK,
                    Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[nid] & survivors),
                    Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[nid] & dead),
                }
            )

        charge()
        replies = self._exchange({nid: request(nid) for nid in sorted(survivors)})
        collected: dict[int, list[bytes]] = {nid: [] for nid in survivors | dead}
        for configs in replies.values():
            owners = cast(list[int], configs[Key.NODE_ID_LIST])
            shares = cast(list[bytes], configs[Key.SHARE_LIST])
            for owner, share in zip(owners, shares, strict=True):
                if owner in collected:
                    collected[owner].append(share)
        return self._remove_masks(masked_total, survivors, collected)

    def _remove_masks(
        self, masked_total: list[np.ndarray], survivors: set[int], collected: dict[int, list[bytes]]
    ) -> list[np.ndarray]:
        """Rebuild each secret from its ``collected`` shares and remove its masks from ``masked_total``."""
        shapes = [a.shape for a in masked_total]
        total = [a.copy() for a in masked_total]
        for nid, shares in sorted(collected.items()):
            if len(shares) < self.threshold:
                raise SecAggAbortedError(
                    f"too few shares ({len(shares)} < {self.threshold}) to unmask a client"
                )
            secret = combine_shares(shares)
            if nid in survivors:
                mask = mask_arrays(secret, self.modulus, shapes)
                total = [t - m for t, m in zip(total, mask, strict=True)]
                continue
            for other in sorted((self.neighbours[nid] - {nid}) & survivors):
                shared = generate_shared_key(
                    bytes_to_private_key(secret), bytes_to_public_key(self.public_keys[other][0])
                )
                mask = mask_arrays(shared, self.modulus, shapes)
                sign = 1 if nid > other else -1
                total = [t + sign * m for t, m in zip(total, mask, strict=True)]
        return [np.mod(t, self.modulus) for t in total]

    def parts(self, survivors: set[int]) -> list[set[int]]:
        """The survivors' neighbour graph's connected parts, largest first (each part's sum is unmaskable)."""
        left, parts = set(survivors), []
        while left:
            part, frontier = set(), [min(left)]
            while frontier:
                nid = frontier.pop()
                if nid in part:
                    continue
                part.add(nid)
                frontier.extend((self.neighbours[nid] & left) - part)
            left -= part
            parts.append(part)
        return sorted(parts, key=lambda part: (-len(part), min(part)))

    def check_parts(self, survivors: set[int]) -> list[set[int]]:
        """The parts of :meth:`parts`; :class:`SecAggAbortedError` when one holds fewer than ``min_sum``."""
        parts = self.parts(survivors)
        if len(parts[-1]) < self.min_sum:
            sizes = " + ".join(str(len(part)) for part in parts)
            raise SecAggAbortedError(
                f"the survivors' neighbour graph falls into {len(parts)} parts ({sizes} clients) with no "
                f"mask between them: unmasking would reveal the sum of {len(parts[-1])}, fewer than the "
                f"{self.min_sum} the noise is calibrated for"
            )
        return parts

    # ------------------------------------------------------------------ helpers

    def _exchange(self, records: dict[int, ConfigRecord]) -> dict[int, ConfigRecord]:
        """Send one stage's config records; return the replies' records by node (errors left out)."""
        messages = [
            Message(
                content=RecordDict({RECORD_KEY_CONFIGS: record}),
                dst_node_id=nid,
                message_type=MessageType.TRAIN,
                group_id=self.group,
            )
            for nid, record in records.items()
        ]
        replies: dict[int, ConfigRecord] = {}
        for reply in self.send(messages):
            if not reply.has_error():
                replies[int(reply.metadata.src_node_id)] = reply.content.config_records[RECORD_KEY_CONFIGS]
        return replies

    def _check(self, active: set[int], stage: str) -> None:
        """Every client still in the protocol needs ``threshold`` active neighbours (as Flower checks).

        Before key sharing that is every client of the cohort; after it, the ones that shared keys
        (a client that left earlier holds and owes no shares).
        """
        refused = (
            f" ({len(self.refused)} of {len(self.nodes)} refused: {next(iter(self.refused.values()))})"
            if self.refused
            else ""
        )
        for nid in sorted(self.keyed) or self.nodes:
            if len(self.neighbours[nid] & active) < self.threshold:
                raise SecAggAbortedError(
                    f"after the {stage} stage a client has fewer than {self.threshold} active neighbours"
                    + refused
                )
