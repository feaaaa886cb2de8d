"""Configuration: every option composes, both entry points compose the same config, bad input fails early."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import settings_of
from omegaconf import OmegaConf

from fl_app.__main__ import expand_jobs, preflight, split_command_line
from fl_app.config.compose import (
    CONF_DIR,
    compose_config,
    overrides_from_run_config,
    overrides_to_run_config,
)
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.examples import TEXT_DATASETS
from strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["strategy", "dataset", "partition", "privacy", "evaluation", "simulation"])
def test_every_option_of_every_group_composes_and_validates(group):
    for option in options(group):
        overrides = [f"{group}={option}"]
        if group == "dataset" and option == "mnist":
            overrides.append("dataset.data_dir=/nonexistent")
        if group == "dataset" and option == "hf":
            overrides.append("dataset.path=flwrlabs/femnist")  # required (the presets set it)
        if group == "partition" and option == "natural":
            overrides += ["dataset=femnist", "partition.column=writer_id"]  # users: only dataset=hf has them
        if group == "dataset" and option in TEXT_DATASETS:
            overrides = text_dataset_overrides(overrides)
        cfg = compose_config(overrides)
        validate_config(cfg, check_data=False)
        own = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
        missing = [key for key in own if key != "defaults" and key not in cfg[group]]
        assert not missing, f"{group}={option}: keys of the file not in the composed config: {missing}"
        if "name" in own:
            assert cfg[group].name == own.name


def refused(overrides: list[str], key: str) -> None:
    """Validating ``overrides`` fails in one line naming ``key``."""
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides), check_data=False)
    assert error.value.key == key, (overrides, str(error.value))
    assert "\n" not in str(error.value)


def text_dataset_overrides(overrides: list[str]) -> list[str]:
    """A text data set's run: its users are the clients, and it reads a file the user names.

    Each requirement is checked to be one: without ``partition=natural`` validation names
    ``partition.name``; without a path (the file conf leaves it null), ``dataset.path``.
    """
    path = ["dataset.path=/data/corpus.parquet"]
    refused([*overrides, *path], "partition.name")
    overrides = [*overrides, "partition=natural"]
    if compose_config(overrides).dataset.path is None:
        refused(overrides, "dataset.path")
        overrides += path
    return overrides


def test_every_strategy_declares_exactly_the_keys_of_its_conf_file():
    """Settings read only the fields they declare: a conf key without a field would be silently ignored."""
    import dataclasses

    from strategies import STRATEGIES
    from strategies.laplace_eval.stage import LaplaceEvalSettings

    for name in options("strategy"):
        settings = STRATEGIES.get(name).declaration.settings
        assert settings is not None, name
        declared = {field.name for field in dataclasses.fields(settings)}
        assert set(OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml")) - {"name"} == declared, name
    stage = set(OmegaConf.load(CONF_DIR / "evaluation" / "laplace_eval.yaml"))
    plain = set(OmegaConf.load(CONF_DIR / "evaluation" / "default.yaml"))
    declared = {field.name for field in dataclasses.fields(LaplaceEvalSettings)}
    assert stage - plain - {"defaults"} == declared - {"epsilon_budget"}


def _leaves(node: object, prefix: str = "") -> list[tuple[str, object]]:
    """Dotted key -> value of every scalar of a YAML file's mapping (lists as values)."""
    if not isinstance(node, dict):
        return [(prefix, node)]
    return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}{key}.")]


def test_every_experiment_preset_composes_validates_and_sets_its_values():
    for option in options("experiment"):
        cfg = compose_config([f"+experiment={option}"])
        supplied = set()  # keys the command line sets: a text preset's corpus is named by its user
        if cfg.dataset.name in TEXT_DATASETS and cfg.dataset.path is None:
            refused([f"+experiment={option}"], "dataset.path")
            cfg = compose_config([f"+experiment={option}", "dataset.path=/data/corpus.sqlite"])
            supplied.add("dataset.path")
        validate_config(cfg, check_data=False)
        own = yaml.safe_load((CONF_DIR / "experiment" / f"{option}.yaml").read_text())
        defaults = own.get("defaults", [])
        after_self = defaults.index("_self_") + 1 if "_self_" in defaults else len(defaults)
        later = set()  # keys set by an arm listed after _self_ (compare_cross_device's /cross_device: ...)
        for position, entry in enumerate(defaults):
            for target, choice in entry.items() if isinstance(entry, dict) else []:
                group = target.split()[-1].strip("/")
                if target.startswith("override"):  # override /group: option -> that option is composed
                    if group in ("strategy", "dataset", "partition") and isinstance(choice, str):
                        assert cfg[group].name == choice, (option, group)
                elif position >= after_self:  # the arm wins over the preset's own values
                    arm = yaml.safe_load((CONF_DIR / group / f"{choice}.yaml").read_text())
                    later |= {key.rstrip(".") for key, _ in _leaves(arm) if key != "defaults."}
        settings = {key: value for key, value in own.items() if key not in ("defaults", "hydra")}
        checked = 0
        for key, value in _leaves(settings):
            key = key.rstrip(".")
            if key in later | supplied or (isinstance(value, str) and "${" in value):
                continue  # set by a later arm, or a rule such as ${per_budget:...} resolved per job
            assert OmegaConf.select(cfg, key) == value, (option, key)
            checked += 1
        assert checked or not settings, option


def sweep_grid(jobs: list[list[str]]) -> set[tuple[str, ...]]:
    """The sweep's jobs as sorted override tuples, without the preset itself."""
    return {tuple(sorted(o for o in job if not o.startswith("+experiment="))) for job in jobs}


def budget_seed_grid(arm_key: str, arms: set[str]) -> set[tuple[str, ...]]:
    """Every arm at total epsilon 1, 2, 4, 8 and seeds 1, 2, 3."""
    return {
        tuple(sorted((f"{arm_key}={a}", f"privacy.epsilon={e}", f"seed={s}")))
        for a in arms
        for e in (1, 2, 4, 8)
        for s in (1, 2, 3)
    }


def test_compare_all_sweeps_every_arm_at_four_budgets_and_three_seeds():
    """Every ``conf/comparison`` arm but the non-private reference is swept; every job validates;
    each arm's strategy, and the DP arms' equal-budget settings, are what the job runs."""
    from fl_app.__main__ import expand_jobs

    jobs = expand_jobs(["+experiment=compare_all"], multirun=True)
    # the algorithms that declare an arm in it (the client-level baselines only make sense in the
    # cross-device regime, docs/algorithms/client_level_baselines.md, docs/algorithms/distributed_dp.md,
    # not in this N = 20 demo)
    declared = {n for n in STRATEGIES.names() if "comparison" in STRATEGIES.get(n).declaration.comparisons}
    assert declared == set(options("comparison"))
    arms = set(options("comparison")) - {"fedavg"}
    assert sweep_grid(jobs) == budget_seed_grid("+comparison", arms)
    for job in (j for j in jobs if "seed=1" in j):  # composing is slow: the seed changes nothing else
        cfg = compose_config(job)
        validate_config(cfg, check_data=False)
        arm = next(o.split("=", 1)[1] for o in job if o.startswith("+comparison="))
        assert cfg.strategy.name == arm
        assert (cfg.dataset.name, cfg.partition.name, cfg.partition.alpha) == (
            "fashion_mnist",
            "dirichlet",
            0.5,
        )
        assert cfg.model == ("auto" if arm == "dpfl_bnn" else "mlp")
    assert (
        compose_config(["+experiment=compare_all", "+comparison=nbafl"]).strategy.calibration == "accountant"
    )
    reference = expand_jobs(
        ["+experiment=compare_all", "+comparison=fedavg", "privacy.epsilon=8"], multirun=True
    )
    assert [compose_config(j).strategy.name for j in reference] == ["fedavg"] * 3


def test_nbafl_n50_preset_is_the_documents_epsilon_sweep():
    from fl_app.__main__ import expand_jobs

    jobs = expand_jobs(["+experiment=nbafl_n50"], multirun=True)
    configs = [compose_config(j) for j in jobs]
    assert sorted(c.privacy.epsilon for c in configs) == [5, 10, 20, 50, 60, 100]
    for cfg in configs:
        assert (cfg.strategy.name, cfg.num_clients, cfg.num_rounds, cfg.privacy.delta) == (
            "nbafl",
            50,
            25,
            0.01,
        )


def test_every_registered_strategy_has_a_config_and_a_client():
    from clients import CLIENTS

    assert set(STRATEGIES.names()) <= set(options("strategy"))
    for name in STRATEGIES.names():
        cfg = compose_config([f"strategy={name}"])
        assert cfg.strategy.name == name
        assert STRATEGIES.get(name).declaration.client in CLIENTS.names()


def test_flwr_run_config_round_trip_equals_direct_composition():
    overrides = [
        "strategy=dp_fedavg",
        "privacy.epsilon=4",
        "dataset=digits",
        "partition=iid",
        "num_clients=20",
        "hydra.run.dir=/tmp/ignored",
        "lr=0.1",
    ]
    run_config = overrides_to_run_config(overrides, "/tmp/out")
    assert overrides_from_run_config(run_config) == overrides
    assert compose_config(overrides_from_run_config(run_config)) == compose_config(overrides)


@pytest.mark.subprocess
def test_hydra_main_and_compose_config_give_the_same_job_config():
    """What `python -m fl_app` hands its job equals what `flwr run` composes from the run config."""
    overrides = ["strategy=fedavg", "dataset=digits", "num_rounds=7", "privacy.delta=1e-6"]
    process = subprocess.run(
        [sys.executable, "-m", "fl_app", *overrides, "--cfg", "job", "--resolve"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    from_hydra = OmegaConf.create(yaml.safe_load(process.stdout))
    run_config = overrides_to_run_config(overrides, "")
    assert from_hydra == compose_config(overrides_from_run_config(run_config))


def test_multirun_expansion():
    overrides, multirun, informational = split_command_line(
        ["-m", "privacy.epsilon=1,2", "strategy=fedavg,dp_fedavg", "--config-name", "config"]
    )
    assert multirun
    assert not informational
    assert overrides == ["privacy.epsilon=1,2", "strategy=fedavg,dp_fedavg"]
    jobs = expand_jobs(overrides, multirun=True)
    assert len(jobs) == 4
    assert ["privacy.epsilon=2", "strategy=dp_fedavg"] in jobs


def test_pins_the_hydra_release_whose_internals_it_uses():
    """A Hydra upgrade must revisit fl_app/engine/hydra.py (this test names the reason)."""
    import tomllib

    from fl_app.engine import hydra as hydra_adapter

    assert hydra_adapter.hydra_version() == hydra_adapter.HYDRA_VERSION
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"hydra-core=={hydra_adapter.HYDRA_VERSION}" in pins
    # the basic sweeper's split: preset axes first, the command line wins for the same key
    jobs = hydra_adapter.sweep_jobs(["seed=1,2", "lr=0.1"], ["seed=3,4", "strategy=fedavg"])
    assert jobs == [["seed=3", "lr=0.1", "strategy=fedavg"], ["seed=4", "lr=0.1", "strategy=fedavg"]]
    fixed = hydra_adapter.sweep_fixed(["seed=1,2", "lr=0.1", "+experiment=quick"])
    assert fixed == ["lr=0.1", "+experiment=quick"]
    # nothing else imports Hydra's internals
    users = [
        path.relative_to(ROOT).as_posix()
        for folder in ("fl_app", "strategies", "clients", "scripts", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if "hydra._internal" in path.read_text() or "hydra.initialize import" in path.read_text()
    ]
    assert users == ["fl_app/engine/hydra.py"]


def test_a_multirun_composes_and_validates_each_job_once(tmp_path, monkeypatch):
    """`python -m fl_app -m`: the preflight composes and validates each job; the job runs that object."""
    import fl_app.__main__ as command
    from fl_app.config import validation
    from fl_app.engine import simulation
    from fl_app.run.lifecycle import Outcome

    composed: list[list[str]] = []
    validated: list[object] = []
    settings: list[object] = []
    ran: list[tuple[object, list[str]]] = []

    def compose(overrides):
        composed.append(list(overrides))
        return compose_config(overrides)

    def validate(cfg, **kwargs):
        validated.append(cfg)
        settings.append(validate_config(cfg, **kwargs))
        return settings[-1]

    def run(typed, overrides, output_dir):
        ran.append((typed, list(overrides)))
        return Outcome("completed", 0, "", str(output_dir))

    monkeypatch.setattr(command, "compose_config", compose)
    monkeypatch.setattr(validation, "validate_config", validate)
    monkeypatch.setattr(simulation, "run_in_simulation", run)
    monkeypatch.setattr(command, "begin_ray_early", lambda argv: None)  # no run, so no Ray either
    monkeypatch.chdir(tmp_path)
    jobs = ["strategy=fedavg", "dataset=digits", "num_clients=6", "clients_per_round=3", "seed=1,2"]
    monkeypatch.setattr(sys, "argv", ["fl_app", "-m", *jobs, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert command.main() == 0
    assert len(composed) == len(validated) == 2
    assert [typed.seed for typed, _ in ran] == [1, 2]
    for (typed, overrides), composed_for, cfg in zip(ran, composed, validated, strict=True):
        # the job's own overrides, composed by the preflight (which also saw the hydra.* ones)
        assert overrides == [item for item in composed_for if not item.startswith("hydra.")]
        assert cfg == compose_config(overrides) and OmegaConf.is_readonly(cfg)
        # the job runs the settings the preflight validated (kept across processes: equal, not the same),
        # named for its trackers within the sweep
        validated_settings = settings[ran.index((typed, overrides))]
        assert typed.tracker.run_name == f"fedavg seed {typed.seed} [job {typed.seed - 1}]"
        assert typed == dataclasses.replace(validated_settings, tracker=typed.tracker)


BAD_VALUES = [
    ("privacy.epsilon=-1", "privacy.epsilon"),
    ("privacy.epsilon=0", "privacy.epsilon"),
    ("privacy.delta=1.5", "privacy.delta"),
    ("privacy.delta=0", "privacy.delta"),
    ("partition.alpha=0", "partition.alpha"),
    ("partition=two_tier partition.large_clients=100", "partition.large_clients"),
    ("partition=two_tier partition.large_share=1", "partition.large_share"),
    ("clients_per_round=200", "clients_per_round"),
    ("clients_per_round=0", "clients_per_round"),
    ("num_clients=10.5", "num_clients"),
    ("num_rounds=abc", "num_rounds"),
    ("local_epochs=0", "local_epochs"),
    ("lr=-0.1", "lr"),
    ("strategy.name=nope", "strategy.name"),
    ("dataset.name=cifar", "dataset.name"),
    ("model=resnet", "model"),
    ("privacy.accountant=gdp", "privacy.accountant"),
    ("dataset.public_fraction=1.0", "dataset.public_fraction"),
    ("evaluation.every=0", "evaluation.every"),
    ("evaluation.split=train", "evaluation.split"),
    ("simulation.client_cpus=0", "simulation.client_cpus"),
    ("simulation.backend=threads", "simulation.backend"),
    ("simulation.backend=inline simulation.ray_address=auto", "simulation.ray_address"),
    ("simulation.backend=inline", None),
    ("privacy.secure_rng=true", None),  # fine on its own
]


@pytest.mark.parametrize(("override", "key"), BAD_VALUES)
def test_bad_values_are_named_in_one_line(override, key):
    errors = preflight(override.split())
    if key is None:
        assert errors == []
        return
    assert len(errors) == 1
    line = errors[0]
    assert "\n" not in line
    assert line.startswith(key)
    assert override.split()[-1].split("=", 1)[1] in line


@pytest.mark.parametrize("fraction", ["0", "0.5", "-0.1"])
def test_validation_fraction_out_of_range_is_named(fraction):
    errors = preflight(["evaluation.split=validation", f"evaluation.validation_fraction={fraction}"])
    assert len(errors) == 1 and errors[0].startswith(f"evaluation.validation_fraction={fraction}:")


def test_secure_rng_refuses_a_noise_seed():
    errors = preflight(["privacy.secure_rng=true", "privacy.noise_seed=3"])
    assert errors and errors[0].startswith("privacy.noise_seed=3")


def test_unknown_group_option_and_unknown_key_are_one_line():
    for override, needle in (
        ("strategy=nope", "strategy"),
        ("nonsense_key=3", "nonsense_key"),
        ("partition=zipf", "partition"),
    ):
        errors = preflight([override])
        assert len(errors) == 1 and needle in errors[0] and "\n" not in errors[0]


def test_missing_data_dir_is_reported_with_the_key():
    errors = preflight(["dataset=mnist", "dataset.data_dir=/nonexistent/mnist", "dataset.download=false"])
    assert len(errors) == 1
    assert errors[0].startswith("dataset.data_dir='/nonexistent/mnist'")
    assert "IDX" in errors[0]


def test_multirun_reports_each_bad_job():
    errors = preflight(["-m", "privacy.epsilon=1,-2,0", "strategy=dp_fedavg"])
    assert len(errors) == 2
    assert all("privacy.epsilon" in e for e in errors)


def test_config_error_names_key_value_and_allowed():
    error = ConfigError("privacy.delta", 2.0, "must be a number in (0.0, 1.0)")
    assert str(error) == "privacy.delta=2.0: must be a number in (0.0, 1.0)"


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "override",
    [
        "privacy.epsilon=-1",
        "clients_per_round=1000",
        "strategy=nope",
        "dataset=mnist dataset.data_dir=/nope dataset.download=false",
        "evaluation=laplace_eval evaluation.sensitivity=0.5",  # the stage's keys, before Ray starts
    ],
)
def test_cli_exits_2_with_one_line_and_writes_nothing(override, tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.run(
        [sys.executable, "-m", "fl_app", *override.split(), f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert process.returncode == 2, process.stderr
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in process.stderr
    assert not run_dir.exists()
    assert not (tmp_path / "outputs").exists()


def test_compare_cross_device_sweeps_each_arm_by_its_own_rule():
    """Two tables, one command each: the central arms' 120 jobs (5 arms and their untuned rows x 4
    budgets x 3 seeds) and the 36 of the arms whose epsilon holds against the server (distributed and
    local DP); each arm's rule (cohort, rounds, schedule) survives the preset's shape, every job
    validates, privacy randomness is secret, and each job has its own dir."""
    from fl_app.__main__ import expand_jobs

    central = expand_jobs(["+experiment=compare_cross_device"], multirun=True)
    untrusted_server = expand_jobs(
        ["+experiment=compare_cross_device", "cross_device=fedavg_ldp,dp_fedavg_secagg,privatekt"],
        multirun=True,
    )
    jobs = central + untrusted_server
    tuned_on_validation = {"dp_fedavg", "dp_fedavg_adaptive", "dp_ftrl", "dp_bandmf", "dp_blt"}
    untuned = {f"{arm}_untuned" for arm in tuned_on_validation}
    assert sweep_grid(central) == budget_seed_grid("cross_device", tuned_on_validation | untuned)
    assert sweep_grid(untrusted_server) == budget_seed_grid(
        "cross_device", {"fedavg_ldp", "dp_fedavg_secagg", "privatekt"}
    )
    rules = {}
    per_budget = {}  # dp_fedavg's rounds and local epochs, chosen per budget on the validation split
    for job in (j for j in jobs if "seed=1" in j and "cross_device=dp_fedavg" in j):
        cfg = compose_config(job)
        per_budget[cfg.privacy.epsilon] = (cfg.num_rounds, cfg.local_epochs)
    assert per_budget == {1: (30, 5), 2: (50, 5), 4: (100, 5), 8: (100, 5)}
    server_lr = {
        e: compose_config(
            ["+experiment=compare_cross_device", "cross_device=dp_fedavg_adaptive", f"privacy.epsilon={e}"]
        ).strategy.server_lr
        for e in (1, 2, 4, 8)
    }
    assert server_lr == {1: 0.1, 2: 0.1, 4: 0.3, 8: 0.3}
    arm = ["+experiment=compare_cross_device", "cross_device=dp_ftrl"]
    ftrl = {e: compose_config([*arm, f"privacy.epsilon={e}"]) for e in (1, 2, 4, 8)}
    assert {e: (c.num_rounds, c.local_epochs, c.strategy.server_lr) for e, c in ftrl.items()} == {
        1: (100, 5, 0.05),
        2: (200, 5, 0.05),
        4: (100, 5, 0.1),
        8: (200, 5, 0.1),
    }
    bandmf = {
        e: compose_config(
            ["+experiment=compare_cross_device", "cross_device=dp_bandmf", f"privacy.epsilon={e}"]
        )
        for e in (1, 2, 4, 8)
    }
    assert {(c.strategy.server_momentum, c.strategy.bands) for c in bandmf.values()} == {(0.9, "auto")}
    assert {e: (c.num_rounds, c.local_epochs, c.strategy.server_lr) for e, c in bandmf.items()} == {
        1: (100, 5, 0.05),
        2: (100, 5, 0.05),
        4: (100, 5, 0.1),
        8: (200, 5, 0.1),
    }
    arm = ["+experiment=compare_cross_device", "cross_device=dp_blt"]
    blt = {e: compose_config([*arm, f"privacy.epsilon={e}"]) for e in (1, 2, 4, 8)}
    rules_blt = {e: (c.num_rounds, c.local_epochs, c.strategy.server_lr) for e, c in blt.items()}
    assert {(c.strategy.server_momentum, c.strategy.buffers) for c in blt.values()} == {(0.9, "auto")}
    assert rules_blt == {
        1: (100, 5, 0.05),
        2: (200, 5, 0.05),
        4: (200, 5, 0.05),
        8: (200, 5, 0.1),
    }
    for job in (j for j in jobs if "seed=1" in j and "privacy.epsilon=1" in j):
        cfg = compose_config(job)
        validate_config(cfg, check_data=False)
        # PrivateKT runs its authors' network (model=auto -> privatekt_cnn) at their lr; the rest the MLP
        model = "auto" if cfg.strategy.name == "privatekt" else "mlp"
        assert (cfg.num_clients, cfg.dataset.name, cfg.partition.alpha, cfg.model) == (
            1000,
            "fashion_mnist",
            0.5,
            model,
        )
        assert cfg.privacy.secure_rng is True and cfg.privacy.delta < 1 / cfg.num_clients
        arm = next(o.split("=")[1] for o in job if o.startswith("cross_device="))
        rules[arm] = (cfg.clients_per_round, cfg.num_rounds, cfg.strategy.get("schedule"))
        # an untuned row: labelled; the preset's shape, the strategy's defaults (nothing chosen on data)
        assert cfg.label == ("untuned" if arm in untuned else None)
        if arm in untuned:
            assert (cfg.strategy.name, cfg.num_rounds, cfg.local_epochs) == (
                arm.removesuffix("_untuned"),
                200,
                1,
            )
            assert cfg.strategy.get("server_lr", 1.0) == 1.0
        if cfg.strategy.name == "privatekt":
            assert cfg.local_epochs == 5  # chosen on the validation split
            assert cfg.lr == 0.05  # the authors'
    assert rules == {
        "dp_fedavg": (100, 30, None),
        "dp_fedavg_adaptive": (100, 100, None),
        "dp_ftrl": (100, 100, None),
        "dp_bandmf": (100, 100, None),  # Poisson within public groups (strategy.bands=auto)
        "dp_blt": (100, 100, None),  # public cyclic groups of 100 (no sampling)
        "dp_fedavg_secagg": (100, 30, None),  # its balanced schedule is built in (no key)
        "fedavg_ldp": (10, 100, "balanced"),  # one report per client: the whole budget on it
        "privatekt": (10, 100, "balanced"),
        **{arm: (100, 200, None) for arm in untuned},
    }
    assert (len(central), len(untrusted_server)) == (120, 36)
    assert len({tuple(j) for j in jobs}) == len(jobs)
    reference = expand_jobs(
        ["+experiment=compare_cross_device", "cross_device=fedavg", "privacy.epsilon=8"], multirun=True
    )
    assert [compose_config(j).strategy.name for j in reference] == ["fedavg"] * 3


def test_compare_record_level_sweeps_the_record_level_arms_apart():
    """60 jobs (3 arms and 2 untuned rows x 4 budgets x 3 seeds) in the cross-device shape, every job
    validates, each budget is the accountant's total per example, and the arms' job directories differ."""
    from fl_app.__main__ import expand_jobs

    jobs = expand_jobs(["+experiment=compare_record_level"], multirun=True)
    arms = {"kd_dp", "kd_dp_untuned", "fed_dp_sgd", "fed_dp_sgd_untuned", "nbafl"}
    assert sweep_grid(jobs) == budget_seed_grid("record_level", arms)
    seen, rounds = {}, {}
    for job in (j for j in jobs if "seed=1" in j):
        cfg = compose_config(job)
        validate_config(cfg, check_data=False)
        assert (cfg.num_clients, cfg.dataset.name, cfg.partition.alpha, cfg.model, cfg.batch_size) == (
            1000,
            "fashion_mnist",
            0.5,
            "mlp",
            32,
        )
        assert cfg.privacy.secure_rng is True and cfg.privacy.delta < 1 / cfg.num_clients
        arm = next(o.split("=")[1] for o in job if o.startswith("record_level="))
        strategy = cfg.strategy
        rounds[(arm, cfg.privacy.epsilon)] = cfg.num_rounds
        seen[(arm, cfg.privacy.epsilon)] = (
            strategy.name,
            strategy.get("teacher_rounds"),
            strategy.get("epsilon_special"),
            strategy.get("calibration"),
            cfg.lr,
        )
    chosen_lr = {1: 0.3, 2: 1.0, 4: 3.0, 8: 1.0}  # on validation (the arm's rule overrides the preset's 0.1)
    for epsilon in (1, 2, 4, 8):
        # no teacher, no labels
        assert seen[("fed_dp_sgd", epsilon)] == ("kd_dp", 0, None, None, chosen_lr[epsilon])
        assert rounds[("fed_dp_sgd", epsilon)] == (200 if epsilon == 8 else 50)
        assert rounds[("kd_dp", epsilon)] == rounds[("nbafl", epsilon)] == 50
        assert seen[("kd_dp", epsilon)] == ("kd_dp", None, epsilon / 2, None, 0.3)  # the total stays epsilon
        assert seen[("nbafl", epsilon)] == ("nbafl", None, None, "accountant", 0.1)  # equal, composed budget
        # untuned: the preset's lr 0.1 and 50 rounds, the arms' strategy settings unchanged
        assert seen[("fed_dp_sgd_untuned", epsilon)] == ("kd_dp", 0, None, None, 0.1)
        assert seen[("kd_dp_untuned", epsilon)] == ("kd_dp", None, epsilon / 2, None, 0.1)
        assert rounds[("fed_dp_sgd_untuned", epsilon)] == rounds[("kd_dp_untuned", epsilon)] == 50


def test_declared_settings_read_check_and_name_the_key():
    """strategies.settings: each field's check names its key; optional fields take null; cross-key check."""
    from dataclasses import dataclass

    from strategies.settings import StrategySettings, between, integer, names, one_of, positive

    @dataclass(frozen=True)
    class Example(StrategySettings):
        budget_scopes = ("total",)
        clip: float = positive()
        k: int | None = integer(minimum=1, optional=True)
        beta: float = between(0.0, 1.0, high_open=True)
        mode: str = one_of(("a", "b"))
        kinds: tuple[str, ...] = names(("x", "y"))

        def check(self, run):
            if self.mode == "b" and self.k is None:
                raise ConfigError("strategy.k", None, "must be set with strategy.mode=b")

    def cfg(**strategy):
        values = {"clip": 1, "k": None, "beta": 0.5, "mode": "a", "kinds": "x", **strategy}
        return OmegaConf.create({"strategy": values, "privacy": {"budget_scope": "total"}})

    run = settings_of(["dataset=digits"])  # the run's typed settings, which a cross-key check sees
    settings = Example.from_config(cfg(kinds=["x", "y"]), run)
    assert settings == Example(clip=1.0, k=None, beta=0.5, mode="a", kinds=("x", "y"))
    assert isinstance(settings.clip, float)
    for bad, key in [
        ({"clip": 0}, "strategy.clip"),
        ({"k": 0}, "strategy.k"),
        ({"k": 1.5}, "strategy.k"),
        ({"beta": 1.0}, "strategy.beta"),
        ({"mode": "c"}, "strategy.mode"),
        ({"kinds": []}, "strategy.kinds"),
        ({"kinds": ["x", "z"]}, "strategy.kinds"),
        ({"mode": "b"}, "strategy.k"),
    ]:
        with pytest.raises(ConfigError) as error:
            Example.from_config(cfg(**bad), run)
        assert error.value.key == key, bad
    per_round = cfg()
    per_round.privacy.budget_scope = "per_round"
    with pytest.raises(ConfigError) as error:
        Example.from_config(per_round, run)
    assert error.value.key == "privacy.budget_scope"
    incomplete = cfg()
    del incomplete.strategy["beta"]
    with pytest.raises(ConfigError) as error:
        Example.from_config(incomplete, run)
    assert error.value.key == "strategy.beta"


def test_per_budget_picks_the_setting_tuned_for_the_largest_budget_not_above_epsilon():
    from fl_app.config.compose import per_budget

    table = "1:30, 2:50, 4:100, 8:200"
    assert [per_budget(e, table) for e in (0.5, 1, 1.5, 2, 3.9, 4, 8, 16)] == [
        30,
        30,
        30,
        50,
        50,
        100,
        200,
        200,
    ]
    assert per_budget(2, "1:0.1 2:0.3") == 0.3 and isinstance(per_budget(2, "1:1 2:3"), int)
    with pytest.raises(ValueError):
        per_budget(1, "")


def test_validation_reads_the_configuration_once_into_typed_settings() -> None:
    """``validate_config`` returns the run's typed settings: the run-wide keys, the data split, the
    algorithm's settings and the stage's; nothing after it reads the composed configuration
    (``tests/test_repository.py`` checks the code for raw reads)."""
    from fl_app.config.settings import RunSettings
    from fl_app.config.validation import typed_settings
    from strategies.dp_ftrl import DPFTRLSettings
    from strategies.laplace_eval.stage import LaplaceEvalSettings

    cfg = compose_config(["strategy=dp_ftrl", "dataset=digits", "lr=0.5", "strategy.clip=3"])
    settings = validate_config(cfg, check_data=False)
    assert isinstance(settings, RunSettings) and settings.lr == 0.5 and settings.dataset == "digits"
    assert isinstance(settings.strategy_settings, DPFTRLSettings) and settings.strategy_settings.clip == 3.0
    assert settings.data.dataset["name"] == "digits" and settings.data.num_clients == settings.num_clients
    assert settings.config["strategy"]["clip"] == 3.0 and settings.stage_settings is None
    staged = typed_settings(compose_config(["dataset=digits", "evaluation=laplace_eval"]))
    assert isinstance(staged.stage_settings, LaplaceEvalSettings)
    # a value changed after validation changes the typed field and the published echo alike
    secure = settings.with_values({"privacy.secure_rng": True, "privacy.noise_seed": None})
    assert secure.privacy.secure_rng and secure.config["privacy"]["secure_rng"] is True
    assert secure.strategy_settings is settings.strategy_settings and not settings.privacy.secure_rng
    bad = compose_config(["strategy=dp_ftrl", "dataset=digits", "strategy.clip=-1"])
    with pytest.raises(ConfigError, match=r"strategy\.clip"):
        typed_settings(bad)
