"""Same privacy: dpfl's accountant beside pfl-research 0.6.0's on the mechanisms both have.

Usage (from the repository root; ``bash scripts/setup_pfl_env.sh`` first, which builds ``.venv-pfl``)::

    .venv/bin/python -P benchmarks/pfl_privacy_check.py [--quick] [--write-doc]   # JSON on stdout
    .venv/bin/python -P benchmarks/pfl_privacy_check.py fixture     # tests/data/pfl_privacy_fixture.json
    .venv-pfl/bin/python -P benchmarks/pfl_privacy_check.py pfl-side < spec.json   # pfl's numbers (internal)

Exit status 0 when ``epsilon_equal`` holds. :func:`compare_epsilons` is the same comparison as a
function (``benchmarks/pfl_crosscheck.py`` imports it).

**What is compared.** pfl 0.6.0 (``pfl.privacy``) has three central mechanisms that dpfl also has:

* *DP-FedAvg with fixed clipping*: ``GaussianMechanism.from_privacy_accountant`` with a
  ``PLDPrivacyAccountant``, ``RDPPrivacyAccountant`` or ``PRVPrivacyAccountant``: one Poisson-sampled
  Gaussian per round (``PoissonSampledDpEvent``), add-or-remove-one; dpfl's ``strategy=dp_fedavg``
  records ``SampledGaussian(z, q)`` per round and composes it with PLD or RDP
  (:func:`fl_app.privacy.composition.compose_epsilon`);
* *adaptive clipping*: ``AdaptiveClippingGaussianMechanism`` (Andrew et al. 2021) appends the +-1
  clipping indicator, scaled, to the update and noises both with one Gaussian: the round is one
  Gaussian of multiplier ``z`` (the accountant's), split into an update noise and an indicator noise.
  dpfl's ``strategy=dp_fedavg_adaptive`` splits the same ``z`` by Theorem 1 of the paper. Compared:
  the split (``z_Delta`` and the indicator's noise) and the epsilon of ``z``;
* *banded matrix factorization*: ``BandedMatrixFactorizationMechanism(clip, T, min_separation,
  make_privacy_accountant)`` accounts ``ceil(T / min_separation)`` compositions of the sampled
  Gaussian; dpfl's ``strategy=dp_bandmf`` records ``SampledGaussian(z, q)`` in each of a client's
  ``ceil(T / b)`` rounds (Choquette-Choo et al. 2023, Theorem 4). Compared: the epsilon of the same
  ``(z, q, compositions)``, the number of compositions each derives from ``(T, b)``, and the column
  norms of each strategy matrix (the sensitivity both accountings assume is 1 per participation).

pfl's DP-FTRL (tree aggregation) is not in 0.6.0; dpfl's ``dp_ftrl`` has nothing to compare with.

**Settings.** pfl's own benchmark configurations (``benchmarks/lm/configs/baseline.yaml``: cohort 400,
noise cohort 5,000, population 1e6, 2,000 iterations, epsilon 2, delta 1e-6;
``benchmarks/image_classification/configs/baseline.yaml`` with ``population=1e6`` from its
``pytorch/train.py``: cohort 50, noise cohort 1,000, 1,500 iterations, epsilon 2, delta 1e-6) and
dpfl's DP-FedAvg quick example (100 of 1,000 clients, 100 rounds, epsilon 8, delta 1e-5). pfl's
``parse_mechanism`` accounts sampling probability ``max(cohort, noise_cohort) / population``.

**Sampling, as each code samples.** pfl's simulations draw a fixed-size cohort of ``cohort_size``
users uniformly *with replacement* (``get_user_sampler('random', ...)`` in its benchmarks' data
sets), while its accountant assumes Poisson sampling at ``noise_cohort_size / population`` (a
deployment's, not the simulation's: its ``--noise_cohort_size`` help says the results are valid only
for a deployment with that cohort). dpfl accounts what it runs: Poisson cohorts (secret coins) as the
sampled Gaussian; fixed-size cohorts as the Gaussian without amplification for every round (a fixed
cohort may be public); ``strategy.noise_cohort_size`` accounts the deployment pfl's convention
describes and says so. The rows ``sampling`` report, for pfl's settings, the epsilon of the same noise
under each reading.

**Tolerances.** PLD: dpfl discretises the privacy loss at 1e-3 (pessimistic), pfl at 1e-4
(pessimistic, connect-the-dots); both are upper bounds, agreement within 1 % relative is required.
RDP: the same dp-accounting conversion; dpfl adds Renyi orders near 1 and above 1024 (so it can only
be lower): within 1 % relative. PRV (pfl only): its estimate has ``eps_error`` 0.07 (pfl's default);
compared with dpfl's PLD within that absolute error plus 1 %.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
PFL_PYTHON = ROOT / ".venv-pfl" / "bin" / "python"
FIXTURE = ROOT / "tests" / "data" / "pfl_privacy_fixture.json"
DOC = ROOT / "docs" / "benchmarks" / "pfl_privacy.md"
RECORD = ROOT / "docs" / "benchmarks" / "pfl_privacy" / "compare.json"
BEGIN = "<!-- PFL_PRIVACY:BEGIN (benchmarks/pfl_privacy_check.py --write-doc) -->"
END = "<!-- PFL_PRIVACY:END -->"

#: Relative tolerance on epsilon between two PLD (or two RDP) computations of the same history.
RELATIVE_TOLERANCE = 0.01
#: pfl's PRV accountant's default ``eps_error`` (its estimate's stated absolute error).
PRV_EPS_ERROR = 0.07
#: Relative tolerance between the noise multipliers each side calibrates (both search to 1e-4 or finer).
NOISE_TOLERANCE = 1e-3

#: The settings: pfl's benchmark configurations and dpfl's quick example (module docstring).
SETTINGS: tuple[dict[str, Any], ...] = (
    {
        "name": "pfl LM config (Stack Overflow)",
        "source": "pfl-research benchmarks/lm/configs/baseline.yaml",
        "cohort": 400,
        "noise_cohort": 5000,
        "population": 1_000_000,
        "rounds": 2000,
        "epsilon": 2.0,
        "delta": 1e-6,
    },
    {
        "name": "pfl image config (CIFAR-10)",
        "source": "pfl-research benchmarks/image_classification/configs/baseline.yaml, population 1e6 "
        "(pytorch/train.py)",
        "cohort": 50,
        "noise_cohort": 1000,
        "population": 1_000_000,
        "rounds": 1500,
        "epsilon": 2.0,
        "delta": 1e-6,
    },
    {
        "name": "dpfl quick example (DP-FedAvg)",
        "source": "dpfl strategies/dp_fedavg.py QuickExample",
        "cohort": 100,
        "noise_cohort": 100,
        "population": 1000,
        "rounds": 100,
        "epsilon": 8.0,
        "delta": 1e-5,
    },
)
#: Adaptive clipping: dpfl's quick-example shape; pfl's recommended indicator noise 0.1 x cohort equals
#: dpfl's default bit noise cohort / 20 on the centred bits (+-1/2), i.e. 2 sigma_b on +-1.
ADAPTIVE = {"cohort": 100, "population": 1000, "rounds": 100, "epsilon": 8.0, "delta": 1e-5, "clip": 1.0}
#: Banded MF: T rounds, b bands (= pfl's min_separation), cohorts of m from N clients.
BANDMF_QUICK = {"rounds": 32, "bands": 4, "cohort": 100, "population": 10_000, "epsilon": 2.0, "delta": 1e-6}
BANDMF_FULL = {"rounds": 128, "bands": 16, "cohort": 100, "population": 10_000, "epsilon": 2.0, "delta": 1e-6}


# --------------------------------------------------------------------------------------------------
# The specification both sides compute from
# --------------------------------------------------------------------------------------------------


def sampling_rate(setting: dict[str, Any]) -> float:
    """The sampling rate of pfl's ``parse_mechanism``: ``max(cohort, noise_cohort) / population``."""
    return max(setting["cohort"], setting["noise_cohort"]) / setting["population"]


def dpfl_noise_multiplier(*, epsilon: float, delta: float, rate: float, rounds: int, method: str) -> float:
    """The calibration of dpfl's DP-FedAvg (the function ``strategy=dp_fedavg`` calls)."""
    from fl_app.privacy.calibration import dp_fedavg_noise_multiplier

    return dp_fedavg_noise_multiplier(
        epsilon=epsilon, delta=delta, sampling_rate=rate, rounds=rounds, method=method
    )


def specification(*, quick: bool) -> dict[str, Any]:
    """What pfl computes: every setting's noise multiplier (dpfl's PLD calibration) and what to do with it.

    The noise multipliers come from dpfl's calibration so that both sides account the same ``z``; in
    the full comparison pfl also calibrates its own (``calibrate``).
    """
    gaussian = []
    for setting in SETTINGS:
        rate = sampling_rate(setting)
        z = dpfl_noise_multiplier(
            epsilon=setting["epsilon"],
            delta=setting["delta"],
            rate=rate,
            rounds=setting["rounds"],
            method="pld",
        )
        gaussian.append(
            {
                **setting,
                "rate": rate,
                "noise_multiplier": z,
                "accountants": ["pld", "rdp", "prv"],
                "calibrate": [] if quick else ["pld", "rdp", "prv"],
            }
        )
    adaptive_rate = ADAPTIVE["cohort"] / ADAPTIVE["population"]
    adaptive_z = dpfl_noise_multiplier(
        epsilon=ADAPTIVE["epsilon"],
        delta=ADAPTIVE["delta"],
        rate=adaptive_rate,
        rounds=ADAPTIVE["rounds"],
        method="pld",
    )
    bandmf = dict(BANDMF_QUICK if quick else BANDMF_FULL)
    bandmf["rate"] = bandmf["cohort"] * bandmf["bands"] / bandmf["population"]  # dpfl's cyclic Poisson
    bandmf["pfl_rate"] = bandmf["cohort"] / bandmf["population"]  # pfl's parse_mechanism
    bandmf["noise_multiplier"] = dpfl_noise_multiplier(
        epsilon=bandmf["epsilon"],
        delta=bandmf["delta"],
        rate=bandmf["rate"],
        rounds=math.ceil(bandmf["rounds"] / bandmf["bands"]),
        method="pld",
    )
    return {
        "quick": quick,
        "gaussian": gaussian,
        "adaptive": {
            **ADAPTIVE,
            "rate": adaptive_rate,
            "noise_multiplier": adaptive_z,
            "indicator_noise": 0.1 * ADAPTIVE["cohort"],
        },
        "bandmf": bandmf,
    }


# --------------------------------------------------------------------------------------------------
# pfl side (run with .venv-pfl/bin/python; imports nothing from dpfl)
# --------------------------------------------------------------------------------------------------


def _pfl_accountant(kind: str, **kwargs: Any) -> Any:
    from pfl.privacy import PLDPrivacyAccountant, PRVPrivacyAccountant, RDPPrivacyAccountant

    classes = {"pld": PLDPrivacyAccountant, "rdp": RDPPrivacyAccountant, "prv": PRVPrivacyAccountant}
    return classes[kind](mechanism="gaussian", **kwargs)


def _timed(function: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def pfl_gaussian(case: dict[str, Any]) -> dict[str, Any]:
    """The epsilon of ``z`` with each of pfl's accountants, its calibrated ``z``, the large-cohort noise."""
    from pfl.privacy import GaussianMechanism

    common = {"num_compositions": case["rounds"], "sampling_probability": case["rate"]}
    out: dict[str, Any] = {"epsilon": {}, "epsilon_s": {}, "noise_multiplier": {}, "calibration_s": {}}
    for kind in case["accountants"]:
        accountant, seconds = _timed(
            lambda kind=kind: _pfl_accountant(
                kind, noise_parameter=case["noise_multiplier"], delta=case["delta"], **common
            )
        )
        out["epsilon"][kind] = float(accountant.epsilon)
        out["epsilon_s"][kind] = seconds
    for kind in case["calibrate"]:
        accountant, seconds = _timed(
            lambda kind=kind: _pfl_accountant(kind, epsilon=case["epsilon"], delta=case["delta"], **common)
        )
        out["noise_multiplier"][kind] = float(accountant.noise_parameter)
        out["calibration_s"][kind] = seconds
    # the large-cohort convention as parse_mechanism builds it: noise_scale = cohort / noise_cohort
    scaled = _pfl_accountant(
        "rdp",
        noise_parameter=case["noise_multiplier"],
        delta=case["delta"],
        noise_scale=case["cohort"] / case["noise_cohort"],
        **common,
    )
    mechanism = GaussianMechanism.from_privacy_accountant(accountant=scaled, clipping_bound=1.0)
    out["sum_noise_multiplier"] = float(mechanism.relative_noise_stddev)
    return out


def pfl_adaptive(case: dict[str, Any]) -> dict[str, Any]:
    """How pfl splits one round's ``z`` between the update and the clipping indicator."""
    from pfl.privacy.adaptive_clipping import AdaptiveClippingGaussianMechanism

    accountant = _pfl_accountant(
        "pld",
        num_compositions=case["rounds"],
        sampling_probability=case["rate"],
        noise_parameter=case["noise_multiplier"],
        delta=case["delta"],
    )
    mechanism = AdaptiveClippingGaussianMechanism.construct_from_privacy_accountant(
        accountant=accountant,
        initial_clipping_bound=case["clip"],
        clipping_indicator_noise_stddev=case["indicator_noise"],
        adaptive_clipping_norm_quantile=0.5,
    )
    z = mechanism._underlying_mechanism.relative_noise_stddev
    overall = mechanism._get_overall_clipping_bound()  # sqrt(C_Delta^2 + C_b^2)
    scale = mechanism._get_clipping_indicator_scale()  # C_b: the +-1 indicator is scaled to +-C_b
    return {
        "epsilon": float(accountant.epsilon),
        "noise_multiplier": float(z),
        "update_noise_multiplier": float(z * overall / case["clip"]),
        "indicator_noise_std": float(z * overall / scale),  # on the +-1 indicator's sum
    }


def pfl_bandmf(case: dict[str, Any]) -> dict[str, Any]:
    """Banded MF in pfl: its compositions, the epsilon of ``z`` at both rates, its matrix's norms."""
    import numpy as np
    from pfl.internal.ops import pytorch_ops
    from pfl.internal.ops.selector import set_framework_module
    from pfl.privacy.ftrl_mechanism import BandedMatrixFactorizationMechanism

    set_framework_module(pytorch_ops)
    asked: list[int] = []
    accountants: dict[str, Any] = {}

    def make_accountant(num_compositions: int) -> Any:
        asked.append(num_compositions)
        for name, rate in (("pfl_rate", case["pfl_rate"]), ("rate", case["rate"])):
            accountants[name] = _pfl_accountant(
                "pld",
                num_compositions=num_compositions,
                sampling_probability=rate,
                noise_parameter=case["noise_multiplier"],
                delta=case["delta"],
            )
        return accountants["pfl_rate"]

    with tempfile.TemporaryDirectory() as directory:  # pfl writes its matrix to ./banded_mf_dp_ftrl/
        here = os.getcwd()
        os.chdir(directory)
        try:
            mechanism, seconds = _timed(
                lambda: BandedMatrixFactorizationMechanism(
                    1.0, case["rounds"], case["bands"], make_accountant
                )
            )
        finally:
            os.chdir(here)
    matrix = np.asarray(mechanism.query_matrix, dtype=np.float64)
    columns = np.linalg.norm(matrix, axis=0)
    rows = np.linalg.norm(matrix, axis=1)
    nonzero = np.argwhere(np.abs(matrix) > 1e-12)
    patterns = [
        float(np.linalg.norm(matrix[:, start :: case["bands"]].sum(axis=1))) for start in range(case["bands"])
    ]
    return {
        "compositions": asked[0],
        "epsilon": {name: float(a.epsilon) for name, a in accountants.items()},
        "noise_multiplier": float(mechanism.relative_noise_stddev),
        "column_norm_max": float(columns.max()),
        "column_norm_min": float(columns.min()),
        "row_norm_max": float(rows.max()),
        "row_norm_min": float(rows.min()),
        "bandwidth": int((nonzero[:, 0] - nonzero[:, 1]).max()) + 1,
        "pattern_sensitivity_max": max(patterns),
        "factorization_s": seconds,
    }


def pfl_side(spec: dict[str, Any]) -> dict[str, Any]:
    """Everything pfl computes for ``spec`` (:func:`specification`), with its versions."""
    import logging
    from importlib.metadata import version

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # dp-accounting's fractional-order warnings
    logging.getLogger("absl").setLevel(logging.ERROR)
    start = time.perf_counter()
    result = {
        "versions": {name: version(name) for name in ("pfl", "dp-accounting", "prv-accountant", "torch")},
        "gaussian": [pfl_gaussian(case) for case in spec["gaussian"]],
        "adaptive": pfl_adaptive(spec["adaptive"]),
        "bandmf": pfl_bandmf(spec["bandmf"]),
    }
    result["seconds"] = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------------
# dpfl side and the comparison (run with .venv/bin/python)
# --------------------------------------------------------------------------------------------------


def dpfl_epsilon(*, noise_multiplier: float, rate: float, rounds: int, delta: float, method: str) -> float:
    """The epsilon dpfl composes for ``rounds`` Poisson-sampled Gaussians (``rate == 1``: Gaussians)."""
    from fl_app.privacy.composition import compose_epsilon
    from fl_app.privacy.events import Gaussian, SampledGaussian

    mechanism = Gaussian(noise_multiplier) if rate >= 1.0 else SampledGaussian(noise_multiplier, rate)
    report = compose_epsilon({mechanism: rounds}, delta=delta, method=method)
    if method == "pld" and report.pld is not None:
        return float(report.pld)
    return float(report.rdp if method == "rdp" else report.epsilon)


def agrees(dpfl: float, pfl: float, *, accountant: str) -> tuple[bool, float]:
    """Whether two epsilons of the same history agree within the accountants' tolerance, and the bound."""
    tolerance = RELATIVE_TOLERANCE * abs(pfl)
    if accountant == "prv":
        tolerance += PRV_EPS_ERROR
    return abs(dpfl - pfl) <= tolerance, tolerance


def _row(
    mechanism: str, setting: str, accountant: str, dpfl: float, pfl: float, **extra: Any
) -> dict[str, Any]:
    ok, tolerance = agrees(dpfl, pfl, accountant=accountant)
    return {
        "mechanism": mechanism,
        "setting": setting,
        "accountant": accountant,
        **extra,
        "epsilon_dpfl": dpfl,
        "epsilon_pfl": pfl,
        "difference": dpfl - pfl,
        "tolerance": tolerance,
        "within": ok,
    }


def gaussian_rows(case: dict[str, Any], pfl: dict[str, Any]) -> list[dict[str, Any]]:
    """DP-FedAvg: dpfl's epsilon of the same ``z`` against each of pfl's accountants (and calibrations)."""
    rows = []
    z = case["noise_multiplier"]
    inputs = {"noise_multiplier": z, "rate": case["rate"], "rounds": case["rounds"], "delta": case["delta"]}
    for accountant, theirs in pfl["epsilon"].items():
        method = "rdp" if accountant == "rdp" else "pld"  # PRV is compared with dpfl's PLD
        ours = dpfl_epsilon(
            noise_multiplier=z, rate=case["rate"], rounds=case["rounds"], delta=case["delta"], method=method
        )
        rows.append(_row("DP-FedAvg, fixed clipping", case["name"], accountant, ours, theirs, **inputs))
    for accountant, theirs_z in pfl["noise_multiplier"].items():
        method = "rdp" if accountant == "rdp" else "pld"
        ours_z = dpfl_noise_multiplier(
            epsilon=case["epsilon"],
            delta=case["delta"],
            rate=case["rate"],
            rounds=case["rounds"],
            method=method,
        )
        ours = dpfl_epsilon(
            noise_multiplier=theirs_z,
            rate=case["rate"],
            rounds=case["rounds"],
            delta=case["delta"],
            method=method,
        )
        row = _row(
            "DP-FedAvg, fixed clipping (pfl's calibrated z)",
            case["name"],
            accountant,
            ours,
            case["epsilon"],
            noise_multiplier_pfl=theirs_z,
            noise_multiplier_dpfl=ours_z,
            noise_ratio=ours_z / theirs_z,
            rate=case["rate"],
            rounds=case["rounds"],
            delta=case["delta"],
        )
        row["within"] = row["within"] and abs(ours_z / theirs_z - 1.0) <= NOISE_TOLERANCE
        rows.append(row)
    return rows


def large_cohort_rows(case: dict[str, Any], pfl: dict[str, Any]) -> list[dict[str, Any]]:
    """The noise multiplier on the simulated cohort's sum: pfl's ``noise_scale`` against dpfl's option."""
    from fl_app.privacy.calibration import large_cohort_noise_multiplier

    if case["noise_cohort"] <= case["cohort"]:
        return []
    ours = large_cohort_noise_multiplier(
        noise_multiplier=case["noise_multiplier"],
        cohort=case["cohort"],
        noise_cohort_size=case["noise_cohort"],
    )
    theirs = pfl["sum_noise_multiplier"]
    return [
        {
            "mechanism": "large-cohort convention (noise std on the sum of the simulated cohort, / clip)",
            "setting": case["name"],
            "cohort": case["cohort"],
            "noise_cohort": case["noise_cohort"],
            "noise_multiplier": case["noise_multiplier"],
            "sum_noise_multiplier_dpfl": ours,
            "sum_noise_multiplier_pfl": theirs,
            "within": abs(ours - theirs) <= 1e-12 * max(1.0, abs(theirs)),
        }
    ]


def sampling_rows(case: dict[str, Any]) -> dict[str, Any]:
    """The same noise read three ways: pfl's Poisson claim, dpfl's fixed cohort, the simulated cohort."""
    z = case["noise_multiplier"]
    scaled = z * case["cohort"] / case["noise_cohort"]
    return {
        "setting": case["name"],
        "noise_multiplier": z,
        "delta": case["delta"],
        "poisson_deployment": {
            "reading": f"Poisson cohorts of expected {case['noise_cohort']} of {case['population']:g} "
            "(pfl's accountant; dpfl's sampling=poisson, or its noise_cohort_size): what both print",
            "rate": case["rate"],
            "epsilon": dpfl_epsilon(
                noise_multiplier=z,
                rate=case["rate"],
                rounds=case["rounds"],
                delta=case["delta"],
                method="pld",
            ),
        },
        "fixed_cohort_public": {
            "reading": "fixed-size cohorts, no amplification, a client in every round (dpfl's sampling=fixed "
            "accounting of a deployment with cohorts of the noise cohort's size)",
            "rate": 1.0,
            "epsilon": dpfl_epsilon(
                noise_multiplier=z, rate=1.0, rounds=case["rounds"], delta=case["delta"], method="pld"
            ),
        },
        "simulated_run": {
            "reading": f"the simulation itself: cohorts of {case['cohort']} drawn with replacement, noise "
            f"multiplier z x {case['cohort']}/{case['noise_cohort']} on their sum; a user drawn once in "
            "every round (a lower bound on the worst case: with replacement a user can be drawn twice; no "
            "amplification: pfl's sampler is numpy's global, seeded state)",
            "noise_multiplier": scaled,
            "epsilon": dpfl_epsilon(
                noise_multiplier=scaled, rate=1.0, rounds=case["rounds"], delta=case["delta"], method="rdp"
            ),
        },
    }


def adaptive_rows(case: dict[str, Any], pfl: dict[str, Any]) -> list[dict[str, Any]]:
    """Adaptive clipping: the same split of ``z`` and the same epsilon."""
    from strategies.dp_fedavg_adaptive import (
        adaptive_clipping_default_bit_noise,
        adaptive_clipping_update_noise_multiplier,
    )

    z = case["noise_multiplier"]
    bit_noise = adaptive_clipping_default_bit_noise(expected_clients=case["cohort"])  # on the centred bits
    ours_update = adaptive_clipping_update_noise_multiplier(noise_multiplier=z, bit_noise=bit_noise)
    ours = dpfl_epsilon(
        noise_multiplier=z, rate=case["rate"], rounds=case["rounds"], delta=case["delta"], method="pld"
    )
    split_ok = math.isclose(ours_update, pfl["update_noise_multiplier"], rel_tol=1e-12) and math.isclose(
        2.0 * bit_noise, pfl["indicator_noise_std"], rel_tol=1e-12
    )
    row = _row(
        "adaptive clipping",
        f"{case['cohort']} of {case['population']}, {case['rounds']} rounds",
        "pld",
        ours,
        pfl["epsilon"],
        noise_multiplier=z,
        rate=case["rate"],
        rounds=case["rounds"],
        delta=case["delta"],
        update_noise_multiplier_dpfl=ours_update,
        update_noise_multiplier_pfl=pfl["update_noise_multiplier"],
        indicator_noise_std_dpfl=2.0 * bit_noise,
        indicator_noise_std_pfl=pfl["indicator_noise_std"],
    )
    row["within"] = row["within"] and split_ok
    return [row]


def dpfl_band_matrix(*, rounds: int, bands: int) -> dict[str, float]:
    """Column and row norms of dpfl's banded Toeplitz strategy matrix for ``rounds`` and ``bands``."""
    import numpy as np

    from strategies.dp_bandmf.factorization import optimal_banded_toeplitz

    c = np.asarray(optimal_banded_toeplitz(rounds=rounds, bands=bands).coefficients, dtype=np.float64)
    matrix = np.zeros((rounds, rounds))
    for lag, value in enumerate(c):
        matrix += np.diag(np.full(rounds - lag, value), -lag)
    columns = np.linalg.norm(matrix, axis=0)
    patterns = [float(np.linalg.norm(matrix[:, start::bands].sum(axis=1))) for start in range(bands)]
    return {
        "column_norm_max": float(columns.max()),
        "pattern_sensitivity_max": max(patterns),
        "bandwidth": len(c),
    }


def bandmf_rows(
    case: dict[str, Any], pfl: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Banded MF: equal accounting of equal inputs (rows), and the two differences found."""
    z, delta, rounds, bands = case["noise_multiplier"], case["delta"], case["rounds"], case["bands"]
    steps = math.ceil(rounds / bands)  # dpfl: DPBandMFStrategy.steps
    ours = dpfl_epsilon(noise_multiplier=z, rate=case["rate"], rounds=steps, delta=delta, method="pld")
    row = _row(
        "banded matrix factorization",
        f"T={rounds}, b={bands}, {case['cohort']} of {case['population']} a round",
        "pld",
        ours,
        pfl["epsilon"]["rate"],
        noise_multiplier=z,
        rate=case["rate"],
        compositions_dpfl=steps,
        compositions_pfl=pfl["compositions"],
        delta=delta,
    )
    row["within"] = row["within"] and steps == pfl["compositions"]
    k = pfl["compositions"]
    ours_matrix = dpfl_band_matrix(rounds=rounds, bands=bands)
    column = pfl["column_norm_max"]

    def epsilon(noise: float, rate: float) -> float:
        return dpfl_epsilon(noise_multiplier=noise, rate=rate, rounds=k, delta=delta, method="pld")

    claimed = pfl["epsilon"]["pfl_rate"]
    differences = [
        {
            "what": "banded MF: the sampling rate of each participation",
            "pfl": f"q = cohort / population = {case['pfl_rate']:g} (its benchmarks' parse_mechanism), for "
            f"each of the {k} participations; its sampler draws cohorts of {case['cohort']} with replacement "
            f"and does not enforce the separation of {bands} rounds",
            "dpfl": f"q = cohort x bands / population = {case['rate']:g}: a client may take part once in "
            f"every {bands} rounds, so its group is sampled at {bands} times the rate to fill cohorts of "
            f"{case['cohort']} (cyclic Poisson sampling, Choquette-Choo et al. 2023, Theorem 4)",
            "which_is_right": "dpfl's: at pfl's rate a deployment that keeps the separation fills cohorts "
            f"of {case['cohort']} / {bands} on average, not the cohort it simulates",
            "epsilon_pfl_claims": claimed,
            "epsilon_at_cyclic_rate": epsilon(z, case["rate"]),
        },
        {
            "what": "banded MF: the strategy matrix's column norms (the sensitivity of one participation)",
            "pfl": f"C = cholesky(X), lower triangular with L L^T = X: unit ROW norms, column norms "
            f"{pfl['column_norm_min']:.4f} to {column:.4f}; participations {bands} rounds apart reach "
            f"sensitivity {pfl['pattern_sensitivity_max']:.4f}, against the sqrt({k}) = {math.sqrt(k):.4f} "
            "its accountant assumes",
            "dpfl": "banded Toeplitz C with ||c|| = 1: column norms at most "
            f"{ours_matrix['column_norm_max']:.4f}, "
            f"participations {bands} rounds apart reach {ours_matrix['pattern_sensitivity_max']:.4f}",
            "which_is_right": "dpfl's: the loss pfl minimises, tr(A X^-1 A^T) with diag(X) = 1, is the error "
            "of a C with C^T C = X, whose columns have norm 1; the Cholesky factor L (L L^T = X) that it "
            "uses has unit rows instead, so its noise is calibrated for a smaller sensitivity than its C has",
            "epsilon_pfl_claims": claimed,
            "epsilon_with_column_bound": epsilon(z / column, case["pfl_rate"]),
            "epsilon_with_both": epsilon(z / column, case["rate"]),
            "bound": "each participation's sensitivity bounded by the largest column norm: an upper bound on "
            "the epsilon of pfl's mechanism as it runs",
        },
    ]
    return [row], differences


def run_pfl(spec: dict[str, Any], *, timeout: float = 1800.0) -> dict[str, Any]:
    """The pfl side (:func:`pfl_side`) in its own venv, as a subprocess."""
    completed = subprocess.run(
        [str(PFL_PYTHON), "-P", str(SCRIPT), "pfl-side"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"pfl side failed ({completed.returncode}): {completed.stderr[-2000:]}")
    return json.loads(completed.stdout)


def pfl_numbers(spec: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The numbers of pfl, live when ``.venv-pfl`` exists, else the fixture recorded for the same spec."""
    if PFL_PYTHON.exists():
        return run_pfl(spec), f"live: {PFL_PYTHON.relative_to(ROOT)}"
    if spec["quick"] and FIXTURE.exists():
        fixture = json.loads(FIXTURE.read_text())
        if _same_spec(fixture["spec"], spec):
            return fixture[
                "pfl"
            ], f"fixture: {FIXTURE.relative_to(ROOT)} (no .venv-pfl; bash scripts/setup_pfl_env.sh)"
    raise FileNotFoundError(f"{PFL_PYTHON} not found: run bash scripts/setup_pfl_env.sh")


def _same_spec(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_spec(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_spec(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def compare(spec: dict[str, Any], pfl: dict[str, Any]) -> dict[str, Any]:
    """The rows, the differences and the verdict from both sides' numbers."""
    rows: list[dict[str, Any]] = []
    for case, theirs in zip(spec["gaussian"], pfl["gaussian"], strict=True):
        rows += gaussian_rows(case, theirs)
        rows += large_cohort_rows(case, theirs)
    rows += adaptive_rows(spec["adaptive"], pfl["adaptive"])
    band_rows, differences = bandmf_rows(spec["bandmf"], pfl["bandmf"])
    rows += band_rows
    return {
        "epsilon_equal": all(row["within"] for row in rows),
        "rows": rows,
        "sampling": [
            sampling_rows(case) for case in spec["gaussian"] if case["noise_cohort"] > case["cohort"]
        ],
        "differences": differences,
        "tolerances": {
            "relative": RELATIVE_TOLERANCE,
            "prv_eps_error": PRV_EPS_ERROR,
            "noise_multiplier_relative": NOISE_TOLERANCE,
        },
        "pfl_versions": pfl["versions"],
    }


def compare_epsilons(*, quick: bool) -> dict[str, Any]:
    """The accountant of dpfl beside pfl 0.6.0's on the mechanisms both have (module docstring).

    Parameters
    ----------
    quick : bool
        Epsilons of dpfl's calibrated noise on both sides (about a minute); without it pfl also
        calibrates its own noise with each accountant and banded MF runs at 128 rounds (minutes).

    Returns
    -------
    dict
        ``epsilon_equal`` (every row within its tolerance), ``rows`` (one per mechanism, setting and
        accountant), ``sampling`` (the same noise read as each code samples), ``differences`` (what
        differs and which side is right), ``pfl_source`` (live or the fixture), ``seconds``.

    """
    start = time.perf_counter()
    spec = specification(quick=quick)
    pfl, source = pfl_numbers(spec)
    result = compare(spec, pfl)
    result["quick"] = quick
    result["pfl_source"] = source
    result["seconds"] = time.perf_counter() - start
    return result


def write_fixture() -> dict[str, Any]:
    """Run pfl on the quick specification and keep its numbers in ``tests/data`` (for tests without pfl)."""
    spec = specification(quick=True)
    pfl = run_pfl(spec)
    fixture = {
        "made_by": ".venv/bin/python -P benchmarks/pfl_privacy_check.py fixture",
        "spec": spec,
        "pfl": pfl,
    }
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    return fixture


def _g(value: Any, digits: int = 5) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def tables(result: dict[str, Any]) -> str:
    """The page's generated block: the rows, the sampling readings and the differences."""
    rows = result["rows"]
    lines = [
        f"pfl {result['pfl_versions']['pfl']} (dp-accounting {result['pfl_versions']['dp-accounting']}, "
        f"prv-accountant {result['pfl_versions']['prv-accountant']}); "
        f"{'quick' if result['quick'] else 'full'} "
        f"comparison, {result['seconds']:.0f} s; pfl's numbers: {result['pfl_source']}. "
        f"**epsilon_equal: {str(result['epsilon_equal']).lower()}**.",
        "",
        "| mechanism | setting | accountant | z | q | compositions | epsilon dpfl | epsilon pfl | "
        "difference | tolerance | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "epsilon_dpfl" not in row:
            continue
        z = row.get("noise_multiplier", row.get("noise_multiplier_pfl"))
        steps = row.get("rounds", row.get("compositions_dpfl"))
        lines.append(
            f"| {row['mechanism']} | {row['setting']} | {row['accountant']} | {_g(z)} | {_g(row['rate'])} | "
            f"{steps} | {_g(row['epsilon_dpfl'], 6)} | {_g(row['epsilon_pfl'], 6)} "
            f"| {row['difference']:+.2e} | "
            f"{_g(row['tolerance'], 3)} | {'yes' if row['within'] else 'NO'} |"
        )
    calibrated = [row for row in rows if "noise_ratio" in row]
    if calibrated:
        lines += [
            "",
            "Noise multipliers each side calibrates for the setting's epsilon (pfl: its binary search to "
            "1e-4 in delta; dpfl: bisection to 1e-4 in z, on the safe side):",
            "",
            "| setting | accountant | z pfl | z dpfl | dpfl / pfl |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {row['setting']} | {row['accountant']} | {row['noise_multiplier_pfl']:.6f} | "
            f"{row['noise_multiplier_dpfl']:.6f} | {row['noise_ratio']:.6f} |"
            for row in calibrated
        ]
    adaptive = [row for row in rows if row["mechanism"] == "adaptive clipping"]
    scaled = [row for row in rows if row["mechanism"].startswith("large-cohort")]
    lines += [
        "",
        "| split of one round's z | z | update z_Delta dpfl | pfl | indicator noise (+-1) dpfl | pfl |",
    ]
    lines += ["|---|---|---|---|---|---|"]
    lines += [
        f"| adaptive clipping, {row['setting']} | {_g(row['noise_multiplier'])} | "
        f"{row['update_noise_multiplier_dpfl']:.10g} | {row['update_noise_multiplier_pfl']:.10g} | "
        f"{row['indicator_noise_std_dpfl']:.10g} | {row['indicator_noise_std_pfl']:.10g} |"
        for row in adaptive
    ]
    lines += [
        "",
        "| large-cohort convention | m / M | z | noise on the sum / C: dpfl | pfl |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['setting']} | {row['cohort']} / {row['noise_cohort']} | {_g(row['noise_multiplier'])} | "
        f"{row['sum_noise_multiplier_dpfl']:.10g} | {row['sum_noise_multiplier_pfl']:.10g} |"
        for row in scaled
    ]
    lines += [
        "",
        "The same noise read as each code samples (dpfl's PLD accountant; the simulated run by RDP):",
        "",
        "| setting | z | Poisson deployment (both print) | fixed cohorts, public (dpfl's sampling=fixed) | "
        "the simulation itself (z m / M on its sum) |",
        "|---|---|---|---|---|",
    ]
    for item in result["sampling"]:
        p, f, r = item["poisson_deployment"], item["fixed_cohort_public"], item["simulated_run"]
        lines.append(
            f"| {item['setting']} | {_g(item['noise_multiplier'])} | q = {p['rate']:g}: {_g(p['epsilon'])} | "
            f"{_g(f['epsilon'])} | z = {_g(r['noise_multiplier'])}: {_g(r['epsilon'])} |"
        )
    lines += ["", "Differences found in pfl's banded matrix factorization:", ""]
    for item in result["differences"]:
        numbers = ", ".join(f"{k} {_g(v)}" for k, v in item.items() if k.startswith("epsilon"))
        lines.append(
            f"- **{item['what']}**. pfl: {item['pfl']}. dpfl: {item['dpfl']}. Which is right: "
            f"{item['which_is_right']}. Epsilons: {numbers}."
        )
    return "\n".join(lines)


def write_doc(result: dict[str, Any]) -> None:
    """Keep the record (``docs/benchmarks/pfl_privacy/compare.json``) and replace the page's block."""
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(result, indent=1) + "\n")
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{tables(result)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="compare", choices=("compare", "fixture", "pfl-side"))
    parser.add_argument("--quick", action="store_true", help="the quick comparison (about a minute)")
    parser.add_argument(
        "--write-doc", action="store_true", help="keep the record and write the tables of the page"
    )
    args = parser.parse_args(argv)
    if args.command == "pfl-side":
        json.dump(pfl_side(json.load(sys.stdin)), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    if args.command == "fixture":
        fixture = write_fixture()
        print(json.dumps({"fixture": str(FIXTURE.relative_to(ROOT)), "seconds": fixture["pfl"]["seconds"]}))
        return 0
    result = compare_epsilons(quick=args.quick)
    print(json.dumps(result, indent=1))
    if args.write_doc:
        write_doc(result)
    return 0 if result["epsilon_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
