"""From probe records to an Event, without a model: nanguard.rank.diagnose on hand-made records."""

from __future__ import annotations

import math

import torch

from nanguard.events import Event
from nanguard.rank.reading import Reading
from nanguard.rank.diagnose import first_bad
from nanguard.rank.records import BATCH, CHECK, IN, OUT, Catalog, Probe, Slot, StepLog

NAN, INF = math.nan, math.inf


def make(fields):
    return Event(rank=3, step=7, host="h", **fields)


def reading(*pairs, evidence=(), local_grads_bad=None, grads=()):
    """What the decision read: (minimum, maximum) of each OUT/CHECK probe, the gradients' norms,
    then (minimum, maximum) of each IN probe."""
    flat = [v for pair in pairs for v in pair]
    norms = [float(torch.linalg.vector_norm(g)) for g in grads]
    return Reading(True, False, flat, norms, [v for pair in evidence for v in pair], local_grads_bad)


OK, BAD_NAN, BAD_INF = (0.0, 1.0), (NAN, NAN), (0.0, INF)


def catalog(*names):
    """Modules by slot: "" is the root; a parameter "w" for each named module."""
    cat = Catalog(slots=[Slot(name, "Linear" if name else "Net", lambda: None) for name in names])
    return cat


def record(role, slot, tensor=None, lazy=False):
    kept = tensor if tensor is not None else None
    return Probe(role, slot, kept, 0 if tensor is None else tensor._version,
                 None if tensor is None else tensor.shape, None if tensor is None else tensor.dtype, lazy)


def log_of(*records, spans=((0, 0, 0),)):
    log = StepLog()
    log.records.extend(records)
    log.spans.extend(spans)
    return log


def test_a_kept_output_is_described_exactly_and_named_the_producer():
    bad = torch.tensor([[1.0, NAN], [INF, -2.0]])
    finding = first_bad(catalog("", "a", "b"), log_of(record(OUT, 1, torch.ones(2)), record(OUT, 2, bad)),
                        reading(OK, BAD_NAN), make)
    event = finding.event
    assert (event.kind, event.layer, event.module_type, event.rank, event.step) == ("forward", "b", "Linear", 3, 7)
    assert (event.nan_count, event.inf_count, event.first_index) == (1, 1, (0, 1))
    assert event.input_nonfinite is False and "born in this module" in event.message
    assert finding.born_here and event.micro_batch == 0


def test_a_freed_tensor_says_what_the_probe_knows_and_no_more():
    probe = record(OUT, 1)
    probe.shape, probe.dtype = torch.Size([4, 2]), torch.float32
    event = first_bad(catalog("", "a"), log_of(probe), reading(BAD_INF), make).event
    assert event.has_inf and not event.has_nan and event.bad_count is None
    assert event.shape == (4, 2) and event.numel == 8 and "no element detail" in event.message


def test_a_tensor_not_kept_is_not_said_to_lie_beyond_the_budget():
    # let go after a clean forward (or made in a compiled graph): a small tensor under a large budget
    # must not read "beyond the step's detail_mb budget"
    import weakref

    let_go = record(OUT, 1)
    let_go.shape = torch.Size([1536])
    event = first_bad(catalog("", "a"), log_of(let_go), reading(BAD_NAN), make).event
    assert "was not kept" in event.message and "detail_mb" not in event.message
    freed = record(OUT, 1)
    freed.kept, freed.shape = weakref.ref(torch.ones(3)), torch.Size([3])  # (dead at once: freed)
    event = first_bad(catalog("", "a"), log_of(freed), reading(BAD_NAN), make).event
    assert "lay beyond the step's detail_mb budget" in event.message


def test_a_huge_finite_tensor_reads_finite_and_is_not_blamed():
    # its float32 sum would overflow; its extremes cannot
    huge = torch.full((4,), 3e38)
    nan = torch.tensor([NAN])
    event = first_bad(catalog("", "a", "b"), log_of(record(OUT, 1, huge), record(OUT, 2, nan)),
                      reading((3e38, 3e38), BAD_NAN), make).event
    assert event.layer == "b" and "born in this module" in event.message


def test_an_input_nothing_checked_is_blamed_on_the_parents_forward_code():
    bad = torch.tensor([NAN])
    log = log_of(record(OUT, 1, torch.ones(1)), record(IN, 2, bad), record(OUT, 2, bad))
    event = first_bad(catalog("", "enc.a", "enc.b"), log, reading(OK, BAD_NAN, evidence=[BAD_NAN]), make).event
    assert event.kind == "forward" and event.layer == "enc.b" and event.input_nonfinite is True
    assert event.output_nonfinite is True and "forward code of enc" in event.message


def test_a_bad_batch_names_the_first_module_it_reached():
    batch = torch.tensor([1.0, NAN])
    log = log_of(record(BATCH, 0, batch, lazy=True), record(OUT, 1, torch.tensor([NAN])),
                 spans=((0, 0, 2),))
    event = first_bad(catalog("", "embed"), log, reading(BAD_NAN), make).event
    assert event.layer == "embed" and event.input_nonfinite and event.micro_batch == 2
    assert "input batch of the model" in event.message


def test_a_batch_that_cannot_be_checked_leaves_the_origin_unknown():
    # the batch was refilled in place after its forward (a static input buffer), or was freed:
    # "inputs were finite, born in this module" would be a guess
    batch = torch.tensor([1.0, NAN])
    changed = record(BATCH, 0, batch, lazy=True)
    batch.fill_(1.0)
    gone = Probe(BATCH, 0, None, 0, batch.shape, batch.dtype, True)
    for batch_record in (changed, gone):
        log = log_of(batch_record, record(OUT, 1, torch.tensor([NAN])))
        event = first_bad(catalog("", "embed"), log, reading(BAD_NAN), make).event
        assert (event.kind, event.layer, event.input_nonfinite) == ("forward", "embed", None)
        assert "could not be checked" in event.message and "born in this module, or" in event.message


def test_a_checked_loss_is_a_loss_event():
    cat = catalog("")
    index = cat.check_index("loss")
    event = first_bad(cat, log_of(record(CHECK, index, torch.tensor(NAN))), reading(BAD_NAN), make).event
    assert (event.kind, event.layer, event.micro_batch) == ("loss", "loss", None)


def gradients_case(cat, bad_slot):
    """Two modules (slots 1 then 2 in execution order), one parameter each."""
    params = [torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)]
    grads = [torch.ones(2), torch.ones(2)]
    grads[bad_slot - 1] = torch.tensor([NAN, 1.0])
    for slot, param in zip((1, 2), params):
        cat.param_names[id(param)] = f"{cat.slots[slot].name}.weight"
        cat.param_holders[id(param)] = [slot]
    log = log_of(record(OUT, 1, torch.ones(1)), record(OUT, 2, torch.ones(1)))
    return log, params, grads


def test_a_gradient_born_in_backward_is_named_by_its_parameter():
    cat = catalog("", "a", "b")
    log, params, grads = gradients_case(cat, bad_slot=1)
    event = first_bad(cat, log, reading(OK, OK, grads=grads), make, params, grads).event
    assert event.kind == "grad" and event.layer == "a.weight" and event.extra["bad_params"] == ["a.weight"]
    assert "born in the backward pass" in event.message


def test_bad_gradients_from_the_last_module_blame_the_loss():
    cat = catalog("", "a", "b")
    log, params, grads = gradients_case(cat, bad_slot=2)
    event = first_bad(cat, log, reading(OK, OK, grads=grads), make, params, grads).event
    assert event.kind == "loss" and event.layer == "loss" and "guard.check(loss)" in event.message


def test_gradients_another_rank_sent_are_that_ranks_event():
    cat = catalog("", "a", "b")
    log, params, grads = gradients_case(cat, bad_slot=2)
    finding = first_bad(cat, log, reading(OK, OK, local_grads_bad=False, grads=grads), make, params, grads)
    assert not finding.born_here and finding.event.kind == "grad"
    assert finding.event.extra["born_here"] is False and "another rank" in finding.event.message


def test_nothing_bad_is_no_finding():
    cat = catalog("", "a", "b")
    log, params, _ = gradients_case(cat, bad_slot=1)
    assert first_bad(cat, log, reading(OK, OK, grads=[torch.ones(2), torch.ones(2)]), make, params,
                     [torch.ones(2), torch.ones(2)]) is None


def test_an_infinite_input_alone_never_stops_and_an_output_made_from_it_is_born_here():
    mask = torch.tensor([0.0, -INF])
    out = torch.tensor([NAN, 1.0])
    log = log_of(record(OUT, 1, torch.ones(1)), record(IN, 2, mask), record(OUT, 2, out))
    event = first_bad(catalog("", "attn.prep", "attn.softmax"), log,
                      reading(OK, BAD_NAN, evidence=[(-INF, 0.0)]), make).event
    assert event.layer == "attn.softmax" and event.input_nonfinite is True and event.nan_count == 1
    assert "infinities but no NaN" in event.message and "made here" in event.message
    # the same mask where every output stays finite: nothing to report
    log = log_of(record(IN, 2, mask), record(OUT, 2, torch.ones(2)))
    assert first_bad(catalog("", "a", "b"), log, reading(OK, evidence=[(-INF, 0.0)]), make) is None


def test_a_roots_own_parameter_counts_as_used_first_even_when_probed_last():
    # under torch.compile the root (a ViT owning cls_token) is probed at the end of the graph
    cat = Catalog(slots=[Slot("", "ViT", lambda: None, container=True), Slot("blocks.0", "Block", lambda: None),
                         Slot("head", "Linear", lambda: None)])
    params = {name: torch.zeros(2) for name in ("cls_token", "blocks.0.weight", "head.weight")}
    for slot, name in enumerate(params):
        cat.param_names[id(params[name])] = name
        cat.param_holders[id(params[name])] = [slot]
    log = log_of(record(OUT, 1, torch.ones(1)), record(OUT, 2, torch.ones(1)), record(OUT, 0, torch.ones(1)))
    grads = [torch.tensor([NAN, 0.0]), torch.tensor([NAN, 0.0]), torch.ones(2)]  # born in head's backward
    event = first_bad(cat, log, reading(OK, OK, OK, grads=grads), make, list(params.values()), grads).event
    assert event.kind == "grad" and event.layer == "blocks.0.weight"
