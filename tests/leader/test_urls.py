"""mask_url: what may be logged of a connection URL."""
from __future__ import annotations

import pytest

from celery_cluster_beat.leader.urls import mask_url


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
