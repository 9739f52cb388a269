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
