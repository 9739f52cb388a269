"""The stored-schedule API takes printable text only for new names, tasks, owners and descriptions
(issue 20, item 7; a description may run over lines, with tabs), while a row an older release stored
with such text stays readable: beat keeps scheduling it, the API still finds, changes, disables and
removes it, and the command line shows it escaped (``tests/ops/test_cli_escaping.py``)."""
from __future__ import annotations

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import ConfigError, every
from celery_cluster_beat.dynamic import StoredSchedules, entry_from_row
from celery_cluster_beat.store.schema import stored_schedules_table


@pytest.fixture
def schedules(tmp_path):
    app = Celery("printable", set_as_current=False)
    app.conf.update(cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url="",
                    beat_schedule={})
    api = StoredSchedules(app)
    yield api
    api.close()


@pytest.mark.parametrize("name, fields, field, kind", [
    ("rev\u202eersed", {}, "name", "a format character"),
    ("x", {"owner": "al\u200dice"}, "owner", "a format character"),
    ("x", {"description": "clear\x1b[2J"}, "description", "a control character"),
    ("x", {"description": "bell\x07"}, "description", "a control character"),
    ("x", {"description": "rev\u202eersed"}, "description", "a bidi control"),
])
def test_unprintable_text_is_refused_naming_the_schedule_and_the_field(schedules, name, fields, field, kind):
    with pytest.raises(ConfigError) as info:
        schedules.add(name, "t.record", every(60), **fields)
    message = str(info.value)
    assert message.startswith(f"stored schedule {name!r}: {field}: ") and f"contains {kind} (" in message, message
    assert schedules.list() == []


def test_a_description_stored_before_the_rule_still_schedules(schedules):
    schedules.add("old", "t.record", every(60), description="fine")
    engine = sa.create_engine(schedules.app.conf.cluster_beat_db_url)
    with engine.begin() as conn:
        conn.execute(sa.update(stored_schedules_table).values(description="two\nlines\u202e"))
    engine.dispose()
    (row,) = schedules.store.stored_get(["old"])
    entry = entry_from_row(row, app=schedules.app)  # beat reads it: not refused, not dropped
    assert entry.description == "two\nlines\u202e" and not entry.refused
    assert schedules.get("old").description == "two\nlines\u202e"


def test_a_new_description_may_run_over_lines_with_tabs(schedules):
    text = "Weekly export.\r\n\tOwner: data team \U0001f468\u200d\U0001f469.\u2029Next paragraph."
    assert schedules.add("multi", "t.record", every(60), description=text).description == text
    assert schedules.update("multi", description=text + "\nMore.").description == text + "\nMore."


def _stored_past_the_api(schedules, name: str, **values) -> None:
    """Give the row "old" *name* (and *values*) directly in the database, as an older release could."""
    schedules.add("old", "t.record", every(60))
    engine = sa.create_engine(schedules.app.conf.cluster_beat_db_url)
    with engine.begin() as conn:
        conn.execute(sa.update(stored_schedules_table).values(name=name, **values))
    engine.dispose()


@pytest.mark.parametrize("name", ["family \U0001f468\u200d\U0001f469\u200d\U0001f467",
                                  "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "soft\u00adhyphen"])
def test_a_name_stored_before_the_printable_rule_stays_readable_changeable_and_removable(schedules, name):
    """A format character (a zero-width joiner in an emoji, a zero-width non-joiner in Persian, a
    soft hyphen) was a valid name before the rule: beat reads such a row (it used to drop it as
    unreadable, recording nothing for its occurrences) and the API finds, changes and removes it.
    A new schedule may not take such a name."""
    _stored_past_the_api(schedules, name)
    (row,) = schedules.store.stored_get([name])
    entry = entry_from_row(row, app=schedules.app)
    assert entry.name == name and not entry.refused
    assert schedules.get(name).name == name
    assert schedules.disable(name).enabled is False and schedules.enable(name).enabled is True
    assert schedules.update(name, args=[1]).args == [1]
    assert schedules.remove(name) is True and schedules.get(name) is None
    with pytest.raises(ConfigError, match="name: contains a format character"):
        schedules.add(name, "t.record", every(60))


def test_an_old_description_is_kept_as_it_is_by_an_update_of_another_field(schedules):
    _stored_past_the_api(schedules, "old", description="rev\u202eersed")
    assert schedules.disable("old").description == "rev\u202eersed"
    assert schedules.update("old", owner="alice").description == "rev\u202eersed"
    with pytest.raises(ConfigError, match="description: contains a bidi control"):
        schedules.update("old", description="still rev\u202eersed")
