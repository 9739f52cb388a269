"""Scheduled report jobs: an application's reports, each run on its own stored schedule.

Read in this order: ``settings.py`` (everything configurable, from the environment),
``models.py`` (the application's tables), ``service.py`` (creating, editing and deleting
a report keeps its stored schedule ``report:<id>`` in step), ``tasks.py`` (the Celery
app and the ``run_report`` task) and ``demo.py`` (the whole story in one command).
"""
