"""What the concerns above :mod:`.schedules` share and nobody owns alone.

Size limits that the validation (config) and the columns (store) must agree
on, and the base of our string-valued enums. Imports nothing of the package.
"""
from __future__ import annotations

from enum import Enum

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
