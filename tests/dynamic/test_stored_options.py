"""A stored schedule's options cannot change which task runs, its id or how its message is read.

Issue 20, item 2: stored-schedule ``options`` reached Celery nearly unchecked. ``{"headers":
{"task": ...}}`` made the worker run another task (kombu merges the caller's headers over Celery's
own), ``{"headers": {"id": ...}}`` forged the task id, ``link`` / ``link_error`` called any
registered task, ``serializer: "pickle"`` went out pickled. Now the API accepts only the options
that choose where a message goes and how long it may wait or run, the others only when the
application names them in ``cluster_beat_stored_options_allowed``, and Celery's protocol headers
and our own never; each refusal names the schedule, the field (``options.headers.task``) and the
reason. A row written past the API with such an option is never sent with it: beat records each
of its occurrences ``failed`` with the reason (the in-process late-pass rig of
tests/beat/test_isolation.py, on PostgreSQL).
"""
from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from celery import Celery

from beat.test_isolation import MISSED, Scene, _history  # the in-process late-pass rig
from celery_cluster_beat import ConfigError, every
from celery_cluster_beat.dynamic import StoredSchedules, entry_from_row
from celery_cluster_beat.store.types import naive_utc

PROTOCOL = ["task", "id", "eta", "expires", "root_id", "parent_id", "group", "group_index", "lang", "shadow",
            "retries", "timelimit", "argsrepr", "kwargsrepr", "origin", "ignore_result", "replaced_task_nesting",
            "stamped_headers", "stamps", "celery_beat_task"]
#: Read by kombu (compression) or RabbitMQ (CC, BCC: a copy per routing key), and any case of a reserved name.
TRANSPORT = ["compression", "CC", "BCC", "cc", "Bcc", "Compression", "Task", "ID", "Cluster_Beat_Node"]
OURS = ["cluster_beat_schedule", "cluster_beat_scheduled_at", "cluster_beat_node", "cluster_beat_attempt",
        "cluster_beat_check", "cluster_beat_anything_new"]
OPT_IN = ["link", "link_error", "serializer", "compression", "reply_to", "task_id", "shadow", "countdown", "eta",
          "retry_policy", "root_id", "parent_id", "group_id", "exchange"]


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _app(db_url: str, **conf) -> Celery:
    app = Celery("stored-options", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", beat_schedule={}, **conf)
    return app


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "claims.sqlite3"
    schedules = StoredSchedules(_app(f"sqlite:///{path}"))
    yield schedules
    schedules.close()


def _refused(api: StoredSchedules, options, field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        api.add("bad", "t.x", every(60), options=options)
    message = str(info.value)
    assert message.startswith(f"stored schedule 'bad': {field}: "), message
    assert reason in message, message
    assert "\n" not in message and api.get("bad") is None


@pytest.mark.parametrize("header", PROTOCOL + TRANSPORT + OURS)
def test_a_protocol_header_or_one_of_ours_is_refused_naming_the_field(api, header):
    _refused(api, {"headers": {header: "x"}}, f"options.headers.{header}", "reserved")


@pytest.mark.parametrize("key", OPT_IN)
def test_an_option_that_can_change_what_runs_is_refused_unless_the_application_allows_it(api, key):
    _refused(api, {key: "x"}, f"options.{key}", f"cluster_beat_stored_options_allowed = [{key!r}]")


@pytest.mark.parametrize("options, field, reason", [
    ({"colour": "red"}, "options.colour", "not an option a stored schedule may set"),
    ({"priority": 256}, "options.priority", "integer 0-255"),
    ({"priority": True}, "options.priority", "integer 0-255"),
    ({"priority": "5"}, "options.priority", "integer 0-255"),
    ({"queue": "q" * 256}, "options.queue", "longer than 255"),
    ({"queue": ""}, "options.queue", "expected a non-empty string"),
    ({"queue": 5}, "options.queue", "expected a string"),
    ({"queue": "amq.direct"}, "options.queue", "RabbitMQ reserves names starting with 'amq.'"),
    ({"routing_key": "a\x1bb"}, "options.routing_key", "control character"),
    ({"exchange": "reports"}, "options.exchange", "an exchange the broker does not have closes the channel"),
    ({"expires": "tomorrow"}, "options.expires", "expected a number of seconds"),
    ({"time_limit": -1}, "options.time_limit", "positive"),
    ({"soft_time_limit": 1e300}, "options.soft_time_limit", "at most"),
    ({"ignore_result": "yes"}, "options.ignore_result", "expected True or False"),
    ({"headers": ["task", "x"]}, "options.headers", "expected a dict"),
    ({"headers": {"x" * 256: 1}}, "options.headers." + "x" * 60, "longer than 255"),
    ({"headers": {"a": {"b": _nested(32)}}}, "options", "nested deeper than 32"),
])
def test_an_option_value_out_of_bounds_is_refused_naming_the_field(api, options, field, reason):
    _refused(api, options, field, reason)


def test_arguments_nested_past_what_json_recurses_through_are_refused_not_raised(api):
    deep: list = []
    for _ in range(5000):  # json.dumps raises RecursionError at about 1,000 levels
        deep = [deep]
    with pytest.raises(ConfigError, match="^stored schedule 'deep': args: nested deeper than 32 levels"):
        api.add("deep", "t.x", every(60), args=[deep])
    loop: dict = {}
    loop["self"] = loop  # a value that contains itself: bounded too
    with pytest.raises(ConfigError, match="^stored schedule 'loop': kwargs: nested deeper"):
        api.add("loop", "t.x", every(60), kwargs=loop)


def test_the_options_that_only_route_and_bound_a_message_are_stored_and_read_back(api):
    options = {"queue": "reports", "routing_key": "reports.eu", "priority": 9, "expires": 300,
               "time_limit": 60, "soft_time_limit": 50.5, "ignore_result": False,
               "headers": {"tenant": "acme", "trace": {"level": 2}}}
    s = api.add("routed", "t.x", every(60), options=options)
    assert s.options == options
    api.remove("routed")


def test_an_update_cannot_add_a_reserved_header_and_leaves_the_row_as_it_was(api):
    api.add("kept", "t.x", every(60), options={"queue": "q"})
    with pytest.raises(ConfigError, match="^stored schedule 'kept': options.headers.id: reserved"):
        api.update("kept", options={"queue": "q", "headers": {"id": "forged-id"}})
    assert api.get("kept").options == {"queue": "q"}
    api.remove("kept")


def test_a_row_with_options_now_refused_can_still_be_disabled_enabled_and_updated(api):
    """A row written past the API (or by a release before the allow-list) with an option now
    refused: an update that leaves the options alone keeps them as stored (beat still records each
    occurrence ``failed`` with the reason), and disable() and enable() work. Giving them again is
    refused. (Every update used to re-check the old options, so such a row could not be disabled.)"""
    api.add("legacy", "t.x", every(60), options={"queue": "q"})
    stored = json.dumps({"queue": "q", "retry_policy": {"max_retries": 3}}, sort_keys=True, separators=(",", ":"))
    engine = sa.create_engine(api.app.conf.cluster_beat_db_url)
    with engine.begin() as conn:
        table = sa.table("cluster_beat_stored_schedules", sa.column("name"), sa.column("options"))
        conn.execute(sa.update(table).where(table.c.name == "legacy").values(options=stored))
    engine.dispose()
    try:
        assert api.disable("legacy").enabled is False
        assert api.enable("legacy").enabled is True
        changed = api.update("legacy", args=[7], schedule=every(120))
        assert changed.args == [7] and changed.options == {"queue": "q", "retry_policy": {"max_retries": 3}}
        with pytest.raises(ConfigError, match="^stored schedule 'legacy': options.retry_policy: not allowed"):
            api.update("legacy", options=changed.options)
        (row,) = api.store.stored_get(["legacy"])
        assert row.options == stored
        assert "options.retry_policy: not allowed" in entry_from_row(row, app=api.app).refused
    finally:
        api.remove("legacy")


def test_the_application_allows_an_option_by_name_and_still_never_a_protocol_header(tmp_path):
    app = _app(f"sqlite:///{tmp_path}/c.sqlite3",
               cluster_beat_stored_options_allowed=["serializer", "link", "exchange"])
    with StoredSchedules(app) as api:
        s = api.add("opted", "t.x", every(60), options={"serializer": "json", "link": {"task": "t.after"},
                                                        "exchange": "reports"})
        assert s.options == {"serializer": "json", "link": {"task": "t.after"}, "exchange": "reports"}
        with pytest.raises(ConfigError, match="options.exchange: expected a string"):
            api.add("typed", "t.x", every(60), options={"exchange": ["x"]})
        with pytest.raises(ConfigError, match="options.headers.compression: reserved"):
            api.add("still", "t.x", every(60), options={"headers": {"compression": "zlib"}})
        with pytest.raises(ConfigError, match="options.headers.task: reserved"):
            api.add("still", "t.x", every(60), options={"serializer": "json", "headers": {"task": "t.other"}})
        with pytest.raises(ConfigError, match="options.reply_to: not allowed"):
            api.add("other", "t.x", every(60), options={"reply_to": "q"})
        with pytest.raises(ConfigError, match="options.serializer: expected a string"):
            api.add("typed", "t.x", every(60), options={"serializer": 5})


@pytest.mark.parametrize("value, reason", [
    ("serializer", "expected a list of option names"),
    (["serialiser"], "'serialiser' is not an option a stored schedule can be allowed"),
    (["headers.task"], "is not an option"),
    ([5], "5 is not an option"),
])
def test_a_bad_allow_list_setting_is_a_start_up_error_naming_it(tmp_path, value, reason):
    with pytest.raises(ConfigError) as info:
        StoredSchedules(_app(f"sqlite:///{tmp_path}/c.sqlite3", cluster_beat_stored_options_allowed=value))
    assert str(info.value).startswith("setting cluster_beat_stored_options_allowed: ") and reason in str(info.value)


@pytest.mark.timeout(90)
def test_a_row_given_a_reserved_header_past_the_api_is_never_sent_and_its_occurrences_fail(pg_url, redis_url):
    """Two stored schedules ran until T; then, with no beat running, one's row is given a
    ``headers.task``, a forged ``headers.id`` and a ``link`` directly in the database. The next beat's
    late pass (catch-up ``all``) sends every occurrence of the other, with its own header, and records
    each of the bad one's ``failed``, the reason naming the fields; nothing reaches the broker for it.

    Before: the row was read as given and each occurrence went out as a message for ``evil.task``
    under the forged id, with a link to another task."""
    s = Scene(pg_url, redis_url, {"cfg": {"task": "t.record", "schedule": every(60)}})
    try:
        with StoredSchedules(s.app) as api:
            api.add("good", "t.record", every(60), options={"headers": {"tenant": "acme"}})
            api.add("bad", "t.record", every(60))
        t, due = _history()
        for name in ("cfg", "good", "bad"):
            s.ran_until(name, t)
        forged = {"headers": {"task": "evil.task", "id": "forged-id"}, "link": {"task": "evil.after"}}
        table = sa.table("cluster_beat_stored_schedules", sa.column("name"), sa.column("next_at"),
                         sa.column("options"))
        engine = sa.create_engine(pg_url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.update(table).values(next_at=naive_utc(due[0])))
                conn.execute(sa.update(table).where(table.c.name == "bad").values(options=json.dumps(forged)))
        finally:
            engine.dispose()

        s.start_beat()

        assert s.sent("good") == due and s.sent("cfg") == due
        assert s.sent("bad") == []
        messages = [json.loads(raw) for raw in s.redis.lrange(s.queue, 0, -1)]
        assert {m["headers"]["task"] for m in messages} == {"t.record"}
        assert not any(m["headers"]["id"] == "forged-id" for m in messages)
        assert all(m["headers"].get("tenant") == "acme" for m in messages
                   if m["headers"]["cluster_beat_schedule"] == "good")
        rows = s.rows("bad")
        assert [(at, rows[at].status) for at in due] == [(at, "failed") for at in due]
        reason = rows[due[0]].reason
        assert "options.headers.task: reserved" in reason and "options.headers.id" in reason, reason
        assert "options.link: not allowed" in reason, reason
        state = {st.name: st for st in s.store.schedule_states(["bad"])}["bad"]
        assert state.failed == MISSED
    finally:
        s.close()
