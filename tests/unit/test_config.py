import pytest

from nanguard.config import Settings
from nanguard.errors import ConfigError


def test_defaults():
    s = Settings.resolve({}, environ={})
    assert s.on_nan == "raise" and s.dir == "nanguard-incidents" and not s.disable


def test_environment_then_overrides():
    env = {"NANGUARD_ON_NAN": "skip", "NANGUARD_MAX_EVENTS": "7", "NANGUARD_DISABLE": "0",
           "NANGUARD_SKIP_TYPES": "Dropout, MyMask", "NANGUARD_GRAD_NORM_WARN": "off"}
    s = Settings.resolve({}, environ=env)
    assert (s.on_nan, s.max_events, s.disable, s.skip_types, s.grad_norm_warn) == (
        "skip", 7, False, ("Dropout", "MyMask"), None)
    assert Settings.resolve({"on_nan": "warn"}, environ=env).on_nan == "warn"


@pytest.mark.parametrize("env, fragment", [
    ({"NANGUARD_ON_NAN": "explode"}, "NANGUARD_ON_NAN"),
    ({"NANGUARD_MAX_EVENTS": "many"}, "NANGUARD_MAX_EVENTS"),
    ({"NANGUARD_DISABLE": "maybe"}, "NANGUARD_DISABLE"),
    ({"NANGUARD_COORDINATOR": "localhost:5555"}, "tcp://"),
])
def test_bad_environment_names_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Settings.resolve({}, environ=env)


@pytest.mark.parametrize("overrides, fragment", [
    ({"on_nan": "stop"}, "on_nan"),
    ({"max_events": 0}, "max_events"),
    ({"max_events": True}, "max_events"),
    ({"spike_factor": 0.5}, "spike_factor"),
    ({"grad_norm_warn": -1.0}, "grad_norm_warn"),
    ({"detail_mb": -1}, "detail_mb"),
    ({"skip_modules": "head"}, "skip_modules"),
    ({"no_such_thing": 1}, "unknown nanguard setting"),
])
def test_bad_overrides(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Settings.resolve(overrides, environ={})


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        Settings.resolve({"on_nan": "x"}, environ={})


def test_setting_from_env_reads_one_variable_only():
    from nanguard.config import setting_from_env

    env = {"NANGUARD_TOKEN": " s3cret ", "NANGUARD_ON_NAN": "explode"}  # a bad guard-only value
    assert setting_from_env("token", env) == "s3cret"
    assert setting_from_env("coordinator", env) is None
    with pytest.raises(ConfigError, match="NANGUARD_MAX_EVENTS"):
        setting_from_env("max_events", {"NANGUARD_MAX_EVENTS": "many"})
    with pytest.raises(ConfigError, match="unknown nanguard setting"):
        setting_from_env("colour", env)


@pytest.mark.parametrize("address", ["tcp://localhost", "tcp://127.0.0.1:99999", "tcp://:5555",
                                     "tcp://host:0", "ipc://", "udp://host:5555", "tcp://a b:5555"])
def test_a_coordinator_address_that_cannot_work_is_refused(address):
    with pytest.raises(ConfigError, match="tcp://host:port"):
        Settings.resolve({"coordinator": address}, environ={})
    with pytest.raises(ConfigError, match="NANGUARD_COORDINATOR"):
        Settings.resolve({}, environ={"NANGUARD_COORDINATOR": address})


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://coordinator-0.job.svc:5555",
                                     "tcp://[::1]:5555", "ipc:///tmp/nanguard.sock"])
def test_coordinator_addresses_that_work(address):
    assert Settings.resolve({"coordinator": address}, environ={}).coordinator == address
