"""The queue of next fires behaves like a sorted mapping name -> instant, whatever the order of
changes and removals (a model-based property test), and keeps no item of a removed schedule."""
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings, strategies as st

from celery_cluster_beat.beat.timeline import Timeline

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
names = st.sampled_from([f"s{i}" for i in range(12)])
ops = st.lists(st.one_of(
    st.tuples(st.just("set"), names, st.integers(0, 50)),
    st.tuples(st.just("remove"), names, st.just(0)),
    st.tuples(st.just("pop"), st.just(""), st.just(0)),
), max_size=200)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_timeline_matches_a_sorted_model(steps):
    tl, model = Timeline(), {}
    for op, name, sec in steps:
        if op == "set":
            tl.set(name, T0 + timedelta(seconds=sec))
            model[name] = T0 + timedelta(seconds=sec)
        elif op == "remove":
            assert tl.remove(name) == model.pop(name, None)
        elif model:
            expected = min((at, n) for n, at in model.items())
            assert tl.pop() == expected
            del model[expected[1]]
        assert len(tl) == len(model)
        assert sorted(tl) == sorted((at, n) for n, at in model.items())
        if model:
            assert tl.peek() == min((at, n) for n, at in model.items())
        for n in model:
            assert tl.get(n) == model[n]


def test_a_removed_schedule_leaves_no_item():
    tl = Timeline({"a": T0, "b": T0 + timedelta(seconds=1)})
    tl.remove("a")
    assert list(tl) == [(T0 + timedelta(seconds=1), "b")] and "a" not in tl


def test_due_before_returns_exactly_the_items_earlier_than_the_limit():
    """Used to build messages ahead for the entries due soon: nothing due later is visited into
    the result, nothing due earlier is missed, whatever the heap's shape after updates."""
    import random

    rng = random.Random(7)
    base = datetime(2030, 1, 1, tzinfo=timezone.utc)
    t = Timeline()
    expected = {}
    for i in range(500):
        at = base + timedelta(seconds=rng.randrange(0, 3600))
        t.set(f"e{i}", at)
        expected[f"e{i}"] = at
    for i in range(0, 500, 3):  # moves and removals reshape the heap
        at = base + timedelta(seconds=rng.randrange(0, 3600))
        t.set(f"e{i}", at)
        expected[f"e{i}"] = at
    for i in range(1, 500, 7):
        t.remove(f"e{i}")
        del expected[f"e{i}"]
    limit = base + timedelta(seconds=900)
    assert sorted(t.due_before(limit)) == sorted((at, n) for n, at in expected.items() if at < limit)
    assert t.due_before(base) == []
    assert Timeline().due_before(limit) == []
