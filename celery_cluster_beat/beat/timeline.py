"""The scheduler's queue of next fires: a binary heap that can also change or drop one schedule.

Beat needs the earliest next fire on every tick (a peek), and a schedule that
is changed or removed at run time must move or leave the queue at once, in
O(log n), without a walk over every schedule and without dead items left
behind. A heap of ``(instant, name)`` with each name's position kept beside it
does both.
"""
from __future__ import annotations

from datetime import datetime
from typing import Dict, Iterator, List, Optional, Tuple

Item = Tuple[datetime, str]


class Timeline:
    """Next fire instant per schedule name; the earliest first (ties by name)."""

    __slots__ = ("_heap", "_pos")

    def __init__(self, items: Optional[Dict[str, datetime]] = None) -> None:
        self._heap: List[Item] = sorted((at, name) for name, at in (items or {}).items())
        self._pos: Dict[str, int] = {name: i for i, (_, name) in enumerate(self._heap)}

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __contains__(self, name: object) -> bool:
        return name in self._pos

    def __iter__(self) -> Iterator[Item]:
        """Items in no particular order."""
        return iter(list(self._heap))

    def get(self, name: str) -> Optional[datetime]:
        i = self._pos.get(name)
        return None if i is None else self._heap[i][0]

    def peek(self) -> Item:
        """The earliest ``(instant, name)``; IndexError when empty."""
        return self._heap[0]

    def set(self, name: str, at: datetime) -> None:
        """Schedule *name* at *at*, replacing its previous instant if it had one."""
        i = self._pos.get(name)
        if i is None:
            self._heap.append((at, name))
            self._pos[name] = len(self._heap) - 1
            self._up(len(self._heap) - 1)
            return
        old = self._heap[i]
        self._heap[i] = (at, name)
        if (at, name) < old:
            self._up(i)
        else:
            self._down(i)

    def remove(self, name: str) -> Optional[datetime]:
        """Drop *name*; its instant, or None when it was not queued."""
        i = self._pos.pop(name, None)
        if i is None:
            return None
        at = self._heap[i][0]
        last = self._heap.pop()
        if i < len(self._heap):
            self._heap[i] = last
            self._pos[last[1]] = i
            self._up(i)
            self._down(self._pos[last[1]])
        return at

    def due_before(self, limit: datetime) -> List[Item]:
        """Every item due before *limit*, in no particular order; visits only those and their
        children (a heap's subtree is never earlier than its root)."""
        h = self._heap
        found: List[Item] = []
        stack = [0] if h else []
        while stack:
            i = stack.pop()
            if h[i][0] < limit:
                found.append(h[i])
                stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(h))
        return found

    def pop(self) -> Item:
        """Remove and return the earliest item."""
        item = self._heap[0]
        self.remove(item[1])
        return item

    def _swap(self, i: int, j: int) -> None:
        h = self._heap
        h[i], h[j] = h[j], h[i]
        self._pos[h[i][1]] = i
        self._pos[h[j][1]] = j

    def _up(self, i: int) -> None:
        h = self._heap
        while i:
            parent = (i - 1) >> 1
            if h[i] < h[parent]:
                self._swap(i, parent)
                i = parent
            else:
                return

    def _down(self, i: int) -> None:
        h = self._heap
        n = len(h)
        while True:
            smallest = i
            for child in (2 * i + 1, 2 * i + 2):
                if child < n and h[child] < h[smallest]:
                    smallest = child
            if smallest == i:
                return
            self._swap(i, smallest)
            i = smallest
