"""``resume=<output dir>``: continue a run from its checkpoint with its own configuration.

``python -m fl_app resume=outputs/2026-11-22/10-00-00-dp_fedavg`` composes the run's configuration
from the overrides saved in its checkpoint (:mod:`fl_app.run.checkpoint`), not from today's command
line: only ``num_rounds`` (to extend a non-private run) and ``simulation.*`` (resources,
timeouts) may be given beside it. :func:`expand_resume` is applied by
:func:`fl_app.config.compose.compose_config`, so every entry point sees the same expansion.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_app.config.checks import ConfigError
from fl_app.config.overrides import override_key

if TYPE_CHECKING:
    from fl_app.config.settings import RunSettings

RESUME_KEY = "resume"
#: Keys a resumed run may change (a prefix ends with a dot).
CHANGEABLE = ("num_rounds", "simulation.", "hydra.", "hydra/")


def _value(override: str) -> str:
    return override.split("=", 1)[1] if "=" in override else ""


def resume_dir(overrides: Sequence[str]) -> Path | None:
    """The directory ``resume=`` names, or None."""
    values = [_value(o) for o in overrides if override_key(o) == RESUME_KEY]
    if not values or values[-1] in ("", "null", "None"):
        return None
    return Path(values[-1].strip("'\"")).expanduser().resolve()


def run_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that define a run, without ``resume`` and ``output_dir`` (saved in checkpoints)."""
    return [o for o in overrides if override_key(o) not in (RESUME_KEY, "output_dir")]


def checkpoint_overrides(overrides: Sequence[str]) -> list[str]:
    """What a run's checkpoint saves: the overrides its configuration was composed from.

    For a resumed run that is its checkpoint's overrides plus the allowed changes
    (:func:`expand_resume`), not ``resume=DIR`` alone: saving only that made a second ``resume=``
    of the same directory compose the defaults and refuse ("the configuration files changed").
    """
    return run_overrides(expand_resume(overrides))


def expand_resume(overrides: Sequence[str]) -> list[str]:
    """``overrides`` as given, or, with ``resume=DIR``, the checkpoint's overrides plus the allowed changes.

    Raises
    ------
    fl_app.config.validation.ConfigError
        When ``DIR`` holds no readable checkpoint, or another key is given beside ``resume``.

    """
    directory = resume_dir(overrides)
    if directory is None:
        return list(overrides)
    from fl_app.run.checkpoint import read_header

    given = [o for o in overrides if override_key(o) != RESUME_KEY]
    refused = [o for o in given if not override_key(o).startswith(CHANGEABLE)]
    if refused:
        raise ConfigError(
            RESUME_KEY,
            str(directory),
            f"only num_rounds and simulation.* may be given beside resume (got {' '.join(refused)}): "
            "a resumed run keeps the configuration saved in its checkpoint",
        )
    if not directory.is_dir():
        what = "is a file, not a run's output directory" if directory.exists() else "no such directory"
        raise ConfigError(RESUME_KEY, str(directory), what)
    try:
        header = read_header(directory)
    except FileNotFoundError:
        raise ConfigError(RESUME_KEY, str(directory), no_checkpoint_text(directory)) from None
    except (OSError, ValueError) as error:
        raise ConfigError(RESUME_KEY, str(directory), " ".join(str(error).split())) from None
    missing_plugin(header.get("plugin"), directory)
    saved = [o for o in header["overrides"] if override_key(o) not in (RESUME_KEY, "output_dir")]
    return [*saved, *given, f"output_dir={directory}", f"{RESUME_KEY}={directory}"]


def missing_plugin(plugin: dict[str, Any] | None, directory: Path) -> None:
    """Refuse to resume a plug-in's run in a process that has not imported the plug-in's module.

    ``plugin``: the checkpoint header's (:func:`fl_app.run.checkpoint.plugin_of`). Raises
    :class:`~fl_app.config.checks.ConfigError`, one line naming the module and ``DPFL_PLUGINS``.
    """
    import sys

    from fl_app.config.registry import PLUGINS_ENV

    if not plugin or plugin["module"] in sys.modules:  # loaded (DPFL_PLUGINS, imported before this)
        return
    modules = ",".join(plugin["modules"]) or plugin["module"]
    raise ConfigError(
        "strategy",
        plugin["strategy"],
        f"is in the plugin module {plugin['module']} that the run in {directory} loaded: set "
        f"{PLUGINS_ENV}={modules} to resume it",
    )


def no_checkpoint_text(directory: Path) -> str:
    """Why ``directory``, which has no checkpoint, cannot be resumed: what it holds, and what to do."""
    from fl_app.run.output_claim import LOCK_FILE, earlier_run_files, ended_before_first_round, read_results

    if ended_before_first_round(directory):
        return (
            "holds no private_server_state.pkl (checkpoint): the run there ended before its first round, "
            f"nothing to continue; start the run again (output_dir={directory} reuses the directory)"
        )
    status = (read_results(directory) or {}).get("status")
    if status is not None and str(status).startswith("completed"):
        return (
            f"holds no private_server_state.pkl (checkpoint): the run there {status} (a private run that "
            "completes removes its checkpoint: it cannot be extended); start a new run"
        )
    if not earlier_run_files(directory) and (directory / LOCK_FILE).exists():  # claimed, nothing written
        return (
            "holds no private_server_state.pkl (checkpoint) and no run's files: a run stopped there "
            f"before it began, nothing to continue; start it again (output_dir={directory} reuses the folder)"
        )
    if not earlier_run_files(directory):
        return "holds no private_server_state.pkl (checkpoint): it is not the output directory of a dpfl run"
    return (
        "holds no private_server_state.pkl (checkpoint): the run there cannot be continued; start a new run"
    )


def validate_resume(settings: RunSettings, *, is_private: bool) -> None:
    """Check a resumed configuration against its checkpoint (rounds, the experiment's fingerprint).

    ``num_rounds`` equal to the rounds completed finishes the run: a run stopped after its last
    round's checkpoint but before its results were written gets them (nothing is trained).

    Parameters
    ----------
    settings : RunSettings
        The typed settings of the composed configuration (with ``resume`` set); the checkpoint holds
        the fingerprint of their experiment (:meth:`~fl_app.config.settings.RunSettings.fingerprint`).
    is_private : bool
        Whether the strategy claims a finite epsilon: its noise was calibrated for the
        planned ``num_rounds``, so a private run cannot be extended.

    """
    from fl_app.run.checkpoint import read_header

    directory = Path(str(settings.resume))
    header = read_header(directory)
    done = int(header["completed_round"])
    rounds = settings.num_rounds
    planned = int(header["num_rounds"])
    if settings.fingerprint(ignore=("num_rounds",)) != header["fingerprint"]:
        raise ConfigError(
            RESUME_KEY,
            str(directory),
            "its saved overrides compose another experiment now (the configuration files, conf/, or "
            "dpfl changed since this run started): it cannot be continued; start a new run",
        )
    if rounds < done:
        raise ConfigError(
            "num_rounds",
            rounds,
            f"must be >= {done}: the run in {directory} already completed {done} rounds",
        )
    if is_private and rounds != planned:
        raise ConfigError(
            "num_rounds",
            rounds,
            f"must stay {planned} when resuming a private run: its noise was calibrated for "
            f"privacy.epsilon over {planned} rounds; more rounds would spend more; start a new run",
        )
