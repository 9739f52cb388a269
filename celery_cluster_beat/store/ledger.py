"""placeholder (in progress)"""
from __future__ import annotations


class LedgerQueries:
    pass
