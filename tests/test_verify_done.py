"""The verify_done wait in the seed's five cases, plus the mode switch."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from jeagle.runtime.stats import latency_stats
from jeagle.runtime.verify_done import STREAM_WAIT_ENV, VerifyDone, verify_done_mode


class Spy:
    def __init__(self, fail=False):
        self.blocked, self.checked, self.fail = [], [], fail

    def block(self, x):
        self.blocked.append(x)

    def check(self, x):
        self.checked.append(x)
        if self.fail:
            raise RuntimeError("event invalid")


def waiter(mode, spy):
    return VerifyDone(mode, block=spy.block, check=spy.check)


def test_dataflow_by_default(monkeypatch):
    monkeypatch.delenv(STREAM_WAIT_ENV, raising=False)
    spy = Spy()
    vd = waiter(verify_done_mode(None), spy)
    assert vd.mode == "dataflow"
    vd.record("round-1")
    vd.wait()
    assert spy.checked == ["round-1"] and spy.blocked == [] and not vd.pending
    assert verify_done_mode("sync") == "sync"  # the flag wins over the environment


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_sync_when_the_environment_turns_the_stream_wait_off(monkeypatch, value):
    monkeypatch.setenv(STREAM_WAIT_ENV, value)
    spy = Spy()
    vd = waiter(verify_done_mode(None), spy)
    assert vd.mode == "sync"
    vd.record("round-1")
    vd.wait()
    assert spy.blocked == ["round-1"] and spy.checked == [] and not vd.pending
    assert verify_done_mode("dataflow") == "dataflow"


def test_noop_with_nothing_pending():
    spy = Spy()
    for mode in ("sync", "dataflow"):
        assert waiter(mode, spy).wait() == 0.0
    assert spy.blocked == [] and spy.checked == []


def test_fallback_to_the_hard_wait_is_logged(caplog):
    spy = Spy(fail=True)
    vd = waiter("dataflow", spy)
    vd.record("round-1")
    with caplog.at_level(logging.ERROR, logger="jeagle.runtime"):
        vd.wait()
    assert spy.blocked == ["round-1"] and vd.fallbacks == 1
    assert any("falling back to the hard wait" in r.getMessage() and r.exc_info for r in caplog.records)


@pytest.mark.parametrize("mode", ["sync", "dataflow"])
def test_consumed_once(mode):
    spy = Spy()
    vd = waiter(mode, spy)
    vd.record("round-1")
    vd.wait()
    vd.wait()
    assert len(spy.blocked) + len(spy.checked) == 1


def test_real_arrays_and_a_deleted_handle(caplog):
    x = jnp.arange(4)
    vd = VerifyDone("dataflow")
    vd.record({"accept": x})
    vd.wait()
    assert vd.fallbacks == 0
    y = jnp.arange(4) + 1
    y.delete()
    vd.record(y)
    with caplog.at_level(logging.ERROR, logger="jeagle.runtime"), pytest.raises(RuntimeError):
        vd.wait()  # the fallback hard wait on a deleted array raises: the error is not swallowed
    assert vd.fallbacks == 1


def test_bad_modes_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="verify-done-wait"):
        verify_done_mode("eventually")
    monkeypatch.setenv(STREAM_WAIT_ENV, "maybe")
    with pytest.raises(ValueError, match=STREAM_WAIT_ENV):
        verify_done_mode(None)


def test_latency_stats():
    assert latency_stats([]) is None
    s = latency_stats([0.001, 0.002, 0.003])
    assert s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)
