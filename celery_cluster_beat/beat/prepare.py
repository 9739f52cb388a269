"""Building messages ahead of their fire, in the loop's idle time.

A message is built once per entry and only stamped per occurrence (see
:mod:`..messages`); building is the costly part. Built at the fire, a burst of
thousands of new entries would wait for every build. So, while nothing is due for
:data:`PREPARE_MARGIN`, each tick spends at most :data:`PREPARE_BUDGET` building the
messages of entries due within :data:`PREPARE_AHEAD`, and the burst only stamps.
Apart from the due pass because it must never delay a send: it yields whenever a
fire comes close, and the loop's sleep is shortened only while it has work left.
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import List, Tuple

from .state import NodeState

#: Messages of entries due within this many seconds are built ahead of their fire.
PREPARE_AHEAD = 60.0
#: Seconds one tick may spend building them; the rest is built on the next ticks.
PREPARE_BUDGET = 0.05
#: No building when the next fire is closer than this: sends come first.
PREPARE_MARGIN = 0.5
#: Seconds between two looks for entries due soon whose message is not built yet.
PREPARE_EVERY = 10.0


class MessagePrep:
    """Entries due soon whose message is still to be built, and when to look for more."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        #: Entries due soon whose message is still to be built ahead (latest first).
        self.todo: List[Tuple[datetime, str]] = []
        self.next_look = 0.0

    def run(self) -> None:
        """Build, a slice a tick, the messages of entries due within :data:`PREPARE_AHEAD`, while
        nothing is due for :data:`PREPARE_MARGIN`: a burst then only stamps them."""
        node = self.node
        mono = time.monotonic()
        if not node.active or node.pipeline is None or not node.queue:
            return
        if not self.todo and mono < self.next_look:
            return
        now = node.clock.now()
        if (node.queue.peek()[0] - now).total_seconds() < PREPARE_MARGIN:
            return
        if not self.todo:
            self.next_look = mono + PREPARE_EVERY
            soon = node.queue.due_before(now + timedelta(seconds=PREPARE_AHEAD))
            have = node.pipeline.publisher.templates.has
            self.todo = sorted((item for item in soon if not have(item[1])), reverse=True)
        deadline = mono + PREPARE_BUDGET
        while self.todo and time.monotonic() < deadline:
            at, name = self.todo.pop()
            entry = node.entries.get(name)
            if entry is not None and entry.enabled:
                node.pipeline.prepare(entry, at)

    def preparing(self) -> bool:
        """Messages are being built ahead and the next fire leaves time for more."""
        node = self.node
        return bool(self.todo) and bool(node.queue) and \
            (node.queue.peek()[0] - node.clock.now()).total_seconds() >= PREPARE_MARGIN
