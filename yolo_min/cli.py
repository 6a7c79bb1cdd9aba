"""The options shared by the command lines and the Python face: keyword arguments checked against
a command's argparse parser, and a command's main run with one-line errors (exit 2)."""

import argparse
import difflib
import gc
import os

from . import dist


class ConfigError(ValueError):
    """A bad argument or input file, found before any work: one actionable line, exit 2."""


def parse_kwargs(parser, kwargs, fixed=None, only=None):
    """The parser's defaults updated by kwargs, each checked as the command line would check it:
    TypeError for an unknown option, a missing one or a value of the wrong type, ValueError for a
    value outside the choices. fixed: values the caller sets (not options); only: the options
    taken (default: all; the others keep their defaults, required or not)."""
    fixed = fixed or {}
    actions = {action.dest: action for action in parser._actions if action.dest != "help"}
    valid = [name for name in only or actions if name not in fixed]
    unknown = [name for name in kwargs if name not in valid]
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"unknown option {', '.join(map(repr, unknown))}{hint}; "
            f"the options are: {', '.join(valid)}"
        )
    missing = [name for name in valid if actions[name].required and name not in kwargs]
    if missing:
        raise TypeError(f"missing option(s): {', '.join(map(repr, missing))}")
    values = {name: action.default for name, action in actions.items()}
    for name, value in (kwargs | fixed).items():
        values[name] = check_value(actions[name], name, value)
    return argparse.Namespace(**values)


def check_value(action, name, value):
    """value as the command line would have parsed it for action, else TypeError or ValueError."""
    kind = action.type or str
    if action.nargs == 0:
        expected = "True or False"
        ok = isinstance(value, bool)
    elif action.nargs == "?":
        # --resume: True (the newest run), False, or a path
        expected = "True, False or a path"
        ok = isinstance(value, (bool, str, os.PathLike))
    elif action.nargs == "+":
        expected = f"a list of {kind.__name__}"
        # "+": one value at least
        ok = (
            isinstance(value, (list, tuple))
            and all(is_kind(v, kind) for v in value)
            and len(value) > 0
        )
    else:
        expected = kind.__name__
        # None: the default of an option that has none (--imgsz: the task's)
        ok = is_kind(value, kind) or (value is None and action.default is None)
    if not ok:
        raise TypeError(f"option {name}={value!r:.60}: expected {expected}")
    if action.choices and value not in action.choices and value != action.default:
        raise ValueError(
            f"option {name}={value!r:.60}: expected one of {', '.join(map(str, action.choices))}"
        )
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def is_kind(value, kind):
    """Whether value is what argparse makes with kind: int (not bool), float (or int), str (or
    a path)."""
    accepted = {float: (int, float), str: (str, os.PathLike)}.get(kind, kind)
    # a bool is an int to Python, but no number to argparse
    return not isinstance(value, bool) and isinstance(value, accepted)


def run_command(main, parser, errors=(ValueError, OSError)):
    """main(the command line); errors (a bad argument, weights or file): one line, exit 2."""
    # torch's millions of objects: no collection walks them again, not even at exit
    gc.freeze()
    try:
        main(parser.parse_args())
    except errors as e:
        why = f"{parser.prog}: error: {str(e).splitlines()[0]}\n"
        # under torchrun every rank fails alike: rank 0 says it once
        parser.exit(2, why if dist.env_rank() == 0 else None)
