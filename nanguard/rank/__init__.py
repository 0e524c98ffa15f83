"""The rank side: what runs inside every training process.

    guard.py      Guard: lifecycle and wiring (hooks, optimizer step, the step's flow); start() opens
                  the guard nanguard.init asks for (nanguard/api.py, which chooses its observer)
    observer.py   StepObserver: what a guard tells of its steps (the replay implements it)
    detector.py   the forward hooks: one exact probe per checked tensor, no host sync
    backward.py   DDP buckets before their all-reduce; gradients as the backward pass leaves them
    records.py    what the hooks leave: the module catalogue and one step's probe records
    decision.py   one vector, one all-reduce, one read per step; agreeing on the job's first event
    diagnose.py   probe records of a bad step -> the Event that names where it was born
    reading.py    Reading and Finding: what decision, diagnose and respond hand each other
    respond.py    the on_nan policy (report, capture, skip, raise), requested stops, norm warnings
    gradnorm.py   the gradient-norm monitor (threshold and spike warnings)
    reporter.py   the coordinator link, or a reporter that does nothing
    modules.py    module names as reports show them (wrappers left out)
    forensics.py  the exact, slow look at one tensor, once something is bad
"""
