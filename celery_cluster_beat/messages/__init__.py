"""Task messages as the installed Celery builds them: recorded once per entry, replayed per occurrence.

Owns the fast path of publishing (:mod:`.template`: a template is what Celery's own
``send_task_message`` did for an entry, recorded by :mod:`.celerysend` with nothing
published), its proof (:mod:`.selfcheck`: one message built both ways per shape of
message, in each process), the per-process cache that decides, per message, between
the template and Celery's own path (:mod:`.templates`), the dry run that ``check``
uses to tell which entries cannot be sent at all (:mod:`.dryrun`), and the range of
Celery and kombu versions this is tested against (:mod:`.support`).

Celery and kombu privates are read in :mod:`.celerysend` only, each behind a check
that turns the fast path off (never the sending) when it is missing or different.

May import: nothing of the package but errors, signals and base: beat's publisher and
the operators' ``check`` both build on it.
"""
from .template import Template, TemplateBroken, why_not
from .templates import Templates

__all__ = ["Template", "TemplateBroken", "Templates", "why_not"]
