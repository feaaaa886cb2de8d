"""The budget calculator (one JSON object per command, same code path) and the generators."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import BinaryRandomizedResponse, RandomizedResponse, SampledGaussian
from fl_app.privacy.rng import RandomSource, make_generator
from fl_app.report.calculator import main
from strategies.dpfl_bnn import privacy as bnn_cal
from strategies.nbafl import privacy as nbafl_cal
from strategies.privatekt import privacy as kt_cal


def calc(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_rr_command(capsys):
    answer = calc(capsys, "rr", "--epsilon", "5", "--k", "2", "--classes", "10")
    assert answer["beta"] == kt_cal.privatekt_keep_probability(epsilon=5, k=2, num_classes=10)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_dp_fedavg_and_dp_sgd_commands_against_dp_accounting(capsys, accountant):
    """The calculator's z reaches the target in an independent dp-accounting computation (its PLD or
    RDP accountant class, not the project's code path), and a slightly smaller z would not (the search
    returns the smallest z to its tolerance). PLD is the default."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    def oracle(z: float, q: float, count: int) -> float:
        book = PLDAccountant(value_discretization_interval=0.001) if accountant == "pld" else RdpAccountant()
        book.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), count)
        return book.get_epsilon(1e-5)

    chosen = [] if accountant == "pld" else ["--accountant", "rdp"]  # pld: the default
    fedavg = calc(
        capsys, "dp-fedavg", "--epsilon", "8", "--delta", "1e-5", "--rate", "0.1", "--rounds", "100", *chosen
    )
    sgd = calc(
        capsys, "dp-sgd", "--epsilon", "1", "--delta", "1e-5", "--rate", "0.01", "--steps", "1000", *chosen
    )
    for answer, target, q, count in ((fedavg, 8.0, 0.1, 100), (sgd, 1.0, 0.01, 1000)):
        z = answer["noise_multiplier"]
        assert answer["accountant"] == accountant
        assert oracle(z, q, count) <= target * (1 + 1e-6)
        assert oracle(z * 0.995, q, count) > target
        assert answer["epsilon"] == pytest.approx(oracle(z, q, count), rel=1e-3)
    if accountant == "pld":  # PLD's gain: q = 0.1, 100 rounds, epsilon 8 -> 0.936, not RDP's 0.994
        assert fedavg["noise_multiplier"] == pytest.approx(0.936, abs=1e-3)


def test_calculator_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert ":mod:" not in text and "``" not in text
    assert "dp-fedavg" in text and "dp-sgd" in text


def test_bnn_command_both_directions(capsys):
    # The document's per-coordinate reading, by name (it used to be the default).
    gamma = calc(capsys, "bnn", "--epsilon", "2", "--delta", "1e-5", "--rounds", "100", "--per-coordinate")[
        "gamma"
    ]
    assert gamma == bnn_cal.bnn_gamma(epsilon=2, delta=1e-5, rounds=100)
    back = calc(
        capsys, "bnn", "--gamma", str(gamma), "--delta", "1e-5", "--rounds", "100", "--per-coordinate"
    )["epsilon"]
    assert back == pytest.approx(2.0, rel=1e-6)
    per_upload = calc(capsys, "bnn", "--gamma", "0.1", "--delta", "1e-5", "--rounds", "10", "--bits", "1000")[
        "epsilon"
    ]
    assert per_upload == compose_epsilon({BinaryRandomizedResponse(0.1): 10_000}, delta=1e-5).epsilon


def test_nbafl_command(capsys):
    answer = calc(
        capsys,
        "nbafl",
        "--epsilon",
        "0.5",
        "--delta",
        "0.01",
        "--clip",
        "1",
        "--m",
        "100",
        "--l",
        "1",
        "--t",
        "7",
        "--n",
        "50",
    )
    # the defaults: client unit (sensitivity 2C), the accountant's calibration
    assert answer["sigma_up"] == nbafl_cal.nbafl_uplink_sigma(
        epsilon=0.5, delta=0.01, clip=1.0, min_dataset_size=100, exposures=1, calibration="accountant",
        method="pld", unit="client",
    )  # fmt: skip
    assert answer["sigma_down"] == 0.0  # T = 7 <= L sqrt(N) = 7.07
    assert "warning" not in answer
    loose = calc(
        capsys,
        "nbafl",
        "--epsilon",
        "50",
        "--delta",
        "0.01",
        "--clip",
        "1",
        "--m",
        "100",
        "--l",
        "10",
        "--t",
        "100",
        "--n",
        "50",
        "--calibration",
        "classic",
    )
    assert "epsilon < 1" in loose["warning"]


def test_laplace_command(capsys):
    assert calc(capsys, "laplace", "--epsilon", "4", "--sensitivity", "2")["scale"] == 0.5
    document = calc(capsys, "laplace", "--tau", "1e-5", "--prob", "0.9", "--sensitivity", "1")
    assert document["epsilon"] == pytest.approx(math.log(10) / 1e-5)
    assert document["epsilon"] == pytest.approx(2.3026e5, rel=1e-4)
    correct = calc(capsys, "laplace", "--tau", "1e-5", "--prob", "0.9")
    assert correct["epsilon"] == pytest.approx(2 * document["epsilon"])


def test_compose_command_matches_library(capsys):
    rr = calc(
        capsys,
        "compose",
        "--mechanism",
        "rr",
        "--epsilon",
        "2.5",
        "--classes",
        "10",
        "--count",
        "100",
        "--delta",
        "1e-5",
    )
    library = compose_epsilon({RandomizedResponse(2.5, 10): 100}, delta=1e-5, method="pld")
    assert rr["epsilon_rdp"] == library.rdp
    assert rr["epsilon_pld"] == library.pld
    assert rr["epsilon_basic"] == 250.0
    gauss = calc(
        capsys,
        "compose",
        "--mechanism",
        "gaussian",
        "--sigma",
        "1",
        "--sampling-rate",
        "0.1",
        "--count",
        "30",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
    )
    assert gauss["epsilon_rdp"] == compose_epsilon({SampledGaussian(1.0, 0.1): 30}, delta=1e-5).rdp
    assert "epsilon_basic" not in gauss
    for mechanism, extra in (("binary_rr", ["--gamma", "0.2"]), ("laplace", ["--epsilon", "0.5"])):
        answer = calc(capsys, "compose", "--mechanism", mechanism, *extra, "--count", "10", "--delta", "1e-5")
        assert answer["epsilon"] <= answer["epsilon_basic"]


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "argv",
    [
        ["rr", "--epsilon", "5"],
        ["rr", "--epsilon", "-1", "--k", "2", "--classes", "10"],
        ["bnn", "--epsilon", "1", "--gamma", "0.1", "--delta", "1e-5", "--rounds", "3"],
        ["compose", "--mechanism", "rr", "--epsilon", "1", "--count", "3", "--delta", "1e-5"],
        ["laplace", "--tau", "1e-5"],
        ["dp-fedavg", "--epsilon", "8", "--delta", "1e-5", "--rate", "1.5", "--rounds", "10"],
        ["dp-sgd", "--epsilon", "1", "--delta", "1e-5", "--rate", "0.1"],
        ["nope"],
    ],
)
def test_bad_arguments_give_one_line_and_status_2(argv):
    process = subprocess.run(
        [sys.executable, "-m", "fl_app.privacy", *argv], capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 2
    assert process.stdout == ""
    assert len(process.stderr.strip().splitlines()) == 1
    assert "error" in process.stderr
    assert "Traceback" not in process.stderr


def test_seeded_generators_are_reproducible_and_separate():
    a = make_generator(seed=7, secure=False, purpose="noise", client=3, server_round=2).random(5)
    b = make_generator(seed=7, secure=False, purpose="noise", client=3, server_round=2).random(5)
    assert np.array_equal(a, b)
    others = [
        make_generator(seed=7, secure=False, purpose="noise", client=4, server_round=2).random(5),
        make_generator(seed=7, secure=False, purpose="noise", client=3, server_round=3).random(5),
        make_generator(seed=7, secure=False, purpose="sampling", client=3, server_round=2).random(5),
        make_generator(seed=8, secure=False, purpose="noise", client=3, server_round=2).random(5),
    ]
    assert all(not np.array_equal(a, other) for other in others)


def test_secure_generators_refuse_seeds_and_differ():
    with pytest.raises(ValueError, match="refuses a fixed seed"):
        make_generator(seed=1, secure=True, purpose="noise")
    with pytest.raises(ValueError, match="refuses a fixed seed"):
        RandomSource(seed=1, secure=True)
    source = RandomSource(seed=None, secure=True)
    first = source.generator("noise", client=1, server_round=1).random(4)
    second = source.generator("noise", client=1, server_round=1).random(4)
    assert not np.array_equal(first, second)
    with pytest.raises(ValueError, match="seed is required"):
        RandomSource(seed=None, secure=False)


COMMANDS_WITHOUT_TORCH = [
    ["rr", "--epsilon", "4", "--k", "2", "--classes", "10"],
    ["laplace", "--epsilon", "1"],
    [
        "nbafl",
        "--epsilon",
        "4",
        "--delta",
        "0.01",
        "--clip",
        "1",
        "--m",
        "50",
        "--l",
        "5",
        "--t",
        "5",
        "--n",
        "10",
    ],
    ["dp-fedavg", "--epsilon", "8", "--delta", "1e-5", "--rate", "0.1", "--rounds", "10"],
]


@pytest.mark.subprocess
def test_the_calculator_answers_without_importing_torch():
    """Every command but ``bnn`` (whose bit count is the BNN's) is privacy arithmetic: it imports neither
    torch nor a strategy's server (an algorithm package's ``__init__`` imports nothing eagerly)."""
    probe = (
        "import contextlib, io, json, sys; from fl_app.report.calculator import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in json.loads(sys.argv[1]):\n"
        "        assert main(argv) == 0, argv\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.endswith(('.strategy', '.stage'))]\n"
        "print(sorted(heavy))"
    )
    process = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(COMMANDS_WITHOUT_TORCH)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.strip() == "[]"
