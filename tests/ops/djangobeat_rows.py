"""Make a real django-celery-beat database: its own migrations, rows through its own models.

Run as a script (Django is configured once per process, so each test database gets a process of its
own)::

    python djangobeat_rows.py DB_URL ROWS_JSON

``DB_URL``: ``sqlite:////path``, ``postgresql+psycopg://user@host:port/db`` or ``mysql+pymysql://...``. ``ROWS_JSON``: a list
of periodic tasks, each a dict of ``PeriodicTask`` fields plus one schedule: ``crontab`` (a dict of
``CrontabSchedule`` fields, ``timezone`` an IANA name), ``interval`` (``every``, ``period``),
``clocked`` (an ISO datetime) or ``solar`` (``event``, ``latitude``, ``longitude``); datetimes as ISO
text. Only the test suite uses it: the import itself never needs Django.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime
from urllib.parse import urlsplit


def _databases(url: str) -> dict:
    if url.startswith("sqlite:///"):
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": url[len("sqlite:///"):]}
    parts = urlsplit(url)
    if parts.scheme.startswith("mysql"):
        import pymysql

        pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL (the suite's driver)
    engine = "mysql" if parts.scheme.startswith("mysql") else "postgresql"
    return {"ENGINE": f"django.db.backends.{engine}", "NAME": parts.path.lstrip("/"), "USER": parts.username or "",
            "PASSWORD": parts.password or "", "HOST": parts.hostname or "", "PORT": str(parts.port or "")}


def main(url: str, rows_json: str) -> None:
    import django
    from django.conf import settings

    settings.configure(DATABASES={"default": _databases(url)}, INSTALLED_APPS=["django_celery_beat"],
                       USE_TZ=True, TIME_ZONE="UTC", DEFAULT_AUTO_FIELD="django.db.models.AutoField")
    django.setup()
    from django.core.management import call_command
    from zoneinfo import ZoneInfo

    call_command("migrate", "django_celery_beat", verbosity=0)
    from django_celery_beat import models

    for row in json.loads(rows_json):
        row = dict(row)
        for key in ("start_time", "expires", "last_run_at"):
            if row.get(key):
                row[key] = datetime.fromisoformat(row[key])
        if "crontab" in row:
            fields = dict(row.pop("crontab"))
            fields["timezone"] = ZoneInfo(fields.get("timezone", "UTC"))
            row["crontab"] = models.CrontabSchedule.objects.create(**fields)
        elif "interval" in row:
            row["interval"] = models.IntervalSchedule.objects.create(**row.pop("interval"))
        elif "clocked" in row:
            row["clocked"] = models.ClockedSchedule.objects.create(
                clocked_time=datetime.fromisoformat(row.pop("clocked")))
        elif "solar" in row:
            row["solar"] = models.SolarSchedule.objects.create(**row.pop("solar"))
        runs = row.pop("total_run_count", None)
        task = models.PeriodicTask.objects.create(**row)
        if runs is not None:  # not editable through the model's forms, but a column like any other
            models.PeriodicTask.objects.filter(pk=task.pk).update(total_run_count=runs)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
