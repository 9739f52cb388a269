"""placeholder (in progress)"""
from __future__ import annotations


class StoredScheduleQueries:
    pass
