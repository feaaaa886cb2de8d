"""What a person reads: refusals that say what is allowed, short header lines, set-up progress, documents
that match the code (the data sets, ``dpfl --help``, what a run writes, the ``flwr run`` command)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

from fl_app.cli import overview
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from strategies.reporting import SEEDED_NOTE, Randomness
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "0.0"])
def test_a_bad_clients_per_round_says_fractions_are_allowed(value):
    """``clients_per_round=0`` said "must be an integer >= 1": not that a fraction in (0, 1] is allowed."""
    with pytest.raises(ConfigError) as refused:
        validate_config(compose_config([*FAST, f"clients_per_round={value}"]), check_data=False)
    line = str(refused.value)
    assert line.startswith(f"clients_per_round={value}:") and "\n" not in line
    assert "fraction of num_clients in (0, 1]" in line and "whole number of clients >= 1" in line


def test_the_dirichlet_refusal_gives_its_numbers_without_a_warning_per_draw():
    """ "The max number of attempts (10) was reached. Please update the values of alpha", after ten
    warnings of a few thousand characters each (every client's alpha)."""
    cfg = compose_config([*FAST, "num_clients=1000", "clients_per_round=10"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError) as refused:
            validate_config(cfg)
    line = str(refused.value)
    assert "num_clients=1000" in line and "some of the 1000 clients" in line, line
    assert re.search(
        r"partition\.min_partition_size=2 of the \d+ rows \(\d+\.\d per client on average\)", line
    )
    assert "partition.alpha=0.5" in line and "partition=iid" in line
    assert [str(w.message)[:80] for w in caught if "min_partition_size" in str(w.message)] == []


def test_the_seeded_header_line_is_one_short_line_and_the_details_stay_in_the_results():
    """Every private run printed a ~450-character "privacy randomness SEEDED" line."""
    randomness = Randomness(
        secure=False,
        noise_seed=9196952117556804299,
        noise_seed_origin="derived from seed and the experiment's settings",
        devices=False,
        cohort="secret Poisson cohorts",
    )
    line = randomness.describe()
    assert "\n" not in line and len(line) <= 180, (len(line), line)
    assert line.startswith("privacy randomness SEEDED (noise seed 9196952117556804299)")
    assert "config.yaml" in line and "privacy.secure_rng=true" in line
    assert randomness.as_dict()["note"] == SEEDED_NOTE  # the whole note: results.json (and run.log)
    secure = Randomness(True, None, None, devices=False, cohort="secret Poisson cohorts").describe()
    assert "\n" not in secure and len(secure) <= 120


def test_the_command_says_it_is_starting_ray_as_soon_as_the_configuration_is_valid(monkeypatch, capsys):
    """About 50 s passed on a loaded machine before a run's first line (Ray's start, the data)."""
    from fl_app import __main__ as command
    from fl_app.engine.ray_session import SESSION

    begun = []
    monkeypatch.setattr(SESSION, "begin", lambda args, actors=None: begun.append(args))
    monkeypatch.setattr(SESSION, "keep", False)
    settings = validate_config(compose_config(FAST), check_data=False)
    begin = command.begin_ray_early(FAST)
    assert begin is not None
    begin(settings, 1)
    assert begun and capsys.readouterr().err.startswith("dpfl: starting Ray (a private instance")


def test_setup_says_what_it_does_before_each_step(tmp_path):
    """``scripts/setup.sh`` was silent for about 3.5 minutes on a fresh machine. Run here with a
    stand-in interpreter that records its calls (no network, nothing installed)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    calls = tmp_path / "calls"
    stand_in = tmp_path / "python3"
    stand_in.write_text(
        '#!/bin/sh\necho "python $*" >> "$CALLS"\n'
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p .venv/bin && cp "$0" .venv/bin/python; fi\n'
    )
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(stand_in), "CALLS": str(calls)}
    done = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("setup [")]
    assert [re.sub(r"^setup \[\d+ s\]: ", "", line).split(" ")[0] for line in said] == [
        "creating",
        "installing",
        "installing",
        "fetching",
        "done:",
    ], done.stdout
    assert "torch" in said[1] and "dpfl" in said[2] and "Fashion-MNIST" in said[3]
    assert [line.split()[1:3] for line in calls.read_text().splitlines()] == [
        ["-m", "venv"],
        ["-m", "pip"],
        ["-m", "pip"],
        ["-m", "fl_app.data.fetch"],
    ]


def test_the_readme_names_every_data_set_and_help_names_a_network_of_ones_own():
    """The README's list lacked cifar10, femnist and hf; ``dpfl --help``'s model line lacked module:Class."""
    row = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `dataset`")
    )
    for config in sorted((ROOT / "conf" / "dataset").glob("*.yaml")):
        assert f"`{config.stem}`" in row, config.stem
    model = next(line for line in overview().splitlines() if line.strip().startswith("model "))
    assert "module:Class" in model


def test_the_documents_say_only_a_private_run_writes_a_privacy_ledger(tmp_path):
    """docs/results.md said every run writes privacy_ledger.json; a non-private run writes none."""
    for document in ("docs/results.md", "README.md"):
        text = " ".join((ROOT / document).read_text().split())
        mentions = re.findall(r"[^.]*(?:privacy_ledger\.json|privacy ledger)[^.]*\.", text)
        assert mentions and all("private run" in sentence for sentence in mentions), (document, mentions)


def test_the_readmes_flwr_run_command_has_one_supernode_per_default_client():
    """``flwr run`` as the README wrote it met Flower's 2 SuperNodes with dpfl's 100 clients."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("`flwr run ."))
    supernodes = re.search(r"num-supernodes=(\d+)", command)
    assert supernodes is not None, command
    assert int(supernodes.group(1)) == compose_config([]).num_clients
