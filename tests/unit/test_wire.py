"""The wire protocol: every message type round-trips; every malformed message is refused by name."""

import hashlib
import hmac
import json
import math
import time

import pytest

from nanguard import Event, ProtocolError
from nanguard.protocol import ROLES
from nanguard.protocol import WIRE_REASONS as REASONS
from nanguard.wire import (
    MAX_BYTES,
    MAX_EVENTS,
    MAX_STATUS_BYTES,
    TYPES,
    Codec,
    Message,
    ReplayFilter,
    check_body,
)

RANK_STATUS = {"rank": 1, "host": "node1", "pid": 42, "world_size": 2, "step": 7, "step_time_s": 0.25,
               "grad_norm": "nan", "last_seen": 1.7e9, "alive": True, "stalled": False,
               "finished": False, "failed": False, "events": 3, "dropped": 0}
EVENT = Event(kind="forward", rank=1, step=25, layer="blocks.1.gate", module_type="Linear", has_nan=True,
              shape=(4, 8), first_index=(0, 3), first_value=-math.inf, host="node1", time=1.7e9)

BODIES = {
    "handshake": {},
    "welcome": {"handshake_seq": 1},
    "hello": {"rank": 1, "local_rank": 1, "world_size": 2, "host": "node1", "pid": 42, "job": "j",
              "device": "cuda:1", "version": "0.1.0", "restart": 1},
    "heartbeat": {"rank": 1, "world_size": 2, "job": "j", "host": "node1", "pid": 42, "step": 7,
                  "step_time_s": 0.25, "dropped": 3, "grad_norm": 1.5},
    "events": {"rank": 1, "job": "j", "events": [EVENT.to_dict(), EVENT.to_dict(compact=True)],
               "action": "raise", "first": 40},
    "captured": {"rank": 1, "job": "j", "step": 25, "incident": "/runs/incidents/j-step25"},
    "stopped": {"rank": 1, "job": "j", "step": 25, "reason": "nonfinite"},
    "ack": {"rank": 1, "command_id": "c0ffee"},
    "bye": {"rank": 1, "job": "j", "clean": True},
    "stop": {"command_id": "c0ffee", "reason": "operator says so", "origin": "operator"},
    "received": {"rank": 1, "events": 42},
    "status_request": {},
    "status": {"job": "j", "ranks": [RANK_STATUS],
               "stop": {"command_id": "c0ffee", "origin": "policy", "reason": "r", "time": 1.7e9,
                        "acked": [0, 1], "job": "j", "restart": 0}},
    "stop_request": {"reason": "maintenance"},
    "stop_accepted": {"command_id": "c0ffee", "existing": False},
    "clear_request": {"reason": "fixed the data loader"},
    "cleared": {"command_id": "c0ffee"},
    "refused": {"reason": "stopping a job needs NANGUARD_OPERATOR_TOKEN"},
}
RECEIVER = "coordinator"


def envelope(type_="hello", body=None, **fields):
    data = {"v": 2, "type": type_, "sender": "test", "seq": 1, "time": time.time(), "to": RECEIVER,
            "body": BODIES[type_] if body is None else body}
    data.update(fields)
    return json.dumps(data).encode()


def refused(codec, frames):
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames)
    assert info.value.reason in REASONS
    return info.value


def test_every_type_has_a_test_body():
    assert sorted(BODIES) == sorted(TYPES)


@pytest.mark.parametrize("token", [None, "s3cret"])
@pytest.mark.parametrize("type_", TYPES)
def test_round_trip(type_, token):
    sender, receiver = Codec("rank1@node1:42:ab", token), Codec("coordinator", token)
    frames = sender.encode(type_, BODIES[type_], to="coordinator")
    assert len(frames) == (1 if token is None else 2)
    assert b"\n" not in frames[0]
    message = receiver.decode(frames)
    assert isinstance(message, Message)
    assert (message.type, message.sender, message.seq) == (type_, "rank1@node1:42:ab", 1)
    assert message.to == "coordinator" and message.role == (None if token is None else "rank")
    assert abs(message.time - time.time()) < 60
    assert message.payload == frames[0]
    assert json.loads(message.payload)["body"] == json.loads(json.dumps(BODIES[type_]))


def round_trip(codec, type_, body):
    """``codec`` sends to itself."""
    return codec.decode(codec.encode(type_, body, to=codec.sender))


def test_normalised_bodies():
    codec = Codec("a", None)
    events = round_trip(codec, "events", BODIES["events"]).body["events"]
    assert [Event(**values) for values in events] == [EVENT, EVENT]
    status = round_trip(codec, "status", BODIES["status"]).body
    assert math.isnan(status["ranks"][0]["grad_norm"])
    beat = dict(BODIES["heartbeat"], grad_norm="inf", step_time_s=None)
    assert round_trip(codec, "heartbeat", beat).body["grad_norm"] == math.inf


def test_a_batchs_first_event_number_is_optional_and_a_count():
    """``first`` numbers a batch for the coordinator's ``received``; a rank of an earlier release
    sends none, and is served as before."""
    codec = Codec("a", None)
    older = {name: value for name, value in BODIES["events"].items() if name != "first"}
    assert "first" not in round_trip(codec, "events", older).body
    assert round_trip(codec, "events", BODIES["events"]).body["first"] == 40
    for bad in (-1, 1.5, "3", True, None):
        error = refused(Codec(RECEIVER, None), [envelope("events", dict(BODIES["events"], first=bad))])
        assert error.reason == "schema" and ".first" in str(error)
    assert round_trip(codec, "received", BODIES["received"]).body == {"rank": 1, "events": 42}


def test_an_event_carries_what_the_re_run_said():
    transient = Event(kind="grad", rank=1, step=25, layer="blocks.1.gate.weight", has_nan=True, host="node1",
                      reproduced=False, verdict="transient", device="cuda:1 GPU-5c1e0a2b-77d3")
    codec = Codec("a", None)
    for event in (transient.to_dict(), transient.to_dict(compact=True)):
        body = round_trip(codec, "events", dict(BODIES["events"], events=[event])).body
        assert Event(**body["events"][0]) == transient


@pytest.mark.parametrize("field, value", [("reproduced", 0), ("reproduced", "no"), ("verdict", "maybe"),
                                          ("device", "cuda:0\x1b[2J"), ("device", "\u202ecuda:0"),
                                          ("device", "c" * 257), ("device", 7)])
def test_an_event_with_a_bad_re_run_field_is_refused_as_schema(field, value):
    event = dict(EVENT.to_dict(compact=True), **{field: value})
    error = refused(Codec(RECEIVER, None), [envelope("events", dict(BODIES["events"], events=[event]))])
    assert error.reason == "schema" and field in str(error)


def test_seq_grows_per_codec():
    codec = Codec("a", None)
    seqs = [round_trip(codec, "bye", BODIES["bye"]).seq for _ in range(3)]
    assert seqs == [1, 2, 3]
    assert round_trip(Codec("b", None), "bye", BODIES["bye"]).seq == 1


def test_mac_is_hmac_sha256_of_the_payload():
    payload, mac = Codec("a", "tok").encode("bye", BODIES["bye"], to="c")
    assert mac == hmac.new(b"tok", payload, hashlib.sha256).digest()


def test_envelope_of_version_2():
    payload = Codec("rank1@h:1:ab", None).encode("handshake", {}, to="")[0]
    data = json.loads(payload)
    assert list(data) == ["v", "type", "sender", "seq", "time", "to", "body"]
    assert (data["v"], data["type"], data["to"], data["body"]) == (2, "handshake", "", {})


def test_only_a_handshake_goes_to_nobody_and_every_other_message_to_its_receiver():
    sender, receiver = Codec("rank1", None), Codec("coordinator@h:1:aa", None)
    assert receiver.decode(sender.encode("handshake", {}, to="")).type == "handshake"
    assert receiver.decode(sender.encode("hello", BODIES["hello"], to="coordinator@h:1:aa")).type == "hello"
    for type_, to in [("hello", ""), ("stop_request", ""), ("hello", "coordinator@h:1:bb"),
                      ("handshake", "coordinator@other")]:
        error = refused(receiver, sender.encode(type_, BODIES[type_], to=to))
        assert error.reason == "instance" and "coordinator@h:1:aa" in str(error)


def test_roles_sign_and_verify_with_their_own_keys():
    coordinator = Codec("c", "rank-secret", operator_token="operator-secret")
    rank, operator = Codec("r", "rank-secret"), Codec("o", operator_token="operator-secret")
    assert coordinator.decode(rank.encode("heartbeat", BODIES["heartbeat"], to="c")).role == "rank"
    assert coordinator.decode(operator.encode("stop_request", {"reason": "x"}, to="c")).role == "operator"
    # a rank holds no operator key: whatever it signs is a rank's message
    assert coordinator.decode(rank.encode("stop_request", {"reason": "x"}, to="c")).role == "rank"
    # the coordinator answers each with its own key, and each side verifies it
    assert operator.decode(coordinator.encode("status", BODIES["status"], to="o", role="operator")).role \
        == "operator"
    assert rank.decode(coordinator.encode("stop", BODIES["stop"], to="r", role="rank")).role == "rank"
    assert refused(rank, coordinator.encode("stop", BODIES["stop"], to="r", role="operator")).reason \
        == "unauthenticated"
    assert sorted(role for role in ROLES if coordinator.holds(role)) == ["operator", "rank"]


def test_an_operator_token_alone_leaves_ranks_open_but_not_stops():
    coordinator = Codec("c", None, operator_token="operator-secret")
    assert coordinator.decode(Codec("r", None).encode("hello", BODIES["hello"], to="c")).role is None
    forged = Codec("x", "guess").encode("stop_request", {"reason": "x"}, to="c")
    assert refused(coordinator, forged).reason == "unauthenticated"


def test_the_operator_token_must_differ_from_the_rank_token():
    with pytest.raises(ValueError, match="must differ"):
        Codec("c", "same", operator_token="same")


@pytest.mark.parametrize("frames, reason, fragment", [
    ([], "malformed", "got 0"),
    ([envelope(), b"", b""], "malformed", "got 3"),
    ([b""], "malformed", "empty"),
    ([b"not json"], "malformed", "not JSON"),
    ([b"\xff\xfe"], "malformed", "not JSON"),
    ([b'{"v": NaN}'], "malformed", "not JSON"),
    ([b"[" * 100_000], "oversized", "over the limit"),
    ([b"[" * 60_000], "malformed", "not JSON"),
    ([b"[1, 2]"], "malformed", "not a JSON object"),
    ([envelope(v=1)], "version", "version 1"),
    ([envelope(v=3)], "version", "version 3"),
    ([envelope(v=True)], "version", "version True"),
    ([b'{"type": "hello"}'], "version", "version None"),
    ([envelope(extra=1)], "malformed", "envelope"),
    ([envelope(type=3)], "malformed", "type"),
    ([envelope(sender="")], "malformed", "sender"),
    ([envelope(sender="x" * 300)], "malformed", "sender"),
    ([envelope(seq=-1)], "malformed", "seq"),
    ([envelope(seq="1")], "malformed", "seq"),
    ([envelope(time="now")], "malformed", "time"),
    ([envelope(time=10**400)], "malformed", "time 1000"),
    ([envelope(time=-(10**400))], "malformed", "time -1000"),
    ([envelope(to=None)], "malformed", "to None"),
    ([envelope(to="x" * 300)], "malformed", "to 'xxx"),
    ([envelope(to="someone else")], "instance", "addressed to 'someone else'"),
    ([envelope(to="")], "instance", "addressed to nobody"),
    ([envelope(type="reboot", body={})], "schema", "unknown message type"),
    ([envelope(body=[])], "schema", "expected an object"),
    ([envelope(body={"rank": 1})], "schema", "missing field(s) local_rank"),
    ([envelope(body=dict(BODIES["hello"], colour="red"))], "schema", "unknown field(s) colour"),
    ([envelope(body=dict(BODIES["hello"], rank=-1))], "schema", ".rank: expected an integer"),
    ([envelope(body=dict(BODIES["hello"], rank=True))], "schema", ".rank"),
    ([envelope(body=dict(BODIES["hello"], world_size=10**9))], "schema", ".world_size"),
    ([envelope(body=dict(BODIES["hello"], pid="42"))], "schema", ".pid"),
    ([envelope(body=dict(BODIES["hello"], host="h" * 300))], "schema", ".host: expected a string"),
    ([envelope("heartbeat", dict(BODIES["heartbeat"], step_time_s=-1.0))], "schema", ".step_time_s"),
    ([envelope("heartbeat", dict(BODIES["heartbeat"], grad_norm="lots"))], "schema", ".grad_norm"),
    ([envelope("heartbeat", dict(BODIES["heartbeat"], grad_norm=10**400))], "schema", ".grad_norm"),
    ([envelope("heartbeat", dict(BODIES["heartbeat"], step_time_s=10**400))], "schema", ".step_time_s"),
    ([envelope("events", dict(BODIES["events"], events=[dict(EVENT.to_dict(), finite_max=10**400)]))],
     "schema", "finite_max is an integer too large"),
    ([envelope("events", dict(BODIES["events"], events=[dict(EVENT.to_dict(), layer=json.loads("[" * 900 + "]" * 900))]))],
     "schema", "[[[...]]]"),
    ([envelope("bye", {"rank": 1, "job": "j"})], "schema", "missing field(s) clean"),
    ([envelope("bye", dict(BODIES["bye"], clean="yes"))], "schema", ".clean"),
    ([envelope("heartbeat", dict(BODIES["heartbeat"], dropped=-5))], "schema", ".dropped"),
    ([envelope("events", dict(BODIES["events"], events=[]))], "schema", "1 to 256 items, got 0"),
    ([envelope("events", dict(BODIES["events"], events=[{"kind": "loss"}] * 300))], "schema", "got 300"),
    ([envelope("events", dict(BODIES["events"], action="panic"))], "schema", ".action: expected one of"),
    ([envelope("events", dict(BODIES["events"], events=[dict(EVENT.to_dict(), kind="boom")]))],
     "schema", ".events[0]: event kind 'boom'"),
    ([envelope("events", dict(BODIES["events"], events=[EVENT.to_dict(), dict(EVENT.to_dict(), step=-3)]))],
     "schema", ".events[1]: negative"),
    ([envelope("events", dict(BODIES["events"], events=[dict(EVENT.to_dict(), layer="x" * 2000)]))],
     "schema", ".events[0].layer"),
    ([envelope("events", dict(BODIES["events"], events=["forward"]))], "schema", "must be a JSON object"),
    ([envelope("events", dict(BODIES["events"], events=[dict(EVENT.to_dict(), rank=None)]))],
     "schema", "rank=None is not an integer"),
    ([envelope("stopped", dict(BODIES["stopped"], reason="bored"))], "schema", ".reason"),
    ([envelope("stop", dict(BODIES["stop"], reason="r" * 501))], "schema", ".reason"),
    ([envelope("stop", dict(BODIES["stop"], origin="rank"))], "schema", ".origin"),
    ([envelope("status", dict(BODIES["status"], ranks=[dict(RANK_STATUS, alive=1)]))],
     "schema", ".ranks[0].alive: expected true or false"),
    ([envelope("status_request", {"all": True})], "schema", "unknown field(s) all"),
])
def test_malformed_messages_are_refused_with_a_reason(frames, reason, fragment):
    error = refused(Codec("coordinator", None), frames)
    assert error.reason == reason
    assert fragment in str(error)


def test_oversized_is_refused_on_both_sides():
    codec = Codec("a", None)
    too_many = dict(BODIES["events"], events=[dict(EVENT.to_dict(), message="m" * 1900)] * 40)
    with pytest.raises(ProtocolError) as info:
        codec.encode("events", too_many, to="c")
    assert info.value.reason == "oversized"
    assert refused(codec, [b" " * (MAX_BYTES + 1)]).reason == "oversized"
    # a status may be larger, and an operator codec reads it
    ranks = [dict(RANK_STATUS, rank=r) for r in range(1000)]
    frames = Codec("c", None).encode("status", dict(BODIES["status"], ranks=ranks), to="op")
    assert len(frames[0]) > MAX_BYTES
    assert refused(codec, frames).reason == "oversized"
    assert len(Codec("op", None, max_bytes=MAX_STATUS_BYTES).decode(frames).body["ranks"]) == 1000


def test_events_batch_of_max_size_fits():
    compact = Event(kind="grad", rank=3, step=10**6, layer="model.layers.31.mlp.down_proj.weight",
                    has_nan=True).to_dict(compact=True)
    codec = Codec("a", None)
    body = round_trip(codec, "events", {"rank": 3, "job": "j", "events": [compact] * MAX_EVENTS})
    assert len(body.body["events"]) == MAX_EVENTS


@pytest.mark.parametrize("sender_token, receiver_token, fragment", [
    ("tok", None, "no token is configured here"),
    (None, "tok", "no MAC"),
    ("tok", "other", "does not match"),
])
def test_unauthenticated(sender_token, receiver_token, fragment):
    frames = Codec("a", sender_token).encode("bye", BODIES["bye"], to="b")
    error = refused(Codec("b", receiver_token), frames)
    assert error.reason == "unauthenticated" and fragment in str(error)


def test_tampered_payload_is_unauthenticated():
    payload, mac = Codec("a", "tok").encode("stop_request", {"reason": "x"}, to="b")
    forged = payload.replace(b'"x"', b'"y"')
    assert refused(Codec("b", "tok"), [forged, mac]).reason == "unauthenticated"
    assert refused(Codec("b", "tok"), [payload, mac[:-1]]).reason == "unauthenticated"


def test_replay_filter():
    codec, receiver = Codec("rank0", None), Codec("c", None)
    first, second = (receiver.decode(codec.encode("bye", BODIES["bye"], to="c")) for _ in range(2))
    replay = ReplayFilter(window_s=300)
    now = time.time()
    replay.check(first, now)
    replay.check(second, now)
    for message in (second, first):
        with pytest.raises(ProtocolError) as info:
            replay.check(message, now)
        assert info.value.reason == "replayed"
    for skew in (-301, 301):
        with pytest.raises(ProtocolError) as info:
            replay.check(receiver.decode(codec.encode("bye", BODIES["bye"], to="c")), now + skew)
        assert info.value.reason == "stale"


def test_replay_filter_memory_is_bounded():
    replay = ReplayFilter(max_senders=3)
    now = time.time()
    for name in "abcd":
        replay.check(Message("bye", name, 1, now, "c", {}, b""), now)
    assert len(replay) == 3
    replay.check(Message("bye", "a", 1, now, "c", {}, b""), now)  # "a" was forgotten first
    with pytest.raises(ProtocolError):
        replay.check(Message("bye", "d", 1, now, "c", {}, b""), now)


def test_check_body_wraps_event_errors_as_schema():
    with pytest.raises(ProtocolError) as info:
        check_body("events", {"rank": 0, "job": "j", "events": [{"kind": "forward"}]})
    assert info.value.reason == "schema" and "missing the field 'rank'" in str(info.value)


def test_protocol_error_is_backwards_compatible():
    error = ProtocolError("old style")
    assert error.reason == "malformed" and isinstance(error, ValueError)


def test_encode_refuses_unknown_types_and_nan():
    codec = Codec("a", None)
    with pytest.raises(ValueError, match="unknown message type"):
        codec.encode("reboot", {}, to="c")
    with pytest.raises(ValueError):
        codec.encode("heartbeat", dict(BODIES["heartbeat"], grad_norm=math.nan), to="c")


def _mutations(value, rng):
    """``value`` with one field, item or value somewhere inside replaced by something odd."""
    odd = [None, True, -1, 2**70, 1.5, "", "x" * 600, "nan", [], {}, [1, "a"], {"k": None}]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value))
        out = dict(value)
        if rng.random() < 0.15:
            del out[key]
        else:
            out[key] = _mutations(value[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out = list(value)
        index = rng.randrange(len(out))
        out[index] = _mutations(out[index], rng)
        return out
    return rng.choice(odd)


def test_fuzzed_messages_raise_only_protocol_errors():
    import random

    rng = random.Random(1234)
    codec = Codec(RECEIVER, None)
    for _ in range(3000):
        type_ = rng.choice(TYPES)
        envelope_ = json.loads(envelope(type_))
        mutated = _mutations(envelope_, rng)
        payload = json.dumps(mutated).encode()
        if rng.random() < 0.2:  # and some byte-level damage
            cut = rng.randrange(len(payload))
            payload = payload[:cut] + bytes([rng.randrange(256)]) + payload[cut + 1:]
        try:
            codec.decode([payload])
        except ProtocolError as exc:
            assert exc.reason in REASONS
