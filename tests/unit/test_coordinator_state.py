"""The coordinator's state file: the job's stop, written atomically and checked when read back."""

import json

import pytest

from nanguard.coordinator.state import SavedState, StateError, read_state, write_state
from nanguard.coordinator.stop import StopCommand


def stop() -> StopCommand:
    return StopCommand("c0ffee", "operator", "maintenance window", 1_700_000_000.5, "operator", {0, 3},
                       job="job-7", restart=0)


def test_a_stop_is_written_and_read_back(tmp_path):
    path = str(tmp_path / "state.json")
    write_state(path, SavedState("job-7", 16, stop(), restart=1))
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temporary file is renamed
    saved = read_state(path)
    assert (saved.job, saved.world_size, saved.restart) == ("job-7", 16, 1)  # the launch served, restarted
    assert saved.stop.status() == {**stop().status(), "acked": []}  # a new instance's ranks ack anew
    assert (saved.stop.job, saved.stop.restart) == ("job-7", 0)  # the incarnation it stopped
    write_state(path, SavedState("job-8", 4, None))
    assert read_state(path) == SavedState("job-8", 4, None)


def test_a_state_file_of_an_earlier_release_is_read_its_stop_of_its_job_and_no_restart(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "job": "j", "world_size": 2, "stop": {"command_id": "a", "origin": "operator", '
                    '"reason": "r", "time": 1.0, "counted_as": "operator"}}')
    saved = read_state(str(path))
    assert (saved.restart, saved.stop.job, saved.stop.restart) == (None, "j", None)


def test_no_file_is_no_state(tmp_path):
    assert read_state(str(tmp_path / "none.json")) is None


@pytest.mark.parametrize("content, said", [
    (b"{\"version\": 1, \"job\": \"j\"", "is not a nanguard coordinator state"),
    (b"\xff\xfe", "is not a nanguard coordinator state"),
    (b"[]", "expected an object of version, job, world_size, stop and (optional) restart"),
    (b'{"version": 1, "job": "j", "world_size": 2, "restart": -1, "stop": null}', "restart -1 is not"),
    (b'{"version": 9, "job": "j", "world_size": 2, "stop": null}', "version 9"),
    (b'{"version": 1, "job": "j", "world_size": 0, "stop": null}', "world_size 0 is not an integer"),
    (b'{"version": 1, "job": "j", "world_size": 2, "stop": {"command_id": 5}}', "bad field.stop"),
    (b'{"version": 1, "job": "j", "world_size": 2, "stop": "x"}', "bad field"),
    (b'{"version": 1, "job": null, "world_size": null, "stop": {"command_id": "a", "origin": "operator", '
     b'"reason": "r", "time": 1.0}}', "a stop without the job"),
])
def test_a_file_that_is_not_a_state_is_refused_saying_what_and_where(tmp_path, content, said):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateError) as info:
        read_state(str(path))
    assert said in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_the_state_is_one_line_of_json(tmp_path):
    path = tmp_path / "state.json"
    write_state(str(path), SavedState("j", 2, stop()))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["version"] == 1
