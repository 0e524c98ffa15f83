import dataclasses
import json
import math
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanguard import Event, ProtocolError
from nanguard.events import RecentEvents
from nanguard.protocol import VERDICTS_IN_JOB


def make_event(**kw):
    base = dict(kind="forward", rank=5, step=812, layer="encoder.layers.3.norm", module_type="LayerNorm",
                micro_batch=2, has_nan=True, shape=(4, 16, 4096), numel=262144, bad_count=17, nan_count=17,
                inf_count=0, first_index=(0, 12, 45), first_value=math.nan, finite_min=-3.0,
                finite_max=4.0, finite_mean=0.01, input_nonfinite=False, output_nonfinite=True)
    base.update(kw)
    return Event(**base)


def test_str_is_one_line_and_says_where():
    text = str(make_event())
    assert "\n" not in text
    assert text.startswith("non-finite output in encoder.layers.3.norm (LayerNorm) at step 812, rank 5,"
                           " micro-batch 2: 17 NaN of 262144, first at [0, 12, 45]")


def test_json_round_trip_keeps_non_finite_values():
    event = make_event(first_value=-math.inf, grad_norm=math.nan)
    text = json.dumps(event.to_dict(), allow_nan=False)
    back = Event.from_dict(json.loads(text))
    assert back.first_index == (0, 12, 45) and back.shape == (4, 16, 4096)
    assert back.first_value == -math.inf and math.isnan(back.grad_norm)
    assert back.to_dict() == event.to_dict()


@pytest.mark.parametrize("data, fragment", [
    ([], "JSON object"),
    ({"kind": "forward", "rank": 0, "step": 0}, "layer"),
    ({"kind": "boom", "rank": 0, "step": 0, "layer": ""}, "kind"),
    ({"kind": "grad", "rank": "0", "step": 0, "layer": ""}, "rank"),
    ({"kind": "grad", "rank": 0, "step": 0, "layer": "", "shape": [1, "x"]}, "shape"),
    ({"kind": "grad", "rank": 0, "step": 0, "layer": "", "first_value": "big"}, "first_value"),
    ({"kind": "grad", "rank": 0, "step": 0, "layer": "", "evil": 1}, "unknown"),
])
def test_from_dict_rejects_bad_input(data, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        Event.from_dict(data)


def test_ring_is_bounded_and_thread_safe():
    log = RecentEvents(10)

    def add_many():
        for i in range(1000):
            log.add(make_event(step=i))

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(log) == 10 and log.total == 4000


def test_an_event_of_the_root_module_names_the_model():
    event = Event(kind="forward", rank=0, step=3, layer="", module_type="LM", input_nonfinite=False)
    assert event.where() == "non-finite output in the model (LM) at step 3, rank 0"


@pytest.mark.parametrize("module_type, expected", [
    ("GPT2LMHeadModel", "non-finite loss ('loss' in the output of the model (GPT2LMHeadModel)) at step 4, rank 0"),
    ("", "non-finite loss ('loss' in the output of the model) at step 4, rank 0")])
def test_a_checked_loss_a_model_returned_keeps_a_subject(module_type, expected):
    # a loss event names no module after its kind: the field's phrase must not ask for one
    event = Event(kind="loss", rank=0, step=4, layer="loss", module_type=module_type, output_field="loss")
    assert event.where() == expected


# --- what a re-run of the step said: reproduced, verdict, device ---------------------------------


@pytest.mark.parametrize("reproduced, verdict", [(True, "reproducible"), (False, "transient"),
                                                 (False, "device"), (None, None)])
def test_the_re_run_fields_round_trip_full_and_compact(reproduced, verdict):
    event = make_event(reproduced=reproduced, verdict=verdict, device="cuda:3 GPU-5c1e0a2b", host="gpu-node-7")
    full = json.loads(json.dumps(event.to_dict(), allow_nan=False))
    assert (full["reproduced"], full["verdict"], full["device"]) == (reproduced, verdict, "cuda:3 GPU-5c1e0a2b")
    compact = json.loads(json.dumps(event.to_dict(compact=True), allow_nan=False))
    for back in (Event.from_dict(full), Event.from_dict(compact)):
        assert (back.reproduced, back.verdict, back.device) == (reproduced, verdict, "cuda:3 GPU-5c1e0a2b")
        assert back.to_dict() == event.to_dict()


def test_the_re_run_fields_default_to_unknown_and_stay_off_the_compact_wire():
    event = make_event()
    assert (event.reproduced, event.verdict, event.device) == (None, None, "")
    assert not {"reproduced", "verdict", "device"} & set(event.to_dict(compact=True))
    names = [f.name for f in dataclasses.fields(Event)]
    assert names[names.index("host"):names.index("host") + 4] == ["host", "reproduced", "verdict", "device"]


BASE = {"kind": "grad", "rank": 0, "step": 0, "layer": ""}


@pytest.mark.parametrize("field, value, fragment", [
    ("reproduced", 0, "reproduced=0 is not true, false or null"),
    ("reproduced", 1, "reproduced=1 is not true, false or null"),
    ("reproduced", "false", "reproduced='false' is not true, false or null"),
    ("reproduced", [], "reproduced"),
    ("verdict", "maybe", "verdict='maybe' is not one of reproducible, device, transient"),
    ("verdict", "", "verdict"),
    ("verdict", True, "verdict"),
    ("verdict", 1, "verdict"),
    ("device", 3, "device=3 is not a string"),
    ("device", None, "device"),
])
def test_from_dict_refuses_bad_re_run_fields(field, value, fragment):
    with pytest.raises(ProtocolError, match=re.escape(fragment)):
        Event.from_dict({**BASE, field: value})
    # the same, with every other field there too (another cached plan of names and types)
    with pytest.raises(ProtocolError, match=re.escape(fragment)):
        Event.from_dict({**make_event().to_dict(), field: value})


@pytest.mark.parametrize("verdict", [*VERDICTS_IN_JOB, None])
def test_every_verdict_of_the_vocabulary_is_taken(verdict):
    assert Event.from_dict({**BASE, "verdict": verdict, "reproduced": verdict != "reproducible"}).verdict == verdict


def test_an_event_with_its_flags_is_checked_by_its_plan():
    # the flags (has_nan, input_nonfinite, ...) are taken as they come: an event holding them still gets the
    # fast check planned from its fields' types (it took the slow path, a coordinator's ingest at half speed)
    from nanguard.events import _plan

    for compact in (False, True):
        data = json.loads(json.dumps(make_event(has_inf=False, reproduced=True).to_dict(compact=compact)))
        assert _plan(tuple(data), tuple(map(type, data.values()))) is not None, data


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                        | st.sampled_from(["nan", "inf", "-inf", "x", "", "forward", "reproducible"]),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                    max_size=2), max_leaves=4)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(sorted({f.name for f in dataclasses.fields(Event)}) + ["bogus"]),
                               _JSONISH, max_size=4),
       dropped=st.sets(st.sampled_from(["kind", "rank", "step", "layer", "has_nan", "shape"]), max_size=2))
def test_the_planned_check_says_what_the_full_check_says(changes, dropped):
    from nanguard.events import _checked_values, event_values

    data = json.loads(json.dumps(make_event().to_dict()))
    data.update(changes)
    for name in dropped:
        data.pop(name, None)

    def outcome(check):
        try:
            return "ok", check(data)
        except ProtocolError as exc:
            return "refused", str(exc)

    fast, slow = outcome(event_values), outcome(_checked_values)
    assert fast[0] == slow[0], (data, fast, slow)
    if fast[0] == "ok":
        assert fast[1].keys() == slow[1].keys()
        assert all(fast[1][k] == slow[1][k] or fast[1][k] != fast[1][k] for k in fast[1]), (fast, slow)
