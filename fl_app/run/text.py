"""What a run says on the console and in ``run.log``: its round lines, its last line, numbers as text."""

from __future__ import annotations

import datetime as dt
import math
import sys
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from fl_app.run.checkpoint import CHECKPOINT_FILE
from fl_app.run.lifecycle import DIVERGENCE_FACTOR
from strategies.contract import Strategy


def epsilon_text(epsilon: float | None, delta: float, *, per: str = "", note: str = "") -> str:
    """``epsilon 3.911 per client in total (delta 1e-05; note)``, or ``not private``."""
    if epsilon is None:
        return "not private"
    unit = f" per {per} in total" if per else ""
    return f"epsilon {fmt(epsilon)}{unit} (delta {delta:g}{'; ' + note if note else ''})"


def fmt(value: float | None, missing: str = "-") -> str:
    """A number in 4 significant digits; ``missing`` for None; a NaN loss said as such."""
    if value is None:
        return missing
    if isinstance(value, float) and math.isnan(value):
        return "nan (diverged?)"  # a NaN loss: the model broke (lr, noise, clipping); said at once
    return f"{value:.4g}"


def accuracy_text(accuracy: float | None, loss: float | None) -> str:
    """An accuracy as :func:`fmt` says it; a NaN beside a finite loss is no counted target, not divergence.

    A next-token evaluation counts no target when every test target is one its accuracy leaves out
    (unknown or end of sentence: a vocabulary of no words), and its accuracy is then NaN.
    """
    nan = isinstance(accuracy, float) and math.isnan(accuracy)
    if nan and loss is not None and not math.isnan(loss):
        return "- (no target counted)"
    return fmt(accuracy)


def progress_bar(done: int, total: int, *, width: int = 20) -> str:
    """``[########------------]``: ``done`` of ``total`` as a bar of ``width`` cells."""
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def interactive() -> bool:
    """Whether a person watches the output (stderr is a terminal): then progress lines carry a bar."""
    return sys.stderr.isatty()


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a duration in seconds."""
    return str(dt.timedelta(seconds=round(seconds)))


def finished_line(results: dict[str, Any], privacy: str, output_dir: Path, failures: str) -> str:
    """The last line of a completed run (``failures``: what to say about failed clients, or "")."""
    final = results["final"]
    best = (
        f" (best {fmt(final['best_accuracy'])} in round {final['best_round']})"
        if final["best_round"] is not None
        else " (no round gave an accuracy)"
    )
    return (
        f"dpfl: finished {len(results['rounds'])} rounds in {format_duration(final['wall_s'])}{failures}; "
        f"final accuracy {fmt(final['accuracy'])}{best}, {privacy}; results in {output_dir}"
    )


def silent_text(clients: list[int], selected: Mapping[int, int]) -> str:
    """Which clients failed in every round they were selected for (``ClientTally.never_contributed``)."""
    shown = ", ".join(f"{c} ({selected[c]} of {selected[c]})" for c in clients[:5])
    more = f" and {len(clients) - 5} more" if len(clients) > 5 else ""
    return (
        f"client {shown}{more} failed in every round it was selected for: its data never reached the "
        "model (its error: the lines above)"
    )


def resume_text(completed_round: int, num_rounds: int, output_dir: Path) -> str:
    """What a resumed run says first: the rounds it continues after, or that it only writes the results."""
    if completed_round >= num_rounds:
        return (
            f"finishing the run in {output_dir}: its {completed_round} rounds are done (it stopped before "
            "its results were written); writing them"
        )
    return f"resuming after round {completed_round} from {output_dir}"


def warn_if_diverged(results: dict[str, Any]) -> None:
    """A WARNING line when the run diverged (``final.diverged``): its accuracy says little then."""
    final = results["final"]
    if final.get("diverged"):
        log(
            WARNING,
            "dpfl: this run diverged: final loss %s against %s for the initial model (more than %gx); "
            "its accuracy (chance level %s) describes a broken model: lower lr or the noise, or "
            "raise the clipping/budget",
            fmt(final["loss"]),
            fmt(results["initial"].get("loss")),
            DIVERGENCE_FACTOR,
            fmt(final.get("chance_accuracy")),
        )


def vocabulary_text(shortfall: tuple[int, int], model: str, parameters: tuple[int, int]) -> str:
    """The line of a word vocabulary smaller than ``dataset.vocab_size`` asked for, and its network's size.

    ``shortfall``: the words held and asked for; ``parameters``: the network's parameters with this
    vocabulary and with the one asked for.
    """
    words, asked = shortfall
    now, full = parameters
    return (
        f"dpfl: the vocabulary holds {words:,} words, fewer than dataset.vocab_size={asked}: {words + 4:,} "
        f"tokens with the special ones, so {model} has {now:,} parameters, not the {full:,} it has with "
        f"{asked + 4:,} tokens"
    )


def subset_text(subset: int, split: str, size: int, unit: str) -> str:
    """The line of an ``evaluation.test_subset`` larger than the split it samples."""
    return (
        f"dpfl: evaluation.test_subset={subset} but the {split} split holds {size:,} {unit}: evaluating on "
        "all of them"
    )


def private_state_text(strategy: Strategy, output_dir: Path, *, client_states: bool = False) -> str:
    """What the interrupt line and ``stopped.private_state`` say about the checkpoint file."""
    held = strategy.declaration.checkpoint_holds
    if client_states:
        kept = "every client's state between rounds (computed from its data, not noised)"
        held = f"{held} and {kept}" if held else kept
    return (
        f"{output_dir / CHECKPOINT_FILE} is the server's private state"
        f"{': it holds ' + held if held else ''}; readable by its owner only, never publish it; it is "
        "removed when the run completes"
    )
