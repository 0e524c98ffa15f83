"""The coordinator daemon: one per job, beside the ranks. It never imports torch nor the rank side.

    server.py    Coordinator: the ROUTER socket loop; decodes each message, counts the bad ones
    handlers.py  Handlers: what each message does, and who may send it (ranks, operators)
    ranks.py     RankTable: the job incarnation served, its ranks bound to their sessions, who is
                 alive, dead, failed or stalled (monotonic clock)
    stop.py      StopFanout: the job's one stop command, sent to every rank until it acks
    replay.py    ReplayMemory: each sender's last seq, operators, ranks and guests in tables of
                 their own (a flood of new names cannot make an operator's message playable again)
    eventlog.py  EventLog: every accepted message as a JSON line, and the thread that fsyncs them;
                 rotated by size; a disk that refuses it costs lines (counted), never the loop
    state.py     the state file: the job's stop, kept across a restart (written atomically)
    clock.py     Instant: the wall clock (shown, logged) and the monotonic one (durations), read
                 together; LoopClock leaves out the time the process did not run
    policy.py    Policy: when the job stops (pure: no I/O, no clock)
    metrics.py   Metrics: the Prometheus series, and the HTTP endpoint that serves them (idle
                 connections time out, at most MAX_CONNECTIONS at once)
    series.py    the series with a label per rank (or host and device): plain tables, and the rank
                 table's rows, made into samples only while /metrics is read
    control.py   request(): one operator request and its reply (``nanguard status`` / ``stop``)
    main.py      ``nanguard coordinator``: arguments, signals, the ready line
"""
