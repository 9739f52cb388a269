"""Fixtures of the store tests: stores on the test's own database, and a plain engine beside them."""
from __future__ import annotations

from typing import List

import pytest
import sqlalchemy as sa

from celery_cluster_beat.store import ClaimStore


@pytest.fixture
def make_store(db_url):
    """Open stores on the test's database (one per simulated node); all closed afterwards."""
    stores: List[ClaimStore] = []

    def make(node: str = "node-a", **kwargs) -> ClaimStore:
        store = ClaimStore(db_url, node_id=node, **kwargs)
        store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def raw(db_url):
    """A plain engine on the same database, to look (and write history) behind the store's back."""
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()
