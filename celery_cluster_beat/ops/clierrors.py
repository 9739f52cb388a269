"""How every ``cluster-beat`` command fails: one line per problem on stderr, passwords masked,
stored text escaped, exit code 1 (3 on a claim database no beat has prepared), never a traceback.

Apart from :mod:`.cli` so that a command kept in a module of its own (:mod:`.adopt`) fails the
same way without importing the command group (which imports it: a cycle). Light to import: Celery
imports the command declarations in every ``celery`` process.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, List

import click

from ..errors import ConfigError
from ..leader.urls import mask_url, mask_urls_in

__all__ = ["NOT_INITIALISED", "boundary", "for_terminal", "problems", "fail"]

#: Exit code of every command but ``check`` on a claim database no beat has prepared yet (nothing to
#: read or act on: not an error of the command, nor a success a script should read on).
NOT_INITIALISED = 3


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [""])[0] or type(exc).__name__


def problems(exc: BaseException) -> List[str]:
    """One line per problem of *exc*, passwords masked."""
    if isinstance(exc, ConfigError):
        lines = [p.replace("\n", " ") for p in exc.problems]
    elif isinstance(exc, (ValueError, LookupError)) and not _no_such_schedule(exc):
        lines = [_first_line(exc)]
    elif _no_such_schedule(exc):
        lines = [str(exc)]
    else:
        lines = [f"{type(exc).__name__}: {_first_line(exc)}" if not _is_ours(exc) else _first_line(exc)]
    # Our own messages quote names and descriptions: only what is spelled as a URL is masked in them
    # (mask_url's ``user:secret@host`` rule would mangle ``a:b:c@d``); a driver's text (or ours
    # wrapping one: a __cause__), everything.
    mask = mask_urls_in if _is_ours(exc) and exc.__cause__ is None else mask_url
    return [mask(line) for line in lines]


def _no_such_schedule(exc: BaseException) -> bool:
    report = sys.modules.get(f"{__package__}.report")  # loaded already when it raised one
    return report is not None and isinstance(exc, report.NoSuchSchedule)


def _is_ours(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("celery_cluster_beat")


def fail(lines: Iterable[str]) -> None:
    for line in lines:
        click.echo(f"error: {for_terminal(line)}", err=True)
    raise click.exceptions.Exit(1)


def for_terminal(value: Any) -> str:
    """*value* as the terminal gets it: stored text with its control and format characters
    escaped (:func:`~celery_cluster_beat.config.values.printable`); None as ``-``."""
    from ..config.values import printable  # not at import: Celery imports this module in every process

    return "-" if value is None else printable(str(value))


def _not_initialised(exc: BaseException) -> bool:
    from ..store.errors import StoreNotInitialised  # loaded already when the store raised it

    return isinstance(exc, StoreNotInitialised)


def boundary(fun: Callable[..., Any]) -> Callable[..., Any]:
    """Every error becomes one line per problem on stderr and exit code 1, never a traceback
    (a claim database not initialised yet: its one line and :data:`NOT_INITIALISED`)."""

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fun(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            fail(["interrupted"])
        except Exception as exc:
            if "celery_cluster_beat.store.errors" in sys.modules and _not_initialised(exc):
                for line in problems(exc):
                    click.echo(for_terminal(line), err=True)
                raise click.exceptions.Exit(NOT_INITIALISED)
            fail(problems(exc))

    return wrapper
