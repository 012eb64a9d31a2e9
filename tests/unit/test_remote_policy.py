"""The remote retry policy, circuit breaker, credential redaction, kept listings and state
files, without a server (fake clocks and sleeps; fake fsspec calls)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mmcache.errors import (
    ConfigError,
    MmcacheError,
    RemoteError,
    RemoteSampleError,
    SampleError,
)
from mmcache.sources.blobs.listing import ListingFile
from mmcache.sources.blobs.objects import Remote
from mmcache.sources.blobs.options import backend_options, redact
from mmcache.sources.blobs.retry import RetryPolicy
from mmcache.sources.blobs.state import SharedStamps, private_dir

SECRETS = ("AKIAEXAMPLEKEY123", "SeCrEtVaLuE987654321", "hunter2pass", "sessTOKEN4242")
OPTIONS = {
    "key": SECRETS[0],
    "secret": SECRETS[1],
    "client_kwargs": {"endpoint_url": f"http://alice:{SECRETS[2]}@127.0.0.1:9"},
    "config_kwargs": {"aws_session_token": SECRETS[3]},
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def refused() -> bytes:
    raise ConnectionRefusedError(111, "Connection refused")


def test_remote_error_is_an_mmcache_error_and_an_oserror_with_a_kind():
    err = RemoteError("s3://b/k", 404, True, "NoSuchKey")
    assert isinstance(err, MmcacheError) and not isinstance(err, OSError)
    assert err.kind == "not-found" and "HTTP 404" in str(err)
    assert RemoteError("s3://b/k", None, False, "refused").kind == "unreachable"
    assert RemoteError("s3://b/k", 503, False, "SlowDown").kind == "throttled"
    back = pickle.loads(pickle.dumps(RemoteError("u", None, False, "x", kind="circuit-open")))
    assert back.kind == "circuit-open" and back.url == "u"
    miss = RemoteSampleError(err, sample_id="k1")
    assert isinstance(miss, SampleError) and isinstance(miss, RemoteError)
    assert (
        miss.sample_id == "k1"
        and miss.path == "s3://b/k"
        and "not-found" in str(miss)
        and "HTTP 404" in str(miss)
    )
    again = pickle.loads(pickle.dumps(miss))
    assert again.sample_id == "k1" and again.kind == "not-found" and str(again) == str(miss)


def test_policy_is_validated_and_names_the_field():
    for bad in (
        {"attempts": 0},
        {"backoff": -1},
        {"call_deadline": float("nan")},
        {"breaker_after": 0},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RetryPolicy(**bad)  # type: ignore[arg-type]
    assert RetryPolicy(attempts=4, backoff=1, max_backoff=3).sleeps() == [1, 2, 3]
    with pytest.raises(ConfigError, match="retries"):
        Remote({}, retries=-1)


def test_the_breaker_opens_after_calls_without_an_answer_and_a_probe_closes_it():
    clock = Clock()
    policy = RetryPolicy(attempts=3, backoff=0.1, breaker_after=3, probe_every=5.0)
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)
    calls = {"n": 0}

    def down() -> bytes:
        calls["n"] += 1
        return refused()

    with pytest.raises(RemoteError) as info:
        remote.call("s3://b/0", down)  # 3 tries: the breaker opens on the third
    assert calls["n"] == 3 and info.value.kind == "unreachable" and remote.unreachable
    assert clock.slept == [0.1, 0.2]
    for i in range(100):  # the rest of the epoch: at once, no try, no sleep
        with pytest.raises(RemoteError) as info:
            remote.call(f"s3://b/{i}", down)
        assert info.value.kind == "circuit-open"
    assert calls["n"] == 3 and clock.slept == [0.1, 0.2]
    clock.now += 5.0  # a probe is due: one try, no retries
    with pytest.raises(RemoteError) as info:
        remote.call("s3://b/p", down)
    assert calls["n"] == 4 and info.value.kind == "unreachable"
    remote.new_epoch()  # the next epoch's first call probes at once, and the store is back
    assert remote.call("s3://b/ok", lambda: b"ok") == b"ok"
    assert not remote.unreachable
    assert remote.call("s3://b/ok", lambda: b"again") == b"again"


def test_http_errors_are_answers_and_never_open_the_breaker():
    clock = Clock()
    remote = Remote(
        {}, retries=RetryPolicy(attempts=2, backoff=0.01), sleep=clock.sleep, clock=clock
    )

    class Busy(OSError):
        status = 503

    def busy() -> bytes:
        raise Busy("SlowDown")

    for _ in range(10):
        with pytest.raises(RemoteError) as info:
            remote.call("s3://b/k", busy)
        assert info.value.kind == "throttled"
    assert not remote.unreachable


def test_call_and_epoch_deadlines_bound_the_retrying():
    clock = Clock()
    policy = RetryPolicy(
        attempts=10,
        backoff=1.0,
        max_backoff=1.0,
        call_deadline=2.5,
        epoch_deadline=4.0,
        breaker_after=None,
    )
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)
    with pytest.raises(RemoteError):
        remote.call("s3://b/k", refused)
    assert clock.slept == [1.0, 1.0]  # a third sleep would pass the call's 2.5 s
    with pytest.raises(RemoteError):
        remote.call("s3://b/k", refused)
    with pytest.raises(RemoteError):
        remote.call("s3://b/k", refused)
    assert sum(clock.slept) == 4.0  # the epoch's 4 s are spent: one try per call now
    remote.new_epoch()
    with pytest.raises(RemoteError):
        remote.call("s3://b/k", refused)
    assert sum(clock.slept) == 6.0


def test_credentials_never_appear_in_messages_or_reprs(caplog):
    text = json.dumps(redact(OPTIONS)) + repr(Remote(OPTIONS))
    with pytest.raises(ConfigError) as info:
        Remote({**OPTIONS, "client_kwargs": {"ssl": {1, 2}}})
    text += str(info.value)
    with pytest.raises(ConfigError) as info:
        Remote("anon=True")  # type: ignore[arg-type]
    text += str(info.value)
    remote = Remote(OPTIONS, retries=RetryPolicy(attempts=1))

    def leaky() -> bytes:
        raise OSError(f"cannot connect to http://alice:{SECRETS[2]}@127.0.0.1:9 as {SECRETS[0]}")

    with caplog.at_level(logging.DEBUG), pytest.raises(RemoteError) as err:
        remote.call("s3://b/k", leaky)
    text += str(err.value) + str(RemoteSampleError(err.value, sample_id="s")) + caplog.text
    for secret in SECRETS:
        assert secret not in text
    assert "***" in text and "client_kwargs" in text


def test_backend_options_turn_botocore_retries_off_unless_the_user_set_them():
    got = backend_options("s3", {"key": "k"}, connect_timeout=2, read_timeout=7)
    assert got["config_kwargs"] == {
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "connect_timeout": 2,
        "read_timeout": 7,
    }
    mine = {"config_kwargs": {"retries": {"max_attempts": 9}}}
    assert backend_options("s3", mine, connect_timeout=2, read_timeout=7)["config_kwargs"][
        "retries"
    ] == {"max_attempts": 9}
    assert backend_options("gs", {"token": "anon"}, connect_timeout=2, read_timeout=7) == {
        "token": "anon"
    }


def test_a_kept_listing_round_trips_and_a_foreign_or_huge_one_is_ignored(tmp_path):
    urls = ["s3://b/1", "s3://b/2"]
    listing = ListingFile(tmp_path / "state", urls)
    assert listing.load() is None
    listing.save({"s3://b/1": (10, "ETag=a"), "s3://b/2": (-1, "error:404")})
    entries, taken = listing.load() or ({}, 0.0)
    assert entries == {"s3://b/1": (10, "ETag=a"), "s3://b/2": (-1, "error:404")}
    assert abs(taken - time.time()) < 60
    assert ListingFile(tmp_path / "state", urls[::-1]).path == listing.path  # order-free
    Path(listing.path).write_text('{"version": 1, "time": 1, "entries": {"u": [1]}}')
    assert listing.load() is None
    if os.geteuid() == 0:
        listing.save({"s3://b/1": (10, "ETag=a")})
        os.chown(listing.path, 23402, 23402)
        assert listing.load() is None


def test_offline_true_never_calls_and_auto_answers_from_the_kept_listing(tmp_path, caplog):
    calls = {"n": 0}

    class Fake(Remote):
        def _fresh_stamps(self, urls):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if self.fail:
                return self.call(urls[0], refused)
            return {u: (5, "ETag=x") for u in urls}

    urls = ["s3://b/1", "s3://b/2"]
    remote = Fake({}, offline="auto", listing_dir=tmp_path, retries=RetryPolicy(attempts=1))
    remote.fail = False  # type: ignore[attr-defined]
    assert remote.stamps(urls) == {u: (5, "ETag=x") for u in urls} and not remote.stale
    remote.fail = True  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        assert remote.stamps(urls) == {u: (5, "ETag=x") for u in urls}
        assert remote.stamps(urls) == {u: (5, "ETag=x") for u in urls}
    assert remote.stale
    assert len([r for r in caplog.records if "not fresh" in r.getMessage()]) == 1  # once
    strict = Fake({}, offline=False, listing_dir=tmp_path, retries=RetryPolicy(attempts=1))
    strict.fail = True  # type: ignore[attr-defined]
    with pytest.raises(RemoteError) as info:
        strict.stamps(urls)
    assert info.value.kind == "unreachable"
    never = Fake({}, offline=True, listing_dir=tmp_path)
    before = calls["n"]
    assert never.stamps(urls) == {u: (5, "ETag=x") for u in urls}
    assert calls["n"] == before and never.stale
    with pytest.raises(RemoteError) as info:
        never.read("s3://b/1", 0, 5)
    assert info.value.kind == "offline"
    with pytest.raises(RemoteError, match="offline"):
        Fake({}, offline=True, listing_dir=tmp_path / "empty").stamps(urls)
    with pytest.raises(ConfigError, match="offline"):
        Remote({}, offline="sometimes")  # type: ignore[arg-type]


def test_a_state_file_of_another_user_is_refused_with_a_clear_message(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    path = tmp_path / "mmcache-state.json"
    path.write_text("{}")
    os.chown(path, 23402, 23402)
    with pytest.raises(ConfigError, match=r"belongs to uid 23402.*state_dir="):
        SharedStamps(str(path))


def test_a_failed_publish_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    stamps = SharedStamps(str(blocker / "state.json"))  # its folder cannot be made
    with caplog.at_level(logging.WARNING):
        assert stamps.publish({"a": 1}) is False
    assert "cannot hand the revalidated stamps" in caplog.text


def test_the_private_dir_is_this_users_and_0700(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = private_dir()
    st = os.stat(path)
    assert path == str(tmp_path / "mmcache") and st.st_uid == os.getuid()
    assert st.st_mode & 0o777 == 0o700
    os.chmod(path, 0o777)
    with pytest.raises(ConfigError, match="not a private folder"):
        private_dir()


def test_polls_wait_while_a_revalidation_is_under_way(tmp_path):
    writer = SharedStamps(str(tmp_path / "s.json"))
    reader = SharedStamps(str(tmp_path / "s.json"))
    writer.begin()
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(reader.poll()))
    thread.start()
    time.sleep(0.1)
    assert thread.is_alive() and not got  # held back
    writer.publish({"v": 2})
    writer.end()
    thread.join(5)
    assert got == [{"v": 2}]
    stale = SharedStamps(str(tmp_path / "t.json"), pending_s=0.0)
    stale.begin()  # a crashed reviser's mark is ignored once older than pending_s
    time.sleep(0.01)
    assert stale.poll() is None


def test_calls_of_two_objects_that_wait_out_their_deadline_open_the_breaker_and_probes_are_short():
    # One object that waits out its deadline is that object's failure (H6, below); a
    # second object that does too is a black-holed network: the breaker opens.
    clock = Clock()
    policy = RetryPolicy(attempts=3, call_deadline=20.0, connect_timeout=2.0, breaker_after=3)
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)
    given: list[float | None] = []

    def black_hole(left: float | None) -> bytes:
        given.append(left)
        clock.now += left or 0.0
        raise TimeoutError("no answer")

    with pytest.raises(RemoteError) as info:
        remote.attempt("s3://b/k", black_hole)
    assert info.value.kind == "timeout" and given == [20.0] and not remote.unreachable
    with pytest.raises(RemoteError) as info:
        remote.attempt("s3://b/j", black_hole)
    assert info.value.kind == "timeout" and given == [20.0, 20.0] and remote.unreachable
    remote.new_epoch()
    with pytest.raises(RemoteError):
        remote.attempt("s3://b/k", black_hole)  # the epoch's probe: connect_timeout only
    assert given == [20.0, 20.0, 2.0]


def test_one_object_that_times_out_never_opens_the_breaker_for_the_healthy_ones():
    # H6: one object trickling its bytes (or never answering for it) until every call's
    # deadline is refused alone, however often it is asked for; the others are served.
    clock = Clock()
    policy = RetryPolicy(attempts=3, backoff=0.1, call_deadline=20.0, breaker_after=3)
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)

    def slow(left: float | None) -> bytes:
        clock.now += (left or 0.0) / 3  # three tries fit in the deadline
        raise TimeoutError("read timed out")

    for _ in range(3):  # asked for again and again, between healthy objects
        with pytest.raises(RemoteError, match="read timed out") as info:
            remote.attempt("s3://b/slow", slow)
        assert info.value.kind == "timeout" and not remote.unreachable
        assert remote.attempt("s3://b/ok", lambda left: b"ok") == b"ok"
    for _ in range(3):  # also in a row, with no healthy call between
        with pytest.raises(RemoteError):
            remote.attempt("s3://b/slow", slow)
    assert not remote.unreachable
    assert remote.attempt("s3://b/ok", lambda left: b"ok") == b"ok"
    # timeouts on three distinct objects in a row are the store's: it opens
    for name in ("a", "b", "c"):
        with pytest.raises(RemoteError):
            remote.attempt(f"s3://b/{name}", slow)
    assert remote.unreachable


def test_a_timeout_while_connecting_counts_as_the_stores():
    clock = Clock()
    policy = RetryPolicy(attempts=3, backoff=0.1, breaker_after=3)
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)

    class ConnectTimeoutError(TimeoutError):  # botocore's name for it
        pass

    def unreachable(left: float | None) -> bytes:
        raise ConnectTimeoutError("connect timed out")

    with pytest.raises(RemoteError):
        remote.attempt("s3://b/k", unreachable)  # 3 tries of one object
    assert remote.unreachable


def test_a_store_that_stalls_every_answer_midway_opens_the_breaker():
    # Timeouts after the server began to answer (HTTP 206, then too few bytes) count as
    # the object's, like any timeout: a store that stalls them all still opens it.
    clock = Clock()
    policy = RetryPolicy(attempts=3, call_deadline=20.0, connect_timeout=2.0, breaker_after=3)
    remote = Remote({}, retries=policy, sleep=clock.sleep, clock=clock)

    def stalled(url: str) -> Callable[[float | None], bytes]:
        def op(left: float | None) -> bytes:
            clock.now += left or 0.0
            raise RemoteError(url, 206, False, "sent 10 of 643 bytes", kind="timeout")

        return op

    for name in ("a", "b"):
        with pytest.raises(RemoteError) as info:
            remote.attempt(f"s3://b/{name}", stalled(f"s3://b/{name}"))
        assert info.value.status == 206 and "HTTP 206" in str(info.value)
    assert remote.unreachable
