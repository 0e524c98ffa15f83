"""Properties of the wire decoder, searched by hypothesis: whatever arrives (any bytes, any frame
list, any JSON in any envelope field, with or without a valid MAC), ``Codec.decode`` returns a
Message or raises a ProtocolError with a known reason; nothing else ever escapes it."""

from __future__ import annotations

import hmac
import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanguard import ProtocolError
from nanguard.link import Link
from nanguard.protocol import VERDICTS_IN_JOB, WIRE_REASONS
from nanguard.wire import TYPES, Codec, Message

from test_wire import BODIES, EVENT

RECEIVER = "coordinator@h:1:aa"
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# any JSON value, with the integers JSON allows but no float holds, and strings the schemas know
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
    | st.sampled_from(["nan", "inf", "-inf", "", RECEIVER, *TYPES]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children,
                                                                        max_size=5),
    max_leaves=30)


def decoded_or_refused(codec: Codec, frames) -> Message | None:
    """The property itself: a Message, or None after a ProtocolError with a known reason."""
    try:
        message = codec.decode(frames)
    except ProtocolError as exc:
        assert exc.reason in WIRE_REASONS, exc.reason
        return None
    assert isinstance(message, Message)
    return message


def signed(payload: bytes, token: str | None) -> list[bytes]:
    """The frames a holder of ``token`` would send for ``payload`` (a valid MAC)."""
    return [payload] if token is None else [payload, hmac.digest(token.encode(), payload, "sha256")]


@PROPERTY
@given(frames=st.lists(st.binary(max_size=300), max_size=4), token=st.sampled_from([None, "tok"]))
def test_any_frames(frames, token):
    decoded_or_refused(Codec(RECEIVER, token), frames)


@PROPERTY
@given(payload=st.binary(max_size=2000), token=st.sampled_from([None, "tok"]))
def test_any_payload_with_a_valid_mac(payload, token):
    decoded_or_refused(Codec(RECEIVER, token), signed(payload, token))


@PROPERTY
@given(type_=st.sampled_from(TYPES), field=st.sampled_from(["v", "type", "sender", "seq", "time", "to", "body"]),
       value=json_values, drop=st.booleans(), token=st.sampled_from([None, "tok"]))
def test_any_value_in_any_envelope_field(type_, field, value, drop, token):
    envelope = {"v": 2, "type": type_, "sender": "s", "seq": 1, "time": time.time(), "to": RECEIVER,
                "body": BODIES[type_]}
    if drop:
        del envelope[field]
    else:
        envelope[field] = value
    decoded_or_refused(Codec(RECEIVER, token), signed(json.dumps(envelope).encode(), token))


@PROPERTY
@given(type_=st.sampled_from(TYPES), data=st.data())
def test_any_value_in_any_body_field(type_, data):
    body = json.loads(json.dumps(BODIES[type_]))
    target = body
    # walk down to some object or list inside the body, then replace or add one of its items
    while isinstance(target, (dict, list)) and target and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
        if not isinstance(target[key], (dict, list)) or not target[key]:
            break
        target = target[key]
    if isinstance(target, dict):
        target[data.draw(st.sampled_from(sorted(target) or ["x"]) | st.text(max_size=8))] = data.draw(json_values)
    elif isinstance(target, list) and target:
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(json_values)
    envelope = {"v": 2, "type": type_, "sender": "s", "seq": 1, "time": time.time(), "to": RECEIVER,
                "body": body}
    decoded_or_refused(Codec(RECEIVER, None), [json.dumps(envelope).encode()])


@PROPERTY
@given(payload=st.binary(min_size=1, max_size=400), cut=st.integers(min_value=0, max_value=400),
       depth=st.integers(min_value=0, max_value=3000))
def test_truncated_and_nested_payloads(payload, cut, depth):
    valid = Codec("s", None).encode("hello", BODIES["hello"], to=RECEIVER)[0]
    codec = Codec(RECEIVER, None)
    decoded_or_refused(codec, [valid[:cut]])
    decoded_or_refused(codec, [valid[:cut] + payload])
    nested = b'{"v":2,"type":"hello","sender":"s","seq":1,"time":1,"to":"","body":' + b"[" * depth + b"]" * depth + b"}"
    decoded_or_refused(codec, [nested])


@PROPERTY
@given(frames=st.lists(st.binary(max_size=300), max_size=4), type_=st.sampled_from(TYPES),
       field=st.sampled_from(["time", "to", "sender", "seq", "body"]), value=json_values,
       handshakes=st.integers(0, 2))
def test_the_client_reads_any_reply_as_a_message_or_a_protocol_error(frames, type_, field, value, handshakes):
    """The rank's side: what a hostile coordinator (or whoever took its port) sends."""
    link = Link(Codec("rank3@h:1:aa", None))
    for _ in range(handshakes):
        link.handshake()
    envelope = {"v": 2, "type": type_, "sender": "coordinator", "seq": 1, "time": time.time(),
                "to": link.sender, "body": BODIES[type_]}
    envelope[field] = value
    for attempt in (frames, [json.dumps(envelope).encode()]):
        try:
            message = link.read(attempt, time.time())
        except ProtocolError as exc:
            assert exc.reason in WIRE_REASONS, exc.reason
        else:
            assert isinstance(message, Message) and message.type in ("welcome", "stop", "received")


@PROPERTY
@given(field=st.sampled_from(["reproduced", "verdict"]), value=json_values | st.sampled_from(VERDICTS_IN_JOB),
       compact=st.booleans())
def test_an_event_re_run_field_is_taken_exactly_when_it_is_of_its_vocabulary(field, value, compact):
    """``reproduced``: true, false or null, never 0 or 1; ``verdict``: one of VERDICTS_IN_JOB or
    null. Anything else in one event refuses the message (schema), whatever the rest holds."""
    event = dict(EVENT.to_dict(compact=compact), **{field: value})
    envelope = {"v": 2, "type": "events", "sender": "s", "seq": 1, "time": time.time(), "to": RECEIVER,
                "body": {"rank": 1, "job": "j", "events": [EVENT.to_dict(), event]}}
    message = decoded_or_refused(Codec(RECEIVER, None), [json.dumps(envelope).encode()])
    valid = value is None or (value.__class__ is bool if field == "reproduced" else value in VERDICTS_IN_JOB)
    assert (message is not None) is valid, (field, value)
    if message is not None:
        assert message.body["events"][1][field] is value or message.body["events"][1][field] == value
