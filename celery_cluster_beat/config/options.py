"""What a schedule's ``options`` may ask of Celery's send, by who wrote the schedule.

Options go to Celery's ``send_task`` as given, and several of them change what the message
*is*, not where it goes: kombu merges ``headers`` over Celery's own protocol headers, so
``{"headers": {"task": ...}}`` makes the worker run another task and ``{"headers": {"id": ...}}``
forges the task id; a ``compression`` header makes kombu decompress the body (the worker drops
the message), ``CC`` / ``BCC`` make RabbitMQ deliver a copy per routing key; ``link`` /
``link_error`` call any registered task; ``serializer`` may pick pickle; an ``exchange`` the
broker lacks closes the channel every schedule's messages go out on. Who may ask for that differs:

* a ``beat_schedule`` entry is the operator's (trusted, like the rest of the Celery config): its
  values are type-checked, and a reserved header or a link option is only warned about once at
  start-up (:func:`trusted_option_warnings`), then sent as configured;
* a stored schedule may be written by the application's users (not trusted): only the options
  of :data:`STORED_OPTIONS` (its queue and routing key, how long it may wait or run) are accepted,
  the others only when the application names them in ``cluster_beat_stored_options_allowed``
  (:data:`OPT_IN_OPTIONS`), and reserved headers never (:func:`stored_option_problems`).

Each problem is ``(field, reason)`` with the field spelt from the entry (``options.headers.task``),
so the API, beat and the start-up check say the same thing.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Collection, Dict, FrozenSet, Iterable, List, Optional, Tuple

from ..base import MAX_NAME_LENGTH
from ..errors import ConfigError
from .values import seconds_problem, shown, text_problem

#: Header names Celery's task protocol (v2) writes itself: a value from the options replaces
#: Celery's (kombu merges the caller's headers last), changing which task runs, its id, its
#: lineage or how the worker reads the message. ``celery_beat_task`` is beat's own marker.
PROTOCOL_HEADERS: FrozenSet[str] = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries", "timelimit",
    "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result", "replaced_task_nesting",
    "stamped_headers", "stamps", "celery_beat_task",
})
#: Header names the transport reads, not the task: kombu decompresses a body whose headers name a
#: ``compression`` (a stored one makes the worker drop the message), and RabbitMQ routes a copy of
#: the message to each routing key of ``CC`` and ``BCC`` (sender-selected distribution: a duplicate
#: delivery per key).
TRANSPORT_HEADERS: FrozenSet[str] = frozenset({"compression", "CC", "BCC"})
#: Every reserved header name, lowercased: a name whose lowercase is one of them is refused too
#: (``Task``, ``cc``), as brokers and clients differ on case.
_RESERVED_LOWER: FrozenSet[str] = frozenset(n.lower() for n in PROTOCOL_HEADERS | TRANSPORT_HEADERS)
#: Our own headers (which occurrence a message is: the worker's ledger records it) start so.
OUR_HEADER_PREFIX = "cluster_beat_"

#: Options a stored schedule may set: where its message goes and how long it may wait or run.
#: None of them changes which task runs, its id, its arguments' encoding or its lineage.
STORED_OPTIONS: Tuple[str, ...] = ("queue", "routing_key", "priority", "expires", "time_limit", "soft_time_limit",
                                   "ignore_result", "headers")
_LINKS = "it makes the worker call another task when the run ends"
_ENCODING = "it changes how the message is encoded (pickle runs code on the worker)"
_IDENTITY = "it changes the task's id or lineage"
_HELD = "it holds the message back: the worker keeps it until due"
_PUBLISH = "it changes how beat publishes the message"
#: Options Celery's send accepts that a stored schedule may set only when the application allows
#: them by name (``cluster_beat_stored_options_allowed``), each with why it is not allowed by default.
OPT_IN_REASONS: Dict[str, str] = {
    "link": _LINKS, "link_error": _LINKS, "serializer": _ENCODING, "compression": _ENCODING,
    "content_type": _ENCODING, "content_encoding": _ENCODING, "task_id": _IDENTITY, "shadow": _IDENTITY,
    "root_id": _IDENTITY, "parent_id": _IDENTITY, "group_id": _IDENTITY, "group_index": _IDENTITY,
    "reply_to": "it sends the result's reply to another queue", "countdown": _HELD, "eta": _HELD,
    "retry": _PUBLISH, "retry_policy": _PUBLISH, "delivery_mode": _PUBLISH, "exchange_type": _PUBLISH,
    "mandatory": _PUBLISH,
    "exchange": "an exchange the broker does not have closes the channel beat publishes every schedule's messages on",
}
OPT_IN_OPTIONS: Tuple[str, ...] = tuple(OPT_IN_REASONS)
#: Options a ``beat_schedule`` entry is warned about at start-up (with reserved headers).
LINK_OPTIONS: Tuple[str, ...] = ("link", "link_error")
#: Longest queue, exchange or routing key name, in characters and in UTF-8 bytes (AMQP's short string).
MAX_ROUTE_LENGTH = 255
#: Options Celery reads as seconds (a number; ``expires`` may also be a datetime).
SECONDS_OPTIONS: Tuple[str, ...] = ("expires", "countdown", "time_limit", "soft_time_limit")
#: Opt-in options whose value is a name (checked like the routing names).
_NAME_OPTIONS = ("serializer", "compression", "reply_to", "task_id", "shadow", "root_id", "parent_id", "group_id",
                 "content_type", "content_encoding", "exchange_type")

SETTING = "cluster_beat_stored_options_allowed"
_STORED_SET = frozenset(STORED_OPTIONS)

Problem = Tuple[str, str]


def _priority_problem(value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        return f"expected an integer 0-255, got {shown(value)}"
    return None


def _route_problem(value: Any, *, empty_ok: bool) -> Optional[str]:
    if not isinstance(value, str):
        return f"expected a string, got {shown(value)}"
    if not value and empty_ok:
        return None
    # The rule a stored row is read back with (no control character): beat reads the options the API
    # wrote, so no row a release accepted becomes unreadable; output shows options as JSON, escaped.
    reason = text_problem(value, limit=MAX_ROUTE_LENGTH, what="a non-empty string", printable_only=False)
    if reason is None and not value.isascii() and len(value.encode("utf-8")) > MAX_ROUTE_LENGTH:
        reason = f"longer than {MAX_ROUTE_LENGTH} bytes in UTF-8"
    return reason


def _headers_problem(value: Any) -> Optional[str]:
    return None if isinstance(value, Mapping) else f"expected a dict, got {type(value).__name__}"


def _name_problem(value: Any, *, empty_ok: bool) -> Optional[str]:
    if hasattr(value, "name") and not isinstance(value, str):  # a kombu Queue / Exchange
        return None
    return _route_problem(value, empty_ok=empty_ok)


def _seconds_option_problem(value: Any) -> Optional[str]:
    # Built into every message: out of range, each send would fail. A datetime is Celery's too.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return seconds_problem(value, zero_ok=True)
    return None


#: The check of each option whose value any entry must get right (the others are Celery's).
_TYPE_CHECKS = {
    "headers": _headers_problem,
    "priority": _priority_problem,
    "queue": lambda value: _name_problem(value, empty_ok=False),
    "routing_key": lambda value: _name_problem(value, empty_ok=True),
    "exchange": lambda value: _name_problem(value, empty_ok=True),
    **{key: _seconds_option_problem for key in SECONDS_OPTIONS},
}


def option_problems(options: Any) -> List[Problem]:
    """The type problems of any entry's *options* (a config entry's may hold kombu objects: a
    ``Queue`` as ``queue``): values Celery would fail on at every send, or that the claim
    database and the broker cannot carry."""
    if not isinstance(options, Mapping):
        return [("options", f"expected a dict, got {type(options).__name__}")]
    problems: List[Problem] = []
    for key, value in options.items():
        check = _TYPE_CHECKS.get(key)
        reason = None if check is None or value is None else check(value)
        if reason:
            problems.append((f"options.{key}", reason))
    return problems


def header_problem(name: Any) -> Optional[str]:
    """Why a stored schedule's ``headers`` may not carry *name*; None when it may."""
    if not isinstance(name, str):
        return f"expected a header name, got {shown(name)}"
    lower = name.lower()
    if lower in _RESERVED_LOWER:
        return ("reserved: a header Celery's protocol, kombu or the broker reads (it decides which task runs, "
                "its id, lineage, how the worker reads the message or where copies of it go); a stored "
                "schedule's headers carry the application's own names only")
    if lower.startswith(OUR_HEADER_PREFIX):
        return "reserved: cluster-beat's own header (which occurrence the message is)"
    return text_problem(name, limit=MAX_NAME_LENGTH, what="a header name", printable_only=False)


def stored_option_problems(options: Any, allowed: Collection[str] = ()) -> Tuple[Dict[str, Any], List[Problem]]:
    """``(safe options, problems)`` of a stored schedule's *options*: the allow-list (with the
    options the application named in *allowed*), reserved headers, and :func:`option_problems`.
    The safe options are those that may be sent: nothing refused is in them."""
    if not isinstance(options, Mapping):
        return {}, [("options", f"expected a dict, got {type(options).__name__}")]
    permitted = {*STORED_OPTIONS, *allowed} if allowed else _STORED_SET
    problems: List[Problem] = []
    safe: Dict[str, Any] = {}
    for key, value in options.items():
        field = f"options.{_label(key)}"
        if key in permitted:
            check = _TYPE_CHECKS.get(key)
            reason = None if value is None else (check and check(value)) or _stored_value_problem(key, value)
            if reason is None and key == "queue" and isinstance(value, str) and value.lower().startswith("amq."):
                reason = ("RabbitMQ reserves names starting with 'amq.': declaring one closes the channel beat "
                          "publishes every schedule's messages on")
        elif key in OPT_IN_REASONS:
            reason = (f"not allowed in a stored schedule ({OPT_IN_REASONS[key]}); the application may allow it "
                      f"with {SETTING} = [{key!r}]")
        else:
            reason = (f"not an option a stored schedule may set (it may set {', '.join(STORED_OPTIONS)}, and "
                      f"what {SETTING} names)")
        if reason:
            problems.append((field, reason))
            continue
        if key == "headers" and value:
            kept = {}
            for name, header in value.items():
                why = header_problem(name)
                if why:
                    problems.append((f"options.headers.{_label(name)}", why))
                else:
                    kept[name] = header
            value = kept
        safe[key] = value
    return safe, problems


def _label(name: Any) -> str:
    """A header name as a field label: as written when printable, else its cut repr (never a
    control character in a message)."""
    return name[:60] if isinstance(name, str) and name.isprintable() else shown(name, 60)


def _stored_value_problem(key: str, value: Any) -> Optional[str]:
    """Why a stored schedule's allowed option *key* cannot have *value*, beyond :data:`_TYPE_CHECKS`
    (JSON has no kombu object and no datetime: names are strings, durations numbers)."""
    if key in SECONDS_OPTIONS:
        return seconds_problem(value, zero_ok=True)  # a number: no datetime in JSON, no ISO text
    if key in ("ignore_result", "retry", "mandatory"):
        return None if isinstance(value, bool) else f"expected True or False, got {shown(value)}"
    if key in _NAME_OPTIONS:
        return _route_problem(value, empty_ok=False)
    return None


def allowed_stored_options(value: Any) -> FrozenSet[str]:
    """The setting ``cluster_beat_stored_options_allowed`` checked: the option names a stored
    schedule may set beyond :data:`STORED_OPTIONS`. :class:`ConfigError` naming the setting."""
    if value is None:
        return frozenset()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"setting {SETTING}: expected a list of option names (e.g. ['serializer']), "
                          f"got {shown(value)}")
    names = set()
    for name in value:
        if name not in OPT_IN_OPTIONS and name not in STORED_OPTIONS:
            raise ConfigError(f"setting {SETTING}: {shown(name)} is not an option a stored schedule can be "
                              f"allowed (one of {', '.join(OPT_IN_OPTIONS)}); reserved headers never are")
        names.add(name)
    return frozenset(names)


def conf_allowed_stored_options(conf: Any) -> FrozenSet[str]:
    """:func:`allowed_stored_options` of a Celery *conf*; a bad value allows nothing (the start-up
    check has reported it, naming the setting)."""
    try:
        return allowed_stored_options(conf.get(SETTING))
    except ConfigError:
        return frozenset()


def trusted_option_warnings(entries: Iterable[Any]) -> List[str]:
    """One line per ``beat_schedule`` entry whose options set a reserved header or a link option:
    allowed (the Celery config is trusted), but said once at start-up, naming the entry and fields."""
    lines = []
    for entry in entries:
        options = entry.options or {}
        headers = options.get("headers") or {}
        fields = [f"options.headers.{name}" for name in headers
                  if isinstance(name, str) and (name.lower() in _RESERVED_LOWER or name.startswith(OUR_HEADER_PREFIX))]
        fields += [f"options.{key}" for key in LINK_OPTIONS if options.get(key)]
        if fields:
            lines.append(f"beat_schedule entry {entry.name!r}: {', '.join(fields)}: sent as configured, though it "
                         "can change which task runs or its identity (a stored schedule may not set it)")
    return lines
