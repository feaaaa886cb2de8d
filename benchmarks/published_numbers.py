"""The published numbers beside the text presets: dpfl's accountant on the same parameters.

Usage (from the repository root)::

    .venv/bin/python -P benchmarks/published_numbers.py            # the JSON object on stdout
    .venv/bin/python -P benchmarks/published_numbers.py --write-doc  # and the page's tables

Every published number comes with where it is stated (google-research/federated, at the commit
read) and is marked *approximate* where it is read off a figure (to the figure's resolution, by eye
from the PNG). dpfl's numbers come from its accountant (:func:`fl_app.privacy.composition.
compose_epsilon`, dp-accounting 0.6.0) and, for DP-FTRL with participation limits, from
:func:`strategies.dp_ftrl.privacy.worst_tree_sensitivity`.

* **Gboard deployments** whose accounting parameters are published: DP-FTRL for the Spanish
  next-word model (``dp_ftrl/blogpost_supplemental_privacy_accounting.ipynb``: noise multiplier 7,
  2000 rounds, at most 6 participations at least 314 rounds apart, delta 1e-10) and three MF-DP-FTRL
  models (``mf_dpftrl_matrices/README.md`` and ``privacy_accounting.ipynb``).
* **DP-FTRL on Stack Overflow** (``dp_ftrl/README.md`` at db264810, removed in 6c1573fe): the
  noise multipliers that reach 24.5 % and 23 % test accuracy at 100 clients a round (1600 rounds,
  clip 1), their epsilon at that report goal, and the report goals its Figure 2c (``fig2c.png``)
  pairs with each epsilon under the large-cohort convention (noise ``z M / 100`` on the sum of
  ``M``: the same noise on the average), read off the figure.
* **The figures without parameters**: ``fig2a.png`` (accuracy against user-level epsilon) and
  ``multi_epoch_dp_matrix_factorization/images/stackoverflow.png`` (accuracy against epsilon at
  delta 1e-6), read off; for the latter, the noise each epsilon needs for one release at the
  matrix's sensitivity (that code's ``accounting.get_single_release_eps``) and for dpfl's
  ``so_bandmf`` preset (342 bands, 6 participations).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks" / "published_numbers.md"
BEGIN = "<!-- PUBLISHED_NUMBERS:BEGIN (benchmarks/published_numbers.py --write-doc) -->"
END = "<!-- PUBLISHED_NUMBERS:END -->"

REPO = "google-research/federated"
HEAD = "a5af8c4433c9ee2d2b1565f1bcc68c89e2000a6b"
README_COMMIT = "db264810a927e8177e6595fc1812752ad34a7d19"
STACK_OVERFLOW_USERS = 342_477

#: The Gboard DP-FTRL model (the 2022 blog post's colab): its parameters and what it prints.
GBOARD_DP_FTRL = {
    "model": "Gboard es-ES next-word prediction, DP-FTRL (tree aggregation, efficient estimator)",
    "source": f"{REPO} dp_ftrl/blogpost_supplemental_privacy_accounting.ipynb at {HEAD[:8]}",
    "noise_multiplier": 7.0,
    "steps": 2000,
    "max_participations": 6,
    "min_separation": 313,  # its definition: r2 - r1 - 1, so two rounds are at least 314 apart
    "delta": 1e-10,
    "published_rho": 0.81,
    "published_epsilon": 8.90,
}
#: The MF-DP-FTRL models (mf_dpftrl_matrices/README.md; privacy_accounting.ipynb prints more digits).
GBOARD_MF = (
    {
        "model": "Gboard es-ES next-word prediction, MF-DP-FTRL (400 bands, 2000 rounds)",
        "noise_multiplier": 1.411,
        "bands": 400,
        "min_separation": 484,
        "max_participations": 3,
        "published_rho": 0.1506840301548885,
        "published_epsilon": 3.4240074094281336,
    },
    {
        "model": "Gboard pt-BR next-word prediction, MF-DP-FTRL (1000 bands, 2000 rounds)",
        "noise_multiplier": 8.35,
        "bands": 1000,
        "min_separation": 1428,
        "max_participations": 2,
        "published_rho": 0.014342572340349278,
        "published_epsilon": 0.9935500950539097,
    },
    {
        "model": "Gboard es-US next-word prediction, MF-DP-FTRL (1000 bands, 2000 rounds)",
        "noise_multiplier": 8.35,
        "bands": 1000,
        "min_separation": 1132,
        "max_participations": 2,
        "published_rho": 0.014342572340349278,
        "published_epsilon": 0.9935500950539097,
    },
)
MF_SOURCE = f"{REPO} mf_dpftrl_matrices/README.md and privacy_accounting.ipynb at {HEAD[:8]}"
MF_DELTA = 1e-10
#: dp_ftrl/README.md at db264810: the largest noise multiplier reaching each accuracy, 100 a round.
README_NOISE = (
    {"accuracy": 0.245, "tree": "the paper's tree (arXiv v1)", "noise_multiplier": 0.067},
    {"accuracy": 0.245, "tree": "efficient tree (Honaker)", "noise_multiplier": 0.149},
    {"accuracy": 0.23, "tree": "the paper's tree (arXiv v1)", "noise_multiplier": 0.268},
    {"accuracy": 0.23, "tree": "efficient tree (Honaker)", "noise_multiplier": 0.387},
)
README_ROUNDS, README_COHORT = 1600, 100
#: Figure 2c (fig2c.png at db264810), approximate: (report goal M, user-level epsilon) read by eye.
FIG2C = {
    (0.245, 0.067): ((17000, 10.5), (10000, 16.0), (5800, 23.0), (3400, 35.5), (2600, 49.0)),
    (0.23, 0.268): ((1950, 10.5), (1130, 15.5), (660, 25.0), (380, 32.0), (300, 49.0)),
    (0.245, 0.149): ((17000, 4.5), (10000, 7.0), (4400, 11.5), (1500, 23.5), (870, 40.5)),
}
#: Figure 2a (fig2a.png at db264810), approximate: test accuracy (%) at the user-level epsilons shown.
FIG2A_EPSILONS = (2.0, 2.9, 4.7, 8.6, 19.8)
FIG2A = {
    "DP-FTRLM, efficient tree": (16.1, 17.1, 17.6, 19.9, 20.9),
    "DP-FTRLM": (13.4, 15.6, 17.1, 19.2, 20.5),
    "DP-SGDM (amplified)": (17.1, 17.5, 18.0, 18.3, 18.9),
    "DP-SGDM, no amplification": (13.0, 14.4, 14.8, 17.1, 18.5),
}
FIG2A_NONPRIVATE = 25.1
#: multi_epoch_dp_matrix_factorization/images/stackoverflow.png, approximate: accuracy at delta 1e-6.
MF_FIGURE_EPSILONS = (2.0, 8.85, 17.6)
MF_FIGURE = {
    "DP-GDM, 2052 epochs": (0.2408, 0.2528, 0.2537),
    "MF6, 6 epochs": (0.2323, 0.2490, 0.2527),
    "MF1, 6 epochs": (0.2297, 0.2467, 0.2520),
    "MF1, 1 epoch (Denisov et al. 2022)": (0.1968, 0.2410, 0.2452),
    "Honaker, 6 epochs (Kairouz et al. 2021)": (0.2097, 0.2395, 0.2467),
    "DP-SGDM, 6 epochs": (0.2268, 0.2345, 0.2373),
}
MF_FIGURE_NONPRIVATE = {"server lr 1.0": 0.2542, "server lr 0.5": 0.2470}
MF_FIGURE_DELTA = 1e-6
SO_BANDMF_PARTICIPATIONS = 6  # so_bandmf: 2052 rounds of 1000 at 342,477 users, 342 bands


def _privacy() -> tuple[Any, Any, Any]:
    """The composition, mechanism descriptors and DP-FTRL privacy module (imported from the checkout)."""
    sys.path.insert(0, str(ROOT))
    from fl_app.privacy import composition, events
    from strategies.dp_ftrl import privacy

    return composition, events, privacy


def gaussian_epsilons(noise_multiplier: float, *, delta: float) -> dict[str, float | None]:
    """The RDP and PLD epsilon dpfl gives one Gaussian release, and the exact one (Balle & Wang 2018)."""
    import dp_accounting

    composition, events, _ = _privacy()
    report = composition.compose_epsilon({events.Gaussian(noise_multiplier): 1}, delta=delta, method="pld")
    return {
        "rdp": report.rdp,
        "pld": report.pld,
        "analytic": float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta)),
    }


def dp_ftrl_deployment() -> dict[str, Any]:
    """The Gboard DP-FTRL model: the worst tree sensitivity, rho and epsilon, both trees."""
    _, _, dp_ftrl = _privacy()
    p = GBOARD_DP_FTRL
    rows = {}
    for tree in ("complete", "online"):
        start = time.perf_counter()
        squared = dp_ftrl.worst_tree_sensitivity(
            steps=p["steps"],
            max_participations=p["max_participations"],
            separation=p["min_separation"] + 1,
            tree=tree,
        )
        z = p["noise_multiplier"]
        rows[tree] = {
            "squared_sensitivity": squared,
            "rho": squared / (2 * z**2),
            **gaussian_epsilons(z / math.sqrt(squared), delta=p["delta"]),
            "seconds": time.perf_counter() - start,
        }
    return {**p, "dpfl": rows}


def mf_deployments() -> list[dict[str, Any]]:
    """The MF-DP-FTRL models: epsilon from the published rho's sensitivity, and with unit columns."""
    rows = []
    for p in GBOARD_MF:
        sigma = p["noise_multiplier"]
        squared = 2 * p["published_rho"] * sigma**2  # rho = S / (2 sigma^2): the matrix's S
        unit = p["max_participations"]  # dpfl's banded C: unit columns, one per participation
        rows.append(
            {
                **p,
                "source": MF_SOURCE,
                "delta": MF_DELTA,
                "squared_sensitivity_from_rho": squared,
                "dpfl": gaussian_epsilons(sigma / math.sqrt(squared), delta=MF_DELTA),
                "dpfl_unit_columns": {
                    "squared_sensitivity": unit,
                    "rho": unit / (2 * sigma**2),
                    **gaussian_epsilons(sigma / math.sqrt(unit), delta=MF_DELTA),
                },
            }
        )
    return rows


def tree_epsilon(noise_multiplier: float, *, cohort: int, delta: float) -> dict[str, float | None]:
    """The epsilon of dpfl's DP-FTRL (a new tree each epoch) at ``cohort`` a round, README_ROUNDS rounds."""
    composition, events, _ = _privacy()
    epoch = STACK_OVERFLOW_USERS // cohort
    full, rest = divmod(README_ROUNDS, epoch)
    history: dict[Any, int] = {}
    if full:
        history[events.TreeAggregation(noise_multiplier, epoch)] = full
    if rest:
        history[events.TreeAggregation(noise_multiplier, rest)] = 1
    report = composition.compose_epsilon(history, delta=delta, method="pld")
    return {"epsilon": report.epsilon, "method": report.method, "rdp": report.rdp, "pld": report.pld}


def readme_rows() -> list[dict[str, Any]]:
    """The README's noise multipliers at 100 a round: dpfl's epsilon (the so_dp_ftrl preset's delta)."""
    return [
        {
            **row,
            "rounds": README_ROUNDS,
            "cohort": README_COHORT,
            "dpfl_delta_1e-5": tree_epsilon(row["noise_multiplier"], cohort=README_COHORT, delta=1e-5),
            "dpfl_delta_1e-6": tree_epsilon(row["noise_multiplier"], cohort=README_COHORT, delta=1e-6),
        }
        for row in README_NOISE
    ]


#: The one-tree reading is computed only where its dynamic programme has at most this many states.
MAX_TREE_STATES = 2_000_000


def one_tree_epsilon(noise_multiplier: float, *, cohort: int, delta: float) -> dict[str, Any] | None:
    """The same run accounted as ONE tree over all rounds, every node counted (no restart).

    A user then takes part once an epoch, ``342,477 // cohort`` rounds apart, in one tree of
    README_ROUNDS leaves: the worst squared sensitivity of the complete tree
    (:func:`strategies.dp_ftrl.privacy.worst_tree_sensitivity`), one Gaussian release. None where the
    dynamic programme would be too large (small epochs, many participations).
    """
    composition, events, dp_ftrl = _privacy()
    separation = STACK_OVERFLOW_USERS // cohort
    participations = math.ceil(README_ROUNDS / separation)
    states = (participations + 1) * (separation + 1)
    for k in range(README_ROUNDS.bit_length()):
        if separation < 2**k <= README_ROUNDS:
            states *= min(participations, -(-(2**k) // separation)) + 1
    if states > MAX_TREE_STATES:
        return None
    squared = dp_ftrl.worst_tree_sensitivity(
        steps=README_ROUNDS, max_participations=participations, separation=separation, tree="complete"
    )
    gaussian = events.Gaussian(noise_multiplier / math.sqrt(squared))
    report = composition.compose_epsilon({gaussian: 1}, delta=delta, method="pld")
    return {"squared_sensitivity": squared, "rdp": report.rdp, "pld": report.pld}


def fig2c_rows() -> list[dict[str, Any]]:
    """Figure 2c's report goals: dpfl's epsilon of noise z M / 100 on the sum of M, one tree an epoch."""
    rows = []
    for (accuracy, z), points in FIG2C.items():
        for cohort, read in points:
            rows.append(
                {
                    "accuracy": accuracy,
                    "noise_multiplier_at_100": z,
                    "report_goal": cohort,
                    "noise_multiplier": z * cohort / README_COHORT,
                    "epsilon_read": read,
                    "epochs": README_ROUNDS / (STACK_OVERFLOW_USERS // cohort),
                    "dpfl_delta_1e-6": tree_epsilon(z * cohort / README_COHORT, cohort=cohort, delta=1e-6),
                    "dpfl_one_tree_delta_1e-6": one_tree_epsilon(
                        z * cohort / README_COHORT, cohort=cohort, delta=1e-6
                    ),
                }
            )
    return rows


def mf_figure_rows() -> list[dict[str, Any]]:
    """The noise one release needs for each epsilon of the MF figure, and dpfl's so_bandmf z for it."""
    import dp_accounting

    rows = []
    for epsilon in MF_FIGURE_EPSILONS:
        sigma = float(dp_accounting.get_sigma_gaussian(epsilon, MF_FIGURE_DELTA))
        check = gaussian_epsilons(sigma, delta=MF_FIGURE_DELTA)
        rows.append(
            {
                "epsilon": epsilon,
                "single_release_noise_multiplier": sigma,
                "dpfl_pld_epsilon_of_it": check["pld"],
                "so_bandmf_noise_multiplier": sigma * math.sqrt(SO_BANDMF_PARTICIPATIONS),
            }
        )
    return rows


def numbers() -> dict[str, Any]:
    """Everything the page shows, published beside dpfl's."""
    return {
        "gboard_dp_ftrl": dp_ftrl_deployment(),
        "gboard_mf": mf_deployments(),
        "readme": readme_rows(),
        "fig2c": fig2c_rows(),
        "fig2a": {"epsilons": FIG2A_EPSILONS, "accuracy_percent": FIG2A, "non_private": FIG2A_NONPRIVATE},
        "mf_figure": {
            "epsilons": MF_FIGURE_EPSILONS,
            "accuracy": MF_FIGURE,
            "non_private": MF_FIGURE_NONPRIVATE,
            "noise": mf_figure_rows(),
        },
    }


def _g(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def tables(data: dict[str, Any]) -> str:
    """The generated block of the page: one table per source."""
    lines: list[str] = []
    d = data["gboard_dp_ftrl"]
    lines += [
        "**Gboard DP-FTRL (es-ES)**: z = 7, 2000 rounds, at most 6 participations at least 314 rounds "
        "apart, delta 1e-10.",
        "",
        "| accounting | squared sensitivity S | rho-zCDP | epsilon (RDP) | epsilon (PLD) "
        "| epsilon (exact Gaussian) |",
        "|---|---|---|---|---|---|",
        f"| published (notebook) | - | {d['published_rho']:.2f} | {d['published_epsilon']:.2f} | - | - |",
    ]
    for tree, label in (
        ("complete", "dpfl, every node of the tree (the notebook's count)"),
        ("online", "dpfl, one node per round (dpfl's own tree)"),
    ):
        r = d["dpfl"][tree]
        lines.append(
            f"| {label} | {r['squared_sensitivity']} | {r['rho']:.4f} | {_g(r['rdp'])} | {_g(r['pld'])} | "
            f"{_g(r['analytic'])} |"
        )
    lines += [
        "",
        "**Gboard MF-DP-FTRL**: delta 1e-10.",
        "",
        "| model | sigma | bands | min separation | participations | published rho / epsilon | "
        "dpfl epsilon (PLD; exact) at the published S | dpfl with unit columns: rho / epsilon (PLD) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["gboard_mf"]:
        u = r["dpfl_unit_columns"]
        lines.append(
            f"| {r['model']} | {r['noise_multiplier']} | {r['bands']} | {r['min_separation']} | "
            f"{r['max_participations']} | {r['published_rho']:.4g} / {r['published_epsilon']:.4g} | "
            f"{_g(r['dpfl']['pld'], 6)}; {_g(r['dpfl']['analytic'], 6)} "
            f"(S = {r['squared_sensitivity_from_rho']:.4g}) | "
            f"{u['rho']:.4g} / {_g(u['pld'])} |"
        )
    lines += [
        "",
        "**DP-FTRL README (db264810)**: 100 clients a round, 1600 rounds, clip 1; each user at most once "
        "(160,000 participations < 342,477 users).",
        "",
        "| target accuracy | tree | largest z (published) | dpfl epsilon, delta 1e-5 "
        "| dpfl epsilon, delta 1e-6 |",
        "|---|---|---|---|---|",
    ]
    for r in data["readme"]:
        a, b = r["dpfl_delta_1e-5"], r["dpfl_delta_1e-6"]
        lines.append(
            f"| {r['accuracy']:.1%} | {r['tree']} | {r['noise_multiplier']} "
            f"| {_g(a['epsilon'])} ({a['method']}) | "
            f"{_g(b['epsilon'])} ({b['method']}) |"
        )
    lines += [
        "",
        "**Figure 2c (fig2c.png, approximate readings)**: the report goal M at which each target is "
        "reached with user-level epsilon; dpfl: noise z M / 100 on the sum of M, 1600 rounds, a new tree "
        "each epoch of 342,477 // M rounds, delta 1e-6.",
        "",
        "| target | z at 100 | report goal M (read) | epsilon (read, approx.) | epochs "
        "| dpfl epsilon (RDP) | dpfl epsilon (PLD) | one tree, every node: S, epsilon (RDP) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["fig2c"]:
        e = r["dpfl_delta_1e-6"]
        lines.append(
            f"| {r['accuracy']:.1%} | {r['noise_multiplier_at_100']} | ~{r['report_goal']:,} "
            f"| ~{r['epsilon_read']} | "
            f"{r['epochs']:.1f} | {_g(e['rdp'])} | {_g(e['pld'])} "
            f"| {_one_tree(r['dpfl_one_tree_delta_1e-6'])} |"
        )
    f = data["fig2a"]
    lines += [
        "",
        "**Figure 2a (fig2a.png, approximate readings)**: test accuracy (%) at user-level epsilon "
        f"(non-private: ~{f['non_private']}).",
        "",
        "| curve | " + " | ".join(f"eps ~{e}" for e in f["epsilons"]) + " |",
        "|---|" + "---|" * len(f["epsilons"]),
    ]
    for name, values in f["accuracy_percent"].items():
        lines.append(f"| {name} | " + " | ".join(f"~{v}" for v in values) + " |")
    m = data["mf_figure"]
    lines += [
        "",
        "**Multi-epoch MF, Stack Overflow (stackoverflow.png, approximate readings)**: test accuracy at "
        "epsilon, delta 1e-6 (non-private: ~0.2542 at server lr 1.0, ~0.2470 at 0.5).",
        "",
        "| mechanism | " + " | ".join(f"eps ~{e}" for e in m["epsilons"]) + " |",
        "|---|" + "---|" * len(m["epsilons"]),
    ]
    for name, values in m["accuracy"].items():
        lines.append(f"| {name} | " + " | ".join(f"~{v}" for v in values) + " |")
    lines += [
        "",
        "| epsilon (delta 1e-6) | noise of one release at the matrix's sensitivity "
        "| dpfl's PLD epsilon of it | "
        "dpfl `so_bandmf` z (6 participations, unit columns) |",
        "|---|---|---|---|",
    ]
    for r in m["noise"]:
        lines.append(
            f"| {r['epsilon']} | {r['single_release_noise_multiplier']:.4f} "
            f"| {_g(r['dpfl_pld_epsilon_of_it'])} | "
            f"{r['so_bandmf_noise_multiplier']:.4f} |"
        )
    return "\n".join(lines)


def _one_tree(row: dict[str, Any] | None) -> str:
    return (
        "- (not computed: too many states)"
        if row is None
        else f"{row['squared_sensitivity']}, {_g(row['rdp'])}"
    )


def write_doc(data: dict[str, Any]) -> None:
    """Replace the generated block of the page."""
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{tables(data)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-doc", action="store_true", help="replace the generated block of the page")
    args = parser.parse_args(argv)
    data = numbers()
    print(json.dumps(data, indent=1, default=str))
    if args.write_doc:
        write_doc(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
