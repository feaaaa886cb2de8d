"""A disk cache of calibrations, shared by every process and run that asks for the same one.

A calibration (:mod:`fl_app.privacy.calibration`) searches for the smallest noise, or the largest
per-use epsilon, that meets a budget, evaluating the accountant's composition tens of times (with
PLD, from a fraction of a second to seconds per search). Its answer is a pure function of its
arguments and of the accounting code, and many processes ask for the same one: each job of a sweep
over seeds or models at one budget, a resumed run, each ServerApp of a deployment, the budget
calculator. The first process to search stores the answer here; the others read it.

**A stored answer is checked, never trusted**: it is used only when it is a positive normal float64
(every search answers one: a noise multiplier, an epsilon) and meets the target under one
evaluation of the accountant's own composition (the test each step of the search makes); anything
else the file holds (zero, a negative, a subnormal, a NaN or an infinity, another type or shape, a
value the accountant cannot evaluate) is searched again and overwritten. So a stale or edited file
can cost tightness (more noise than needed), never the budget, and never the run. The key covers the
search (its name), its arguments (floats exactly), the sources of the accounting modules
(:data:`CODE_MODULES`), the installed dp-accounting, numpy and scipy, and the compiled code of every
function and the value of every setting those modules hold while the process runs (one replaced at run
time, as a test's mutant of the accountant, gets keys of its own), so an answer of other code is not
found.
Calibrations hold no secret: they follow from the published configuration.

Location: ``$DPFL_CALIBRATION_CACHE`` if set, else ``$DPFL_DATA_HOME/calibrations``
(``~/.cache/dpfl/calibrations``); ``DPFL_CALIBRATION_CACHE=off`` turns the cache off. At most
:data:`MAX_FILES` answers are kept (the least recently written go first).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import sys
import types
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from fl_app.data.partition_cache import cache_folder, code_version, keep_newest, write_npz

#: The environment variable naming the cache folder (or ``off``).
CACHE_ENV = "DPFL_CALIBRATION_CACHE"
#: Answers kept (each file is about 300 bytes).
MAX_FILES = 2048
#: The modules whose source decides a calibration's answer.
CODE_MODULES = (
    "fl_app.privacy.calibration",
    "fl_app.privacy.composition",
    "fl_app.privacy.events",
    "fl_app.privacy.rdp",
)
CODE_PACKAGES = ("dp-accounting", "numpy", "scipy")

Argument = float | int | str


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is off."""
    return cache_folder(CACHE_ENV, "calibrations")


@functools.cache
def _code_digest() -> str:
    return hashlib.sha256(code_version(CODE_MODULES, CODE_PACKAGES)).hexdigest()


#: Module-level values of these types are part of :func:`live_code_digest` (settings such as
#: ``PLD_VALUE_DISCRETIZATION``; not the memo dictionaries).
_SETTING_TYPES = (bool, int, float, str, bytes, tuple, frozenset, type(None))


def live_code_digest() -> str:
    """A digest of what the accounting modules hold now: functions, their classes' methods, settings.

    The same for every process running the installed code; another whenever one of those functions
    or module-level settings was replaced (``module.function = other``, ``module.SETTING = value``),
    whatever the replacement's source.
    """
    digest = hashlib.sha256()
    for name in CODE_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attribute, value in sorted(vars(module).items()):
            if attribute.startswith("__"):
                continue
            if isinstance(value, _SETTING_TYPES):
                digest.update(attribute.encode() + b"=" + _constant_bytes(value))
                continue
            members = vars(value).items() if inspect.isclass(value) and value.__module__ == name else []
            for label, member in [(attribute, value), *((f"{attribute}.{k}", v) for k, v in members)]:
                code = getattr(inspect.unwrap(member), "__code__", None) if callable(member) else None
                if code is not None:
                    digest.update(label.encode() + b"\0" + _code_bytes(code))
    return digest.hexdigest()


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's instructions, names and constants, the same in every process.

    (``marshal`` would write a set constant in its hash order, which differs between processes.)
    """
    parts = [code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode()]
    return b"\0".join([*parts, *(_constant_bytes(constant) for constant in code.co_consts)])


def _constant_bytes(constant: object) -> bytes:
    if isinstance(constant, types.CodeType):
        return _code_bytes(constant)
    if isinstance(constant, tuple | frozenset):
        items = [_constant_bytes(item) for item in constant]
        return b"(" + b",".join(sorted(items) if isinstance(constant, frozenset) else items) + b")"
    return repr(constant).encode()


def _exact(value: Argument) -> str:
    """An argument as text that tells all values apart (a float by its exact ``float.hex``)."""
    if isinstance(value, bool) or not isinstance(value, float | int | str):
        raise TypeError(f"a cached calibration takes numbers and strings, got {value!r}")
    return value.hex() if isinstance(value, float) else repr(value)


def calibration_key(search: str, arguments: Mapping[str, Argument]) -> str:
    """The cache key of the calibration ``search`` on ``arguments`` with the code installed now."""
    exact = {name: _exact(value) for name, value in sorted(arguments.items())}
    code = {"installed": _code_digest(), "live": live_code_digest()}
    text = json.dumps({"search": search, "arguments": exact, "code": code}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def checked_calibration(
    search: str,
    arguments: Mapping[str, Argument],
    *,
    compute: Callable[[], float],
    meets: Callable[[float], bool],
) -> float:
    """The answer stored for ``search`` on ``arguments`` if it ``meets`` the target, else ``compute()``.

    Parameters
    ----------
    search : str
        The calibration's name (a function of :mod:`fl_app.privacy.calibration`).
    arguments : Mapping[str, float | int | str]
        Everything its answer depends on besides the code.
    compute : Callable[[], float]
        The search itself; its answer is stored for the next process.
    meets : Callable[[float], bool]
        Whether an answer meets the target (one evaluation of the accountant's composition).

    """
    folder = cache_dir()
    if folder is None:
        return compute()
    path = folder / f"{calibration_key(search, arguments)}.npz"
    stored = _load(path)
    if stored is not None and passes(meets, stored):
        return stored
    answer = compute()
    if write_npz(path, {"answer": np.float64(answer)}):
        keep_newest(folder, keep=MAX_FILES)
    return answer


def passes(meets: Callable[[float], bool], answer: float) -> bool:
    """Whether ``answer`` ``meets`` the target; False when the check cannot evaluate it (it raises).

    An answer read from elsewhere is data: an accountant that overflows or refuses the value says
    that it is not an answer, and the search (which runs the same accountant) is what decides.
    """
    try:
        return bool(meets(answer))
    except Exception:  # any failure of the check rejects the stored value
        return False


def _load(path: Path) -> float | None:
    """The answer stored at ``path``; None if absent, unreadable, or not a positive normal float64."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            value = stored["answer"]
    except (OSError, EOFError, KeyError, ValueError, TypeError, zipfile.BadZipFile):
        return None
    if value.dtype != np.float64 or value.shape != ():
        return None
    answer = float(value)
    return answer if math.isfinite(answer) and answer >= sys.float_info.min else None
