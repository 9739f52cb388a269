"""mask_url and mask_urls_in: what may be logged or shown of a connection URL, in linear time,
without touching names (``xss:user:alice@example.com`` stays what it is)."""
from __future__ import annotations

import time

import pytest

from celery_cluster_beat.leader.urls import MASK, MAX_PIECES, mask_url, mask_urls_in


@pytest.mark.parametrize(
    "url, masked",
    [
        # Redis, with and without user name
        ("redis://:s3cret@redis.example:6379/0", "redis://:***@redis.example:6379/0"),
        ("redis://beat:s3cret@redis.example:6379/0", "redis://beat:***@redis.example:6379/0"),
        ("rediss://:s3cret@redis.example:6380/0?ssl_cert_reqs=CERT_REQUIRED",
         "rediss://:***@redis.example:6380/0?ssl_cert_reqs=CERT_REQUIRED"),
        ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
        # the password as a query parameter (redis-py accepts it)
        ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://h/0?sentinel_password=s3cret&x=1", "redis://h/0?sentinel_password=***&x=1"),
        # Sentinel, one or several
        ("sentinel://:s3cret@10.0.0.1:26379", "sentinel://:***@10.0.0.1:26379"),
        ("sentinel://:s3cret@10.0.0.1:26379/0;sentinel://:s3cret@10.0.0.2:26379/0;sentinel://10.0.0.3:26379",
         "sentinel://:***@10.0.0.1:26379/0;sentinel://:***@10.0.0.2:26379/0;sentinel://10.0.0.3:26379"),
        ("redis+sentinel://u:s3cret@h:26379/mymaster/0", "redis+sentinel://u:***@h:26379/mymaster/0"),
        # SQLAlchemy and AMQP
        ("postgresql+psycopg://beat:s3cret@db.example:5432/beat", "postgresql+psycopg://beat:***@db.example:5432/beat"),
        ("mysql+pymysql://root:s3cret@127.0.0.1:3306/test?charset=utf8mb4",
         "mysql+pymysql://root:***@127.0.0.1:3306/test?charset=utf8mb4"),
        ("amqp://guest:guest@localhost:5672//", "amqp://guest:***@localhost:5672//"),
        # IPv6 hosts
        ("redis://:s3cret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        # unencoded awkward characters in the password are masked whole, not cut
        ("redis://:p@ss/w;rd@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:pa:ss@h", "redis://u:***@h"),
    ],
)
def test_passwords_are_replaced_by_stars(url, masked):
    assert mask_url(url) == masked
    assert "s3cret" not in mask_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://beat@127.0.0.1:6379/0",
        "redis://beat:@127.0.0.1:6379/0",  # empty password: nothing to hide
        "rediss://redis.example:6380/0?ssl_cert_reqs=CERT_NONE",
        "unix:///run/redis.sock?db=2",
        "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379",
        "redis://[::1]:6379",
        "sqlite:////var/lib/beat/claims.sqlite3",
        "mysql+pymysql://root@127.0.0.1:3306/test",
        "",
    ],
)
def test_urls_without_password_come_back_unchanged(url):
    assert mask_url(url) == url


@pytest.mark.parametrize(
    "text, masked",
    [
        ("Error connecting to beat:s3cret@redis.example:6379.", "Error connecting to beat:***@redis.example:6379."),
        ("url=redis://:s3cret@h:6379/0 failed: timeout", "url=redis://:***@h:6379/0 failed: timeout"),
        ("a:s3cret@b and c:s3cret@d", "a:***@b and c:***@d"),
        ("Error 111 connecting to 127.0.0.1:6379. Connection refused.",
         "Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        ("no url here", "no url here"),
    ],
)
def test_text_around_urls_is_kept_and_anything_like_colon_secret_at_is_masked(text, masked):
    assert mask_url(text) == masked


@pytest.mark.parametrize("garbage", [None, 42, b"redis://:s3cret@h", object(), "::::@@@@", "://:@", "\x00:\xff@"])
def test_never_raises(garbage):
    result = mask_url(garbage)
    assert isinstance(result, str)
    assert "s3cret" not in result


# ----------------------------------------------------------------------------- linear time, names untouched

#: 1 MB of what made the old regular expressions quadratic (30,000 ':' took 7.5 s; 1 MB, 11 minutes).
HOSTILE = {
    "colons": ":" * 1_000_000,
    "ats": "@" * 1_000_000,
    "colon-at": ":@" * 500_000,
    "colons-then-ats": ":" * 500_000 + "@" * 500_000,
    "pairs": "a:b@" * 250_000,
    "pairs-spaced": "a:b@ " * 200_000,
    "schemes": "a://" * 250_000,
    "urls": "a://u:p@h " * 100_000,
    "long-scheme": "a" * 1_000_000 + "://u:p@h",
    "keys": "?password=x&" * 83_000,
    "bare-keys": "password=" * 111_000,
    "url-then-colons": "redis://" + ":" * 1_000_000 + "@h",
    "mixed": (":@/?&;=#a://x:y@" + "password=" + " \t") * 30_000,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("mask", [mask_url, mask_urls_in], ids=["mask_url", "mask_urls_in"])
def test_a_megabyte_of_hostile_text_is_masked_in_well_under_a_second(kind, mask):
    text = HOSTILE[kind]
    started = time.perf_counter()
    result = mask(text)
    took = time.perf_counter() - started
    assert isinstance(result, str)
    # linear: a few tens of milliseconds here; the old quadratic code took minutes. 1 s leaves
    # room for a loaded machine while still failing anything quadratic (or a slow linear one).
    assert took < 1.0, f"{kind}: {took:.2f} s"


@pytest.mark.parametrize("text", [
    "xss:user:alice@example.com",
    "team:billing@corp: nightly export",
    "a:b:c@d and e:f@g",
    "mailto:ops@example.com",
    "weird ::::@@@@ name",
    "ratio 1:2 @ 3",
])
def test_names_and_descriptions_are_left_alone_by_mask_urls_in(text):
    assert mask_urls_in(text) == text


@pytest.mark.parametrize("text, masked", [
    ("schedule 'a:b@c' cannot reach redis://u:s3cret@h:6379/0",
     "schedule 'a:b@c' cannot reach redis://u:***@h:6379/0"),
    ("x redis+cluster://u:s3cret@h:7000;redis+cluster://:s3cret@h2:7001?password=s3cret y",
     "x redis+cluster://u:***@h:7000;redis+cluster://:***@h2:7001?password=*** y"),
    ("db postgresql+psycopg://u:s3cret@h/db; broker amqp://g:s3cret@h//",
     "db postgresql+psycopg://u:***@h/db; broker amqp://g:***@h//"),
    ("sentinel://:s3cret@10.0.0.1:26379;sentinel://:s3cret@10.0.0.2:26379",
     "sentinel://:***@10.0.0.1:26379;sentinel://:***@10.0.0.2:26379"),
    ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
    ("redis://:s3cret@h", "redis://:***@h"),
])
def test_urls_in_a_message_are_masked_by_mask_urls_in_and_the_rest_kept(text, masked):
    assert mask_urls_in(text) == masked
    assert mask_url(text) == masked.replace("'a:b@c'", "'a:***@c'")


@pytest.mark.parametrize("url, masked", [
    ("redis+cluster://u:s3cret@h:7000", "redis+cluster://u:***@h:7000"),
    ("sqla+postgresql://u:s3cret@h/db", "sqla+postgresql://u:***@h/db"),
    ("redis://h/0?PASSWORD=s3cret", "redis://h/0?PASSWORD=***"),
    ("redis://h/0?Pwd=s3cret#frag", "redis://h/0?Pwd=***#frag"),
    ("x" * 100 + "redis://:s3cret@h", "x" * 36 + "redis://:***@h"),  # a scheme of 64 characters at most
])
def test_more_url_shapes(url, masked):
    assert mask_url(url).endswith(masked[-20:])
    assert "s3cret" not in mask_url(url) and "s3cret" not in mask_urls_in(url)


def test_a_text_with_too_many_urls_is_masked_whole():
    few = "ok " + "redis://:s3cret@h;" * MAX_PIECES + " tail"
    assert mask_urls_in(few).startswith("ok redis://:***@h;") and mask_urls_in(few).endswith(" tail")
    text = "ok " + "redis://:s3cret@h;" * (MAX_PIECES + 1) + " tail"
    assert mask_url(text) == MASK
    assert mask_urls_in(text) == MASK


def test_cli_error_lines_keep_names_and_still_mask_urls_and_driver_text():
    from celery_cluster_beat.errors import ConfigError
    from celery_cluster_beat.ops.cli import _problems

    ours = ConfigError(["schedule 'xss:user:alice@example.com': bad cron; redis://u:s3cret@h"])
    assert _problems(ours) == ["schedule 'xss:user:alice@example.com': bad cron; redis://u:***@h"]
    driver = RuntimeError("Error connecting to beat:s3cret@redis.example:6379.")
    assert _problems(driver) == ["RuntimeError: Error connecting to beat:***@redis.example:6379."]
