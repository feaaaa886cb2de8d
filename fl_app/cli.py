"""``dpfl``: one command for everything dpfl does.

``dpfl run``, ``dpfl report``, ``dpfl privacy`` and ``dpfl deploy`` are the same programs as
``python -m fl_app``, ``python -m fl_app.report``, ``python -m fl_app.privacy`` and
``python scripts/local_deployment.py``. ``dpfl --help`` (and ``dpfl run --help``) lists the config
groups with their options and the main keys with their meaning, read from ``conf/`` without
importing Hydra, Flower or torch, so it answers at once.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from fl_app.config.conf_dir import CONF_DIR, config_groups

PROJECT_ROOT = CONF_DIR.parent
DEPLOY_SCRIPT = PROJECT_ROOT / "scripts" / "local_deployment.py"

COMMANDS = """\
Commands
  dpfl run [key=value ...]          one run; -m for a Hydra multirun sweep (python -m fl_app)
  dpfl report DIR [--out DIR]       tables and plots of many runs (python -m fl_app.report)
  dpfl privacy COMMAND [--options]  budget calculator: dp-fedavg, dp-sgd, rr, bnn, nbafl, laplace,
                                    compose (python -m fl_app.privacy; dpfl privacy --help)
  dpfl deploy start|status|stop     a local SuperLink and SuperNodes (scripts/local_deployment.py)

Examples
  dpfl run +experiment=quick strategy=dp_fedavg     a quick example of any strategy (about 15-160 s)
  dpfl run strategy=dp_fedavg privacy.epsilon=4
  dpfl run -m strategy=fedavg,dp_fedavg privacy.epsilon=1,2,4
  dpfl run -m +experiment=compare_cross_device hydra.sweep.dir=multirun/cross_device
  dpfl report multirun/cross_device
  dpfl privacy dp-fedavg --epsilon 8 --delta 1e-5 --rate 0.1 --rounds 100
"""

_KEY_LINE = re.compile(r"^(?P<key>[a-z_]+):\s*(?P<value>[^#\n]*?)\s*#\s*(?P<meaning>.+)$")


def main_keys(conf: Path = CONF_DIR) -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every commented top-level key of ``conf/config.yaml``."""
    keys = []
    for line in (conf / "config.yaml").read_text().splitlines():
        match = _KEY_LINE.match(line)
        if match:
            keys.append((match["key"], match["value"], match["meaning"]))
    return keys


def overview() -> str:
    """The text of ``dpfl --help``."""
    lines = [
        "dpfl: differentially private federated learning on Flower, with honest privacy accounting.",
        "",
        COMMANDS,
        "Config groups (choose with group=option; presets with +experiment=NAME; "
        "arms of a preset's sweep, e.g. cross_device=NAME)",
    ]
    for group, options in config_groups().items():
        lines.append(f"  {group + ':':<14}{', '.join(options)}")
    lines += ["", "Main keys (key=value; any key of conf/ can be set the same way, e.g. strategy.clip=0.5)"]
    for key, default, meaning in main_keys():
        lines.append(f"  {key:<19}{default:<8}{meaning}")
    lines += [
        "",
        "Each strategy's own keys: conf/strategy/<name>.yaml (strategy.<key>=...). "
        "The resolved configuration of a run: dpfl run <overrides> --cfg job.",
        "Docs: README.md, docs/, BENCHMARKS.md.",
    ]
    return "\n".join(lines)


def print_overview() -> int:
    """Print :func:`overview` (also into a pipe that closes early, e.g. ``| head``)."""
    try:
        print(overview(), flush=True)
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dpfl`` console command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        return print_overview()
    command, rest = args[0], args[1:]
    if command == "run":
        if any(arg in ("-h", "--help") for arg in rest):
            return print_overview()
        from fl_app.__main__ import main as run_main
        from fl_app.engine.ray_session import SESSION

        SESSION.ends_with_process = argv is None  # the console command, not a Python caller
        sys.argv = ["dpfl run", *rest]
        return run_main()
    if command == "report":
        from fl_app.report.sweep import main as report_main

        return report_main(rest)
    if command == "privacy":
        from fl_app.report.calculator import main as privacy_main

        return privacy_main(rest)
    if command == "deploy":
        module = runpy.run_path(str(DEPLOY_SCRIPT), run_name="dpfl_deploy")
        return int(module["main"](rest))
    print(
        f"dpfl: error: unknown command {command!r}; use one of run, report, privacy, deploy (dpfl --help)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
