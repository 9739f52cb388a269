"""``cluster-beat import``: another scheduler's schedules carried over as stored schedules.

Owns reading django-celery-beat's tables (:mod:`.djangobeat`, SQLAlchemy on the tables
themselves: no Django at run time) and RedBeat's Redis hashes (:mod:`.redbeat`, its JSON read
here: no RedBeat at run time), what each of their rules, options and bounds becomes
(:mod:`.mapping`, pure; one-offs and start / end / run-count bounds in :mod:`.bounds`, the one
place that knows whether the stored-schedule API has them yet), and the plan against what is
stored already, dry run or applied through :class:`~celery_cluster_beat.dynamic.StoredSchedules`
(:mod:`.apply`), so every stored-schedule check applies to what is imported.

What others wrote is read bounded: rows, text cells, JSON sizes and depth.
Loaded by the command that runs it only (:mod:`..importcmd` declares it with click alone).
"""
