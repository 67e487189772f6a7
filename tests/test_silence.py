"""app/recovery/silence.py, the one silence detector of the elastic heartbeat and of inplace mode."""
from __future__ import annotations

import time

import pytest

from app.recovery.silence import Silence

pytestmark = pytest.mark.unit


def test_a_beat_that_is_not_a_newer_signed_one_is_no_sign_of_life():
    """Silence counts only a higher beat count: a forged, malformed or replayed beat leaves a hung
    member silent (the fuzzer of tests/test_inplace.py kept a frozen member's beat key busy with such values)."""
    silence = Silence(timeout_s=0.2)
    assert not silence.is_silent("m", 5)
    time.sleep(0.25)
    assert [silence.is_silent("m", c) for c in (None, 5, 4)] == [True, True, True], "not newer: silent"
    assert not silence.is_silent("m", 6), "a newer beat"


def test_each_peer_is_timed_from_its_first_sight_and_its_own_last_beat():
    """The heartbeat's use: ranks, whose store counter reads 0 before their first beat."""
    silence = Silence(timeout_s=0.2)
    assert not silence.is_silent(1, 0)
    time.sleep(0.25)
    assert silence.is_silent(1, 0), "no beat since its first sight"
    assert not silence.is_silent(2, 0), "first seen now: its clock starts now"
    assert not silence.is_silent(1, 1), "it beat again"
