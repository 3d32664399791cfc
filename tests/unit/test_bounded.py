"""flagscale/cluster/bounded.py: work that answers in time, fails in time, or does not answer."""

import threading
import time

import pytest

from flagscale.cluster import bounded
from flagscale.errors import ClusterError


def test_the_result_of_work_that_answers_in_time():
    assert bounded.within(5, lambda note: (note("adding"), 1 + 1)[1], "sum") == 2


def test_an_error_of_the_work_is_raised_as_it_was():
    def work(note):
        note("dividing")
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        bounded.within(5, work, "division")


def test_work_that_does_not_answer_names_the_step_it_waits_for():
    release = threading.Event()

    def work(note):
        note("attaching to the cluster")
        note("asking Serve's controller")
        release.wait(30)

    def slow_start(note):
        note("attaching to the cluster")
        time.sleep(1.1)
        note("asking Serve's controller")
        release.wait(30)

    try:
        with pytest.raises(bounded.NoAnswer) as caught:
            bounded.within(0.2, work, "status")
        assert isinstance(caught.value, ClusterError) and caught.value.exit_code == 3
        assert str(caught.value) == "status: no answer within 0.2 s while asking Serve's controller"
        assert caught.value.step == "asking Serve's controller"
        assert bounded.left_behind()  # the thread still waits: the CLI must not run exit handlers after it
        # where the time went: the steps before the one that did not answer, those of a second or more
        with pytest.raises(bounded.NoAnswer) as caught:
            bounded.within(1.5, slow_start, "status")
        assert str(caught.value) == (
            "status: no answer within 1.5 s while asking Serve's controller (before it: attaching to the cluster 1 s)"
        )
    finally:
        release.set()
    for thread in bounded._left_behind:
        thread.join(5)
    assert not bounded.left_behind()


@pytest.mark.parametrize("variable", [bounded.STATUS_BOUND_ENV, bounded.STOP_SERVE_BOUND_ENV])
def test_a_bound_that_is_no_positive_number_is_refused_naming_the_variable(monkeypatch, variable):
    from flagscale.errors import ConfigError

    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ConfigError, match=f"{variable}: not a number of seconds above 0: '{bad}'"):
            bounded.check_env_bounds()
    monkeypatch.setenv(variable, "12.5")
    bounded.check_env_bounds()
    assert bounded.seconds_from_env(variable, 90) == 12.5
    monkeypatch.delenv(variable)
    assert bounded.seconds_from_env(variable, 90) == 90


def test_status_and_stop_read_their_bounds(monkeypatch):
    from flagscale.actions import status

    assert status._timeout_s() == status.STATUS_TIMEOUT_S
    monkeypatch.setenv(bounded.STATUS_BOUND_ENV, "30")
    assert status._timeout_s() == 30
