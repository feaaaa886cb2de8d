"""dpfl's BLT (``strategy=dp_blt``) against jax_privacy 2.0.0's, setting by setting.

Usage (from the repository root; ``bash scripts/setup_jax_env.sh`` first, which builds ``.venv-jax``)::

    .venv-jax/bin/python -P benchmarks/blt_jax_privacy.py reference         # writes the fixture
    .venv/bin/python -P benchmarks/blt_jax_privacy.py compare [--write-doc]   # dpfl against it

``reference`` (jax_privacy's side; needs jax, so it runs in ``.venv-jax`` only) optimises a BLT for each
setting of :data:`CASES` (rounds ``n``, minimum separation ``b``, participations ``k``, buffers or
``auto``, max or mean error) with ``jax_privacy.matrix_factorization.buffered_toeplitz``
(``optimize_loss`` on the ``LossFn`` that ``optimize`` builds for a fixed number of buffers,
``optimize`` itself for ``auto``) and records the BLT's parameters, its loss (``LossFn.loss``), its max
error at the schema's sensitivity, its squared sensitivity (``toeplitz.minsep_sensitivity_squared``;
``buffered_toeplitz.sensitivity_squared``, the closed form, for single participation), the noise its
streaming ``C^{-1}`` (``inverse_as_streaming_matrix``, what ``noise_addition.
matrix_factorization_privatizer`` runs) makes of fixed normals, and the epsilon of the release for a
few noise multipliers (``accounting.SingleReleaseTrainingAccountant``, PLD and RDP). It writes
``tests/data/blt_jax_privacy.json``, which ``tests/test_dp_blt.py`` reads, so the suite needs no jax.

``compare`` (dpfl's side, in ``.venv``) optimises dpfl's BLT for the same settings
(``strategies.dp_blt.buffered_toeplitz.optimal_blt``) and prints, per setting, both losses and max
errors and their ratio, the sensitivity dpfl computes for jax_privacy's parameters against
jax_privacy's, and dpfl's epsilon (its accountant's composition of the worst client's charges,
:mod:`strategies.dp_blt.privacy`) against jax_privacy's; ``--write-doc`` replaces the generated block
of ``docs/benchmarks/blt.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "blt_jax_privacy.json"
DOC = ROOT / "docs" / "benchmarks" / "blt.md"
BEGIN = "<!-- BLT_JAX_PRIVACY:BEGIN (benchmarks/blt_jax_privacy.py compare --write-doc) -->"
END = "<!-- BLT_JAX_PRIVACY:END -->"
#: (rounds n, minimum separation b, participations k, buffers or "auto", error): single participation
#: (k = 1), the min-separation schema of dpfl's cyclic groups (the quick example's 15 and 100 rounds
#: of 10 groups, the so_blt preset's 2052 rounds of 342 groups), both errors.
CASES: tuple[tuple[int, int, int, int | str, str], ...] = (
    (5, 5, 1, "auto", "max"),
    (100, 1, 1, 1, "max"),
    (100, 1, 1, 3, "max"),
    (1000, 1, 1, "auto", "max"),
    (15, 10, 2, "auto", "max"),
    (100, 10, 10, 2, "max"),
    (100, 10, 10, "auto", "max"),
    (200, 20, 10, 3, "mean"),
    (2052, 342, 6, 3, "max"),
    (2052, 342, 6, "auto", "max"),
)
#: Noise multipliers whose epsilon is compared, at :data:`DELTAS`.
NOISE_MULTIPLIERS = (0.6, 1.0, 2.0, 5.0)
DELTAS = (1e-5, 1e-6)
#: The streaming noise: this many rounds of fixed normals with this many coordinates.
NOISE_ROUNDS, NOISE_WIDTH = 12, 3


def case_key(case: tuple[int, int, int, int | str, str]) -> str:
    """The fixture's name of a case."""
    n, b, k, buffers, kind = case
    return f"n={n},b={b},k={k},buffers={buffers},error={kind}"


# ----------------------------------------------------------------------------- jax_privacy's side


def reference() -> dict[str, Any]:
    """jax_privacy's numbers for every case (runs in ``.venv-jax``)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax_privacy.accounting import accountants, analysis
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt
    from jax_privacy.matrix_factorization import streaming_matrix, toeplitz

    normals = np.random.default_rng(20250101).standard_normal((NOISE_ROUNDS, NOISE_WIDTH))
    cases = {}
    for case in CASES:
        n, b, k, buffers, kind = case
        if k == 1 and kind == "max":
            loss_fn = bt.LossFn.build_closed_form_single_participation(n=n)
        else:
            loss_fn = bt.LossFn.build_min_sep(n=n, error=kind, min_sep=b, max_participations=k)
        start = time.perf_counter()
        if buffers == "auto":
            blt = bt.optimize(n=n, min_sep=b, max_participations=k, error=kind)
        else:
            blt, _ = bt.optimize_loss(loss_fn, num_buffers=int(buffers))
        seconds = time.perf_counter() - start
        inverse = blt.inverse()
        sens2 = float(
            toeplitz.minsep_sensitivity_squared(blt.toeplitz_coefs(n), min_sep=b, max_participations=k)
        )
        errors = toeplitz.per_query_error(noising_coef=inverse.toeplitz_coefs(n))
        noise = streaming_matrix.multiply_array(blt.inverse_as_streaming_matrix(), jnp.asarray(normals))
        cases[case_key(case)] = {
            "rounds": n,
            "min_separation": b,
            "max_participations": k,
            "buffers": buffers,
            "error": kind,
            "buf_decay": np.asarray(blt.buf_decay).tolist(),
            "output_scale": np.asarray(blt.output_scale).tolist(),
            "inverse_buf_decay": np.asarray(inverse.buf_decay).tolist(),
            "inverse_output_scale": np.asarray(inverse.output_scale).tolist(),
            "loss": float(loss_fn.loss(blt)),
            "max_error": sens2 * float(jnp.max(errors)),
            "sensitivity_squared": sens2,
            "closed_form_sensitivity_squared": float(bt.sensitivity_squared(blt, n)) if k == 1 else None,
            "streaming_noise": np.asarray(noise).tolist(),
            "optimise_seconds": seconds,
        }
    epsilons = {}
    for delta in DELTAS:
        for z in NOISE_MULTIPLIERS:
            params = analysis.DpParams(noise_multipliers=z, num_samples=1000, delta=delta, batch_size=100)
            row = {}
            for name, config in (
                ("pld", accountants.PldAccountantConfig()),
                ("rdp", accountants.RdpAccountantConfig()),
            ):
                row[name] = float(analysis.SingleReleaseTrainingAccountant(config).compute_epsilon(1, params))
            epsilons[f"z={z},delta={delta}"] = row
    from importlib.metadata import version

    return {
        "source": {
            "command": ".venv-jax/bin/python -P benchmarks/blt_jax_privacy.py reference",
            "setup": "bash scripts/setup_jax_env.sh",
            "versions": {p: version(p) for p in ("jax_privacy", "jax", "dp-accounting", "numpy")},
            "machine": f"{platform.machine()}, {jax.default_backend()}",
            "calls": (
                "buffered_toeplitz.optimize_loss(LossFn.build_closed_form_single_participation(n) for k = 1 "
                "and max error, else LossFn.build_min_sep(n, error, min_sep, max_participations), "
                "num_buffers); buffered_toeplitz.optimize(n, min_sep, max_participations, error) for auto; "
                "LossFn.loss(blt); toeplitz.minsep_sensitivity_squared(blt.toeplitz_coefs(n), min_sep, "
                "max_participations); max_error = that x max(toeplitz.per_query_error(noising_coef="
                "blt.inverse().toeplitz_coefs(n))); streaming_matrix.multiply_array("
                "blt.inverse_as_streaming_matrix(), normals); SingleReleaseTrainingAccountant(config)"
                ".compute_epsilon(1, DpParams(noise_multipliers=z, delta=delta))"
            ),
            "normals": normals.tolist(),
        },
        "cases": cases,
        "epsilons": epsilons,
    }


# ----------------------------------------------------------------------------- dpfl's side


def compare(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimiser, sensitivity, noise and epsilon of dpfl against every recorded case."""
    from fl_app.privacy.composition import compose_epsilon
    from strategies.dp_blt.buffered_toeplitz import (
        BLTNoise,
        BufferedToeplitz,
        ParticipationSchema,
        error,
        loss,
        optimal_blt,
        sensitivity_squared,
    )
    from strategies.dp_blt.privacy import worst_history

    rows = []
    for key, case in data["cases"].items():
        schema = ParticipationSchema(case["rounds"], case["min_separation"], case["max_participations"])
        theirs = BufferedToeplitz(tuple(case["buf_decay"]), tuple(case["output_scale"]))
        start = time.perf_counter()
        ours = optimal_blt(schema, buffers=case["buffers"], kind=case["error"])
        seconds = time.perf_counter() - start
        our_sens2 = sensitivity_squared(ours, schema)
        noise = BLTNoise(theirs, sigma=1.0)
        normals = np.asarray(data["source"]["normals"])
        streamed = np.array([noise.draw([row], _Fixed(row))[0] for row in normals])
        eps: dict[str, list[float]] = {"pld": [], "rdp": []}
        for label, expected in data["epsilons"].items():
            z, delta = (float(part.split("=")[1]) for part in label.split(","))
            history = worst_history(ours, schema, noise_multiplier=z)
            for method, differences in eps.items():
                got = compose_epsilon(history, delta=delta, method=method).epsilon
                differences.append(got / expected[method] - 1)
        rows.append(
            {
                "case": key,
                "jax_buffers": len(case["buf_decay"]),
                "dpfl_buffers": ours.buffers,
                "jax_loss": case["loss"],
                "dpfl_loss": loss(ours, schema, kind=case["error"]),
                "jax_max_error": case["max_error"],
                "dpfl_max_error": our_sens2 * error(ours.inverse(), schema.rounds, kind="max"),
                "sensitivity_difference": abs(
                    sensitivity_squared(theirs, schema) - case["sensitivity_squared"]
                ),
                "noise_difference": float(np.max(np.abs(streamed - np.asarray(case["streaming_noise"])))),
                "pld_epsilon_difference": max(eps["pld"], key=abs),
                "rdp_epsilon_difference": max(eps["rdp"], key=abs),
                "jax_seconds": case["optimise_seconds"],
                "dpfl_seconds": seconds,
            }
        )
    return rows


class _Fixed:
    """A stand-in generator whose ``normal`` returns the given standard normals times the scale."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def normal(self, loc: float, scale: float, size: Any = None) -> np.ndarray:
        return loc + scale * np.reshape(self.values, size)


def table(rows: list[dict[str, Any]], data: dict[str, Any]) -> str:
    """The page's generated block: the settings, both sides and their ratios."""
    versions = ", ".join(f"{k} {v}" for k, v in data["source"]["versions"].items())
    lines = [
        f"jax_privacy's side: `{data['source']['command']}` ({versions}, CPU); dpfl's side: "
        "`.venv/bin/python -P benchmarks/blt_jax_privacy.py compare --write-doc`, on a 2-core machine "
        "shared with other work (seconds are noisy).",
        "",
        "| setting (n rounds, b separation, k participations) | buffers jax / dpfl | loss jax | loss dpfl "
        "| dpfl / jax | max error dpfl / jax | sens^2 diff | noise diff | PLD epsilon dpfl / jax - 1 "
        "| RDP epsilon dpfl / jax - 1 | seconds jax / dpfl |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['jax_buffers']} / {row['dpfl_buffers']} | {row['jax_loss']:.6g} | "
            f"{row['dpfl_loss']:.6g} | {row['dpfl_loss'] / row['jax_loss']:.7f} | "
            f"{row['dpfl_max_error'] / row['jax_max_error']:.7f} | {row['sensitivity_difference']:.1e} | "
            f"{row['noise_difference']:.1e} | {row['pld_epsilon_difference']:.1e} | "
            f"{row['rdp_epsilon_difference']:.1e} | "
            f"{row['jax_seconds']:.1f} / {row['dpfl_seconds']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``reference`` or ``compare`` (the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("reference", help="jax_privacy's side (in .venv-jax): writes the fixture")
    compare_parser = sub.add_parser("compare", help="dpfl's side (in .venv): prints the table")
    compare_parser.add_argument("--write-doc", action="store_true", help=f"also write the block of {DOC}")
    args = parser.parse_args(argv)
    if args.command == "reference":
        FIXTURE.write_text(json.dumps(reference(), indent=1) + "\n")
        print(f"wrote {FIXTURE.relative_to(ROOT)}")
        return 0
    sys.path.insert(0, str(ROOT))
    data = json.loads(FIXTURE.read_text())
    text = table(compare(data), data)
    print(text)
    if args.write_doc:
        from benchmarks.tables import with_generated_block

        page = with_generated_block(DOC.read_text(), text, begin=BEGIN, end=END)
        if page is None:
            print(f"{DOC.relative_to(ROOT)} has no block {BEGIN} ... {END}", file=sys.stderr)
            return 1
        DOC.write_text(page)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
