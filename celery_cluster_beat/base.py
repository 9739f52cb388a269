"""What the concerns above :mod:`.schedules` share and nobody owns alone.

Size limits that the validation (config) and the columns (store) must agree
on, and the base of our string-valued enums. Imports nothing of the package.
"""
from __future__ import annotations

import sys
from enum import Enum
from importlib import import_module
from typing import Any, Callable, Dict, List, Tuple

#: Longest schedule name: the width of the claim table's name columns.
MAX_NAME_LENGTH = 255
#: Longest node id: it is stored in the same kind of column.
MAX_NODE_ID_LENGTH = 255
#: Error texts are kept for operators, not archived: rows stay small.
MAX_ERROR_CHARS = 2000


class StrEnum(str, Enum):
    """An enum whose members are their string values, in comparisons, logs and JSON alike.

    Members equal their values (``Outcome.SENT == "sent"``), so signal receivers
    and rows written before the enum existed keep matching; a typo in a member
    name is an AttributeError instead of a silent mismatch.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """*text* cut to *limit* characters, marked with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def lazy_attributes(module: str, table: Dict[str, str], names: List[str]) -> Tuple[Callable[[str], Any],
                                                                                  Callable[[], List[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) that import each name of *table*
    from its submodule on first use and keep it: Celery imports our packages in every ``celery``
    process, which should pay only for what it uses."""
    package = sys.modules[module]

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(import_module(table[name], module), name)
        setattr(package, name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(package)) | set(names))

    return __getattr__, __dir__
