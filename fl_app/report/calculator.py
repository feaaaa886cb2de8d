"""Budget calculator: python -m fl_app.privacy <command> [--options]  (also: dpfl privacy ...).

Prints one JSON object on stdout. Every number comes from the same functions
the strategies call (fl_app/privacy/calibration.py and composition.py). Bad
arguments print one line on stderr and exit with status 2.

Commands
--------
dp-fedavg --epsilon E --delta D --rate Q --rounds T    -> noise_multiplier (DP-FedAvg: z of T
                                                          Poisson-sampled Gaussian rounds, q = m / N)
dp-sgd   --epsilon E --delta D --rate Q --steps S      -> noise_multiplier (DP-SGD: z of S steps,
                                                          q = batch / local data size)
rr       --epsilon E --k K --classes C                 -> beta (PrivateKT Lemma 1)
bnn      --epsilon E --delta D --rounds T              -> gamma (DPFL-BNN Theorem 1, client level)
         --gamma G --delta D --rounds T                -> epsilon (client level)
         [--input-shape 1x28x28 --classes 10 | --bits B | --per-coordinate]
         client level (default): all d bits of an upload, d of the platform's binary
         CNN for the input shape (81,848 for 28x28); --per-coordinate is the
         document's reading (one bit: NOT a guarantee for a client's data set)
nbafl    --epsilon E --delta D --clip C --m M --l L --t T --n N [--k K] [--unit {client,document_record}]
         [--calibration {accountant,analytic,classic}] [--amplification {two_sided,document}]
                                                       -> sigma_up, sigma_down, epsilon_client (the
                                                          guarantee; accountant, L uploads) and
                                                          epsilon_record (the document's reading)
laplace  --epsilon E [--sensitivity S]                 -> scale
         --tau TAU --prob P [--sensitivity S]          -> epsilon
compose  --mechanism {rr,binary_rr,laplace,gaussian} (its parameter) --count N --delta D
                                                       -> epsilon_rdp [, epsilon_basic, epsilon_pld]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from fl_app.privacy import calibration
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    Gaussian,
    Laplace,
    Mechanism,
    RandomizedResponse,
    SampledGaussian,
)
from strategies.laplace_eval import privacy as laplace_cal
from strategies.nbafl import privacy as nbafl_cal
from strategies.privatekt import privacy as kt_cal


class _OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m fl_app.privacy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    _add_noise_multiplier_commands(commands)
    rr = commands.add_parser("rr", help="PrivateKT keep probability beta")
    rr.add_argument("--epsilon", type=float, required=True, help="per-report epsilon (K labels)")
    rr.add_argument("--k", type=int, required=True, help="labels per report (KT samples)")
    rr.add_argument("--classes", type=int, required=True, help="number of classes C")
    _add_bnn_command(commands)
    _add_nbafl_command(commands)
    laplace = commands.add_parser("laplace", help="Laplace scale or tail epsilon")
    laplace.add_argument("--epsilon", type=float)
    laplace.add_argument("--tau", type=float)
    laplace.add_argument("--prob", type=float)
    laplace.add_argument(
        "--sensitivity", type=float, default=2.0, help="L1 sensitivity (2 for probability vectors)"
    )
    _add_compose_command(commands)
    return parser


def _add_noise_multiplier_commands(commands: Any) -> None:
    """Add ``dp-fedavg`` and ``dp-sgd``: the noise multiplier of T sampled Gaussian uses."""
    for name, count, meaning, what in (
        ("dp-fedavg", "rounds", "rounds T", "DP-FedAvg noise multiplier (client level, Poisson cohorts)"),
        ("dp-sgd", "steps", "DP-SGD steps", "DP-SGD noise multiplier (record level)"),
    ):
        command = commands.add_parser(name, help=what)
        command.add_argument("--epsilon", type=float, required=True, help="target epsilon of the whole run")
        command.add_argument("--delta", type=float, required=True)
        command.add_argument(
            "--rate", type=float, required=True, help="sampling rate q in (0, 1] (1: no sampling)"
        )
        command.add_argument(f"--{count}", type=int, required=True, help=meaning)
        command.add_argument("--accountant", choices=("rdp", "pld"), default="pld")


def _add_bnn_command(commands: Any) -> None:
    """Add ``bnn``: DPFL-BNN's gamma from epsilon or epsilon from gamma, and the unit they count."""
    bnn = commands.add_parser("bnn", help="DPFL-BNN gamma <-> epsilon")
    target = bnn.add_mutually_exclusive_group(required=True)
    target.add_argument("--epsilon", type=float)
    target.add_argument("--gamma", type=float)
    bnn.add_argument("--delta", type=float, required=True)
    bnn.add_argument("--rounds", type=int, required=True)
    unit = bnn.add_mutually_exclusive_group()
    unit.add_argument(
        "--bits",
        type=int,
        default=None,
        help="RR_gamma uses per round: d, the bits of a client's upload (default: d of the "
        "platform's binary CNN for --input-shape and --classes)",
    )
    unit.add_argument(
        "--per-coordinate",
        action="store_true",
        help="the document's per-coordinate accounting (one bit per round; not client level)",
    )
    bnn.add_argument("--input-shape", default="1x28x28", help="channels x height x width (default 1x28x28)")
    bnn.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")


def _add_nbafl_command(commands: Any) -> None:
    """Add ``nbafl``: NbAFL's uplink and downlink noise for a target epsilon."""
    nbafl = commands.add_parser("nbafl", help="NbAFL uplink/downlink noise")
    nbafl.add_argument("--epsilon", type=float, required=True)
    nbafl.add_argument("--delta", type=float, required=True)
    nbafl.add_argument("--clip", type=float, required=True, help="clipping threshold C")
    nbafl.add_argument("--m", type=int, required=True, help="smallest local data set size")
    nbafl.add_argument("--l", type=int, required=True, help="most uploads of any client (L)")
    nbafl.add_argument("--t", type=int, required=True, help="aggregation rounds T")
    nbafl.add_argument("--n", type=int, required=True, help="clients N")
    nbafl.add_argument("--k", type=int, default=None, help="clients per round (K-random scheduling)")
    nbafl.add_argument("--calibration", choices=nbafl_cal.NBAFL_CALIBRATIONS, default="accountant")
    nbafl.add_argument(
        "--unit",
        choices=nbafl_cal.NBAFL_UNITS,
        default="client",
        help="what --epsilon calibrates: client (proven for multi-step SGD) or the document's record reading",
    )
    nbafl.add_argument(
        "--amplification",
        choices=nbafl_cal.NBAFL_AMPLIFICATIONS,
        default="two_sided",
        help="K < N downlink: two-sided subsampling bound, or the document's one-sided b and gamma",
    )
    nbafl.add_argument("--accountant", choices=("rdp", "pld"), default="pld")


def _add_compose_command(commands: Any) -> None:
    """Add ``compose``: the epsilon of N uses of one mechanism."""
    compose = commands.add_parser("compose", help="compose a mechanism N times")
    compose.add_argument("--mechanism", required=True, choices=("rr", "binary_rr", "laplace", "gaussian"))
    compose.add_argument("--epsilon", type=float, help="rr / laplace: per-use epsilon")
    compose.add_argument("--classes", type=int, help="rr: number of classes")
    compose.add_argument("--gamma", type=float, help="binary_rr: keep probability 1/2 + gamma")
    compose.add_argument("--sigma", type=float, help="gaussian: noise multiplier (std / L2 sensitivity)")
    compose.add_argument(
        "--sampling-rate", type=float, default=1.0, help="gaussian: Poisson sampling rate (1 = no sampling)"
    )
    compose.add_argument("--count", type=int, required=True)
    compose.add_argument("--delta", type=float, required=True)
    compose.add_argument(
        "--accountant",
        choices=("rdp", "pld"),
        default="pld",
        help="pld also reports epsilon_pld (rdp is always reported)",
    )


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise ValueError(f"{args.command} needs {', '.join(missing)}")


def _mechanism(args: argparse.Namespace) -> Mechanism:
    if args.mechanism == "rr":
        _require(args, "epsilon", "classes")
        return RandomizedResponse(args.epsilon, args.classes)
    if args.mechanism == "binary_rr":
        _require(args, "gamma")
        return BinaryRandomizedResponse(args.gamma)
    if args.mechanism == "laplace":
        _require(args, "epsilon")
        return Laplace(args.epsilon)
    _require(args, "sigma")
    if args.sampling_rate < 1:
        return SampledGaussian(args.sigma, args.sampling_rate)
    return Gaussian(args.sigma)


def _bnn_bits(args: argparse.Namespace) -> tuple[int, str]:
    """RR_gamma uses per round and the unit they account for (client level unless --per-coordinate)."""
    if args.per_coordinate:
        return 1, (
            "one coordinate of one upload, in isolation (the document's Theorem 1; NOT a guarantee "
            "for a client's data set)"
        )
    if args.bits is not None:
        if args.bits < 1:
            raise ValueError(f"--bits must be >= 1, got {args.bits}")
        return int(args.bits), f"one client's data set (client level: {args.bits} bits per upload)"
    try:
        shape = tuple(int(part) for part in str(args.input_shape).lower().split("x"))
    except ValueError as error:
        raise ValueError(f"--input-shape={args.input_shape!r}: must look like 1x28x28") from error
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--input-shape={args.input_shape!r}: must look like 1x28x28")
    from fl_app.learning.models import build_model  # torch: only for this default

    model = build_model("bnn_cnn", shape, int(args.classes))
    bits = int(sum(p.numel() for p in model.parameters()))
    return bits, (
        f"one client's data set (client level: all d={bits} bits of an upload of the binary CNN on "
        f"{args.input_shape} inputs, {args.classes} classes)"
    )


#: Why a calibrated noise can spend an epsilon of exactly 0 (dp-accounting's RDP conversion, its
#: bound through the KL divergence: ``delta >= sqrt(1 - exp(-rdp))``).
ZERO_EPSILON_NOTE = (
    "exactly 0, not a rounding: at this noise the mechanism is (0, delta)-DP (its total variation "
    "distance is at most delta: the RDP accountant's KL bound), so it meets every epsilon >= 0; no "
    "smaller noise meets the requested epsilon"
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Execute one calculator command and return its JSON-ready answer."""
    if args.command in ("dp-fedavg", "dp-sgd"):
        return _noise_multiplier_answer(args)
    if args.command == "rr":
        beta = kt_cal.privatekt_keep_probability(epsilon=args.epsilon, k=args.k, num_classes=args.classes)
        return {"beta": beta, "epsilon_per_label": args.epsilon / args.k}
    if args.command == "bnn":
        return _bnn_answer(args)
    if args.command == "nbafl":
        return _nbafl_answer(args)
    if args.command == "laplace":
        if args.epsilon is not None:
            return {"scale": laplace_cal.laplace_scale(sensitivity=args.sensitivity, epsilon=args.epsilon)}
        _require(args, "tau", "prob")
        return {
            "epsilon": laplace_cal.laplace_epsilon_for_tail(
                tau=args.tau, probability=args.prob, sensitivity=args.sensitivity
            )
        }
    return _compose_answer(args)


def _noise_multiplier_answer(args: argparse.Namespace) -> dict[str, Any]:
    """``dp-fedavg`` / ``dp-sgd``: the calibrated noise multiplier and the epsilon it spends."""
    uses = args.rounds if args.command == "dp-fedavg" else args.steps
    common = {"sampling_rate": args.rate, "rounds": uses, "delta": args.delta, "method": args.accountant}
    z = calibration.dp_fedavg_noise_multiplier(epsilon=args.epsilon, **common)
    spent = calibration.gaussian_epsilon(noise_multiplier=z, **common)
    answer = {"noise_multiplier": z, "epsilon": spent, "delta": args.delta, "accountant": args.accountant}
    if spent == 0.0:  # not a rounding: the accountant proves epsilon 0 at this delta
        answer["epsilon_note"] = ZERO_EPSILON_NOTE
    return answer


def _bnn_answer(args: argparse.Namespace) -> dict[str, Any]:
    """``bnn``: gamma for a target epsilon, or the epsilon a gamma spends, with the unit it protects."""
    # here, not at the top: the package imports its strategy and torch (3 s), which no other
    # command (nor a refused argument) should wait for
    from strategies.dpfl_bnn import privacy as bnn_cal

    bits, unit = _bnn_bits(args)
    context = {"bits_per_round": bits, "uses": args.rounds * bits, "unit": unit}
    if args.epsilon is not None:
        gamma = bnn_cal.bnn_gamma(
            epsilon=args.epsilon, delta=args.delta, rounds=args.rounds, bits_per_round=bits
        )
        return {"gamma": gamma, **context}
    epsilon = bnn_cal.binary_rr_epsilon(
        gamma=args.gamma, delta=args.delta, rounds=args.rounds, bits_per_round=bits
    )
    return {"epsilon": epsilon, **context}


def _nbafl_answer(args: argparse.Namespace) -> dict[str, Any]:
    """``nbafl``: the uplink and downlink noise, and the client- and record-level epsilons of L uploads."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", calibration.ClassicGaussianRangeWarning)
        sigma_up = nbafl_cal.nbafl_uplink_sigma(
            epsilon=args.epsilon,
            delta=args.delta,
            clip=args.clip,
            min_dataset_size=args.m,
            exposures=args.l,
            calibration=args.calibration,
            method=args.accountant,
            unit=args.unit,
        )
    sigma_down = nbafl_cal.nbafl_downlink_sigma(
        epsilon=args.epsilon,
        delta=args.delta,
        clip=args.clip,
        min_dataset_size=args.m if args.unit == "document_record" else 1,
        exposures=args.l,
        num_rounds=args.t,
        num_clients=args.n,
        clients_per_round=args.k,
        amplification=args.amplification,
    )
    record = sigma_up / nbafl_cal.nbafl_sensitivity(clip=args.clip, min_dataset_size=args.m)
    client = sigma_up / nbafl_cal.nbafl_client_sensitivity(clip=args.clip)
    answer: dict[str, Any] = {
        "sigma_up": sigma_up,
        "sigma_down": sigma_down,
        "epsilon_record": compose_epsilon(
            {Gaussian(record): args.l}, delta=args.delta, method=args.accountant
        ).epsilon,
        "epsilon_client": compose_epsilon(
            {Gaussian(client): args.l}, delta=args.delta, method=args.accountant
        ).epsilon,
        "note": "epsilon_client: the guarantee of NbAFL's multi-step local SGD; epsilon_record is "
        "the document's reading (valid only if an upload averaged per-record terms)",
    }
    if caught:
        answer["warning"] = str(caught[0].message)
    return answer


def _compose_answer(args: argparse.Namespace) -> dict[str, Any]:
    """``compose``: the epsilon of ``--count`` uses of one mechanism, by each accountant asked for."""
    report = compose_epsilon({_mechanism(args): args.count}, delta=args.delta, method=args.accountant)
    answer = {"epsilon_rdp": report.rdp, "rdp_order": report.rdp_order, "delta": args.delta}
    if report.basic is not None:
        answer["epsilon_basic"] = report.basic
    if report.pld is not None:
        answer["epsilon_pld"] = report.pld
    answer["epsilon"] = report.epsilon
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        answer = run(args)
    except (ValueError, TypeError) as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    unbounded = [
        key for key, value in answer.items() if isinstance(value, float) and not math.isfinite(value)
    ]
    if unbounded:
        values = ", ".join(f"{k}={answer[k]}" for k in unbounded)
        print(
            f"{parser.prog} {args.command}: error: the result is not a finite number ({values}): "
            "the arguments are outside the range where the answer can be represented",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(answer, allow_nan=False))
    return 0
