"""The coordinator daemon: one per job, beside the ranks. It never imports torch nor the rank side.

    server.py    Coordinator: the ROUTER socket loop, per-rank state, stop commands
    eventlog.py  EventLog: every accepted message as a JSON line, and the thread that fsyncs them
    policy.py    Policy: when the job stops (pure: no I/O, no clock)
    metrics.py   Metrics: the Prometheus series, and the HTTP endpoint that serves them
    control.py   request(): one operator request and its reply (``nanguard status`` / ``stop``)
    main.py      ``nanguard coordinator``: arguments, signals, the ready line
"""
