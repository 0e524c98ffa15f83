"""The coordinator's stop policy: pure, so every case is a few calls with made-up times."""

import pytest

from nanguard.coordinator.policy import Policy
from nanguard.errors import ConfigError


def test_default_stops_at_the_first_non_finite_event_once():
    policy = Policy()
    decision = policy.observe("forward", 1, 25, "blocks.1.gate", "raise", now=100.0)
    assert decision is not None
    assert decision.reason == "non-finite forward event on rank 1 at step 25 (layer blocks.1.gate)"
    assert (decision.label, decision.kind, decision.rank, decision.step) == ("nonfinite", "forward", 1, 25)
    assert policy.observe("grad", 0, 25, "w", "raise", now=100.1) is None
    assert policy.observe("forward", 1, 26, "x", "raise", now=200.0) is None


def test_loss_has_no_layer_in_the_reason():
    assert Policy().observe("loss", 0, 3, "", None, 1.0).reason == "non-finite loss event on rank 0 at step 3"


@pytest.mark.parametrize("kind", ["grad_norm", "spike"])
def test_warning_kinds_never_stop(kind):
    policy = Policy(stop_kinds=("forward", kind))
    assert all(policy.observe(kind, 0, s, "", "warn", float(s)) is None for s in range(10))


def test_configured_warn_kinds_never_stop():
    policy = Policy(warn_kinds=("backward",))
    assert policy.observe("backward", 0, 1, "x", "raise", 1.0) is None
    assert policy.observe("grad", 0, 1, "x", "raise", 1.0) is not None


def test_skipped_steps_are_ignored_unless_asked():
    assert Policy().observe("forward", 0, 1, "x", "skip", 1.0) is None
    assert Policy(ignore_skipped=False).observe("forward", 0, 1, "x", "skip", 1.0) is not None


def test_stop_after_counts_distinct_steps_within_the_window():
    policy = Policy(stop_after=3, window_s=60.0)
    assert policy.observe("forward", 0, 10, "a", "warn", 0.0) is None
    assert policy.observe("grad", 1, 10, "b", "warn", 1.0) is None  # same step: still one
    assert policy.observe("forward", 0, 11, "a", "warn", 2.0) is None
    assert policy.observe("forward", 0, 12, "a", "warn", 61.0) is None  # step 10 left the window
    decision = policy.observe("loss", 2, 13, "", "warn", 61.5)
    assert decision is not None and decision.label == "policy"
    assert decision.reason == ("non-finite values in 3 steps within 60 s; the last: loss event on rank 2 "
                               "at step 13")


def test_reset_starts_a_new_job():
    policy = Policy()
    assert policy.observe("forward", 0, 1, "x", None, 1.0) is not None
    policy.reset()
    assert policy.observe("forward", 0, 1, "x", None, 2.0) is not None


def test_long_layer_names_are_cut():
    decision = Policy().observe("forward", 0, 1, "x" * 5000, None, 1.0)
    assert len(decision.reason) < 500


@pytest.mark.parametrize("kwargs, fragment", [
    ({"stop_after": 0}, "stop_after"),
    ({"stop_after": True}, "stop_after"),
    ({"window_s": 0}, "window_s"),
    ({"warn_kinds": ("nan",)}, "unknown event kind"),
    ({"stop_kinds": ("forward", "explosion")}, "unknown event kind"),
])
def test_bad_configuration(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Policy(**kwargs)
