"""One way to compose a run's configuration from ``conf/``.

``python -m fl_app key=value ...`` and ``flwr run . --run-config
'overrides="key=value ..."'`` both end in :func:`compose_config`, so the two
entry points see the identical, resolved configuration.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from fl_app.config.checks import ConfigError
from fl_app.config.conf_dir import CONF_DIR, config_groups
from fl_app.config.overrides import is_hydra_override, override_key
from fl_app.engine.hydra import compose_fresh
from fl_app.run.resume import expand_resume

CONFIG_NAME = "config"


def per_budget(epsilon: float, table: str) -> int | float:
    """A setting chosen per privacy budget: ``${per_budget:${privacy.epsilon},"1:30, 2:50, 8:200"}``.

    ``table`` lists ``budget:value`` pairs. The value is the one of the largest listed budget at or
    below ``epsilon`` (the smallest listed budget's below all of them), so a budget between two
    tuned ones gets the setting tuned for the smaller, the conservative side. Values are numbers.
    """
    pairs = []
    for item in str(table).replace(",", " ").split():
        budget, _, value = item.partition(":")
        number = float(value)
        pairs.append((float(budget), int(number) if number.is_integer() and "." not in value else number))
    if not pairs:
        raise ValueError(f"per_budget: empty table {table!r}")
    pairs.sort()
    chosen = pairs[0][1]
    for budget, value in pairs:
        if budget <= float(epsilon):
            chosen = value
    return chosen


OmegaConf.register_new_resolver("per_budget", per_budget, replace=True)

RUN_CONFIG_OVERRIDES = "overrides"
RUN_CONFIG_OUTPUT_DIR = "output-dir"


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose and resolve the run configuration from ``conf/`` and overrides.

    Parameters
    ----------
    overrides : Sequence[str]
        Hydra override strings such as ``"strategy=nbafl"`` or
        ``"privacy.epsilon=4"``. Keys of the ``hydra`` namespace are ignored:
        they steer Hydra's launcher, not the run. ``resume=DIR`` stands for the
        overrides saved in that run's checkpoint (:func:`fl_app.run.resume.expand_resume`).

    Returns
    -------
    DictConfig
        The resolved configuration, read-only, without the ``hydra`` node.

    """
    from fl_app.config.registry import load_plugins

    load_plugins()  # a user's algorithm stores its strategy config when imported (DPFL_PLUGINS)
    run_overrides = [item for item in expand_resume(overrides) if not is_hydra_override(item)]
    try:
        maybe_quick = any(selects_quick(item) for item in run_overrides)  # +experiment=quick
        cfg = _compose(run_overrides, with_hydra=maybe_quick)
        quick = quick_example_overrides(cfg) if maybe_quick else []
        if quick:  # the example's settings first: the command line wins over them
            run_overrides = [*quick, *run_overrides]
            cfg = _compose(run_overrides)
    except HydraException as error:
        raise explain_composition_error(error, run_overrides) from None
    added = [item for item in run_overrides if _adds_key(item)]
    if added:
        schema = _compose([item for item in run_overrides if item not in added])
        for item in added:
            key = override_key(item)
            if OmegaConf.select(schema, key, default=_MISSING) is _MISSING and not _in_open_mapping(
                key, schema
            ):
                raise unknown_key(key, schema, given=item)
    return freeze(cfg)


_MISSING = object()


def selects_quick(item: str) -> bool:
    """Whether an override may select the quick example (``+experiment=quick``, ``example=quick``).

    Only the ``experiment`` and ``example`` groups are looked at: a value such as an output folder
    named ``quick`` is not a choice of the example.
    """
    key, _, value = item.partition("=")
    return key.lstrip("+~") in ("experiment", "example") and "quick" in value


def quick_example_overrides(cfg: DictConfig) -> list[str]:
    """The chosen strategy's quick example (its declaration's), when ``example=quick`` is selected.

    ``+experiment=quick`` selects the ``quick`` example; each algorithm declares its own shape and
    budget (:class:`strategies.contract.QuickExample`), which go before the command line's overrides.
    """
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if choices is None or choices.get("example") != "quick":
        return []
    from strategies import STRATEGIES

    name = str(cfg.strategy.name)
    try:
        quick = STRATEGIES.get(name).declaration.quick
    except KeyError:
        return []  # an unknown strategy: validation names it in one line
    return list(quick.overrides) if quick is not None else []


def _compose(overrides: Sequence[str], *, with_hydra: bool = False) -> DictConfig:
    return compose_fresh(CONF_DIR, CONFIG_NAME, overrides, with_hydra=with_hydra)


#: Keys whose value is a free-form mapping (a Flower strategy's constructor arguments): ``+`` may add
#: keys below them (``+strategy.kwargs.eta=0.01``).
OPEN_MAPPINGS = ("kwargs",)


def _in_open_mapping(key: str, schema: DictConfig) -> bool:
    """Whether ``key`` is a mapping named in :data:`OPEN_MAPPINGS` or a key inside one.

    (``~strategy.kwargs '+strategy.kwargs={proximal_mu: 0.1}'`` gives one anew; ``+strategy.kwargs.eta=0.01``
    adds to it.)
    """
    return any(part in OPEN_MAPPINGS for part in key.split(".")[1:])


def _adds_key(item: str) -> bool:
    """A ``+key=value`` override that adds a plain key (``+group=option`` selects a group: allowed)."""
    if not item.startswith("+") or item.startswith("++"):
        return False
    return override_key(item) not in config_groups()


def dotted_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every key of ``cfg`` as a dotted path (``privacy.epsilon``), groups included."""
    keys: list[str] = []
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        keys.append(path)
        if isinstance(value, DictConfig | dict):
            keys += dotted_keys(value, f"{path}.")
    return keys


def unknown_key(key: str, cfg: DictConfig, *, given: str) -> ValueError:
    """The one-line error for a key the configuration does not have, with a did-you-mean."""
    known = [k for k in dotted_keys(cfg) if k != "hydra" and not k.startswith("hydra.")]
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "see python -m fl_app --cfg job for the keys"
    value = given.split("=", 1)[1] if "=" in given else ""
    if _in_open_mapping(key, cfg) and not given.startswith("+"):
        return ConfigError(key, value, f"a new keyword argument: add it with a +, as +{key}={value}")
    plus = "; '+' does not add keys: a run would ignore them" if given.startswith("+") else ""
    return ConfigError(key, value, f"unknown key ({hint}){plus}")


def explain_composition_error(error: Exception, overrides: Sequence[str]) -> Exception:
    """Hydra's composition errors as one line naming the key, the value and what is allowed."""
    text = " ".join(str(error).split())
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = config_groups().get(group, [])
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return ConfigError(group, option, f"unknown {group}{hint}; must be one of {', '.join(options)}")
    override = re.search(r"Could not override '([^']+)'", text)
    if override:
        key = override.group(1)
        rest = [item for item in overrides if override_key(item) != key]
        given = next((item for item in overrides if override_key(item) == key), key)
        try:
            return unknown_key(key, _compose(rest), given=given)
        except HydraException:
            pass
    return error


def sweep_params(overrides: Sequence[str] = ()) -> list[str]:
    """The ``hydra.sweeper.params`` of the composed config as override strings (``key=a,b``).

    Experiment presets declare their sweep axes there; ``python -m fl_app -m`` sweeps them (values
    given on the command line for the same key win).
    """
    cfg = _compose([item for item in overrides if not is_hydra_override(item)], with_hydra=True)
    params = cfg.hydra.sweeper.get("params") or {}
    return [f"{key}={value}" for key, value in params.items()]


def freeze(cfg: DictConfig) -> DictConfig:
    """Return a resolved, read-only copy of ``cfg`` without the ``hydra`` node."""
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    frozen = OmegaConf.create(container)
    OmegaConf.set_readonly(frozen, True)
    OmegaConf.set_struct(frozen, True)
    return frozen


def with_values(cfg: DictConfig, values: Mapping[str, Any]) -> DictConfig:
    """A frozen copy of the composed ``cfg`` with ``values`` (dotted key -> value) set, not recomposed."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in values.items():
        OmegaConf.update(copy, key, value, merge=False)
    return freeze(copy)


def overrides_to_run_config(overrides: Sequence[str], output_dir: str = "") -> dict[str, str]:
    """Encode Hydra overrides as the app's Flower run config (``[tool.flwr.app.config]``)."""
    return {
        RUN_CONFIG_OVERRIDES: shlex.join(list(overrides)),
        RUN_CONFIG_OUTPUT_DIR: output_dir,
    }


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[str]:
    """Decode the Hydra overrides carried by a Flower run config."""
    return shlex.split(str(run_config.get(RUN_CONFIG_OVERRIDES, "") or ""))
