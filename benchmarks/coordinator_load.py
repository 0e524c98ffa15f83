"""Load on the coordinator: ingest rate, stop fan-out latency, memory and CPU.

A real ``python -m nanguard coordinator`` subprocess; simulated ranks are DEALER sockets
spread over a few worker processes (each owns its sockets and its own ZeroMQ context), speaking
the real wire protocol through ``nanguard.wire.Codec``.

1. ingest: every simulated rank says hello, then ``--senders`` of them send ``events``
   messages (compact, realistic forward events, as many as fit one message) as fast as the
   coordinator takes them, for ``--seconds``; the rate is read from the coordinator's own
   counter ``nanguard_nonfinite_events_total`` (every counted message is also in its log).
   Senders are limited so that what waits in socket buffers when the window closes drains
   in seconds (1,024 flooding connections would queue minutes of work in the kernel).
2. fan-out: ``--rounds`` times, every simulated rank joins a new job, an operator
   ``stop_request`` is sent, and each rank notes when the stop reached it (then acks and says
   bye, which lets the next job start). Latency is measured from the coordinator's decision
   (the stop's ``time`` in ``status``: when the request was read) and, for information, from
   just before the operator sent it (which adds connecting a new socket).
3. the coordinator's peak RSS (VmHWM) and CPU seconds, from /proc.

    python benchmarks/coordinator_load.py              # 1,024 ranks, about a minute
    python benchmarks/coordinator_load.py --quick      # a smoke run, about 25 s
    python benchmarks/coordinator_load.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmark the checkout this file lives in

import zmq  # noqa: E402

from nanguard.coordinator.control import request  # noqa: E402
from nanguard.events import Event  # noqa: E402
from nanguard.protocol import STOP_KINDS  # noqa: E402
from nanguard.wire import MAX_BYTES, Codec  # noqa: E402

TARGETS = {"ingest_events_per_s": 50_000, "fanout_p99_ms": 50.0, "peak_rss_mb": 200.0}
TOKEN = "bench-token"
OPERATOR_TOKEN = "bench-operator-token"


# --- simulated ranks (worker processes) ----------------------------------------------------


def _events_json(max_bytes: int) -> tuple[str, int]:
    """As many realistic compact forward events as fit one message, serialised once."""
    event = Event(kind="forward", rank=0, step=123456, layer="model.layers.17.mlp.down_proj",
                  module_type="Linear", has_nan=True, shape=(8, 2048, 4096), dtype="torch.bfloat16",
                  numel=67108864, bad_count=12, nan_count=12, inf_count=0, first_index=(3, 511, 77),
                  first_value=float("nan"), finite_min=-41.5, finite_max=38.25, finite_mean=0.0031,
                  input_nonfinite=False, output_nonfinite=True, host="node-017", time=time.time())
    one = json.dumps(event.to_dict(compact=True), separators=(",", ":"))
    count = min(256, (max_bytes - 400) // (len(one) + 1))
    return "[" + ",".join([one] * count) + "]", count


def _worker(ranks: list[int], address: str, token: str | None, conn) -> None:
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, len(ranks) + 64)
    sockets, codecs = [], []
    for rank in ranks:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 2)
        sock.connect(address)
        sockets.append(sock)
        codecs.append(Codec(f"sim{rank}@bench:{os.getpid()}:{time.time_ns()}", token))
    events_json, per_message = _events_json(MAX_BYTES)
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    instance = _handshake(sockets, codecs)
    job = ""
    try:
        while True:
            command, *args = conn.recv()
            if command == "hello":
                job = args[0]
                for rank, sock, codec in zip(ranks, sockets, codecs):
                    sock.send_multipart(codec.encode("hello", {
                        "rank": rank, "local_rank": rank % 8, "world_size": args[1], "host": "bench",
                        "pid": os.getpid(), "job": job, "device": "cpu", "version": "bench"}, to=instance))
                conn.send("ok")
            elif command == "ingest":
                seconds, senders = args
                conn.send(_ingest(ranks[:senders], sockets[:senders], codecs[:senders], job, events_json,
                                  per_message, seconds, instance))
            elif command == "arm":
                _drain(poller)
                conn.send("armed")
                conn.send(_await_stop(ranks, sockets, codecs, poller, job, conn, args[0], instance))
            elif command == "bye":
                for rank, sock, codec in zip(ranks, sockets, codecs):
                    sock.send_multipart(codec.encode("bye", {"rank": rank, "job": job, "clean": True}, to=instance))
                _drain(poller)
                conn.send("ok")
            else:
                return
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()


def _handshake(sockets, codecs) -> str:
    """Each simulated rank's handshake; the coordinator instance the welcomes name."""
    for sock, codec in zip(sockets, codecs):
        sock.send_multipart(codec.encode("handshake", {}, to=""))
    instances = set()
    for sock, codec in zip(sockets, codecs):
        if not sock.poll(30_000):
            raise SystemExit("no welcome from the coordinator within 30 s")
        instances.add(codec.decode(sock.recv_multipart()).sender)
    (instance,) = instances
    return instance


def _ingest(ranks, sockets, codecs, job, events_json, per_message, seconds, instance) -> int:
    bodies = [f'{{"rank":{rank},"job":"{job}","events":{events_json},"action":"warn"}}' for rank in ranks]
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        progressed = False
        for sock, codec, body in zip(sockets, codecs, bodies):
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                try:
                    sock.send_multipart(codec.encode_json("events", body, to=instance), zmq.NOBLOCK)
                except zmq.Again:
                    continue
                sent += per_message
                progressed = True
        if not progressed:
            time.sleep(0.002)
    return sent


def _drain(poller) -> None:
    """Read and discard anything waiting (stop commands re-sent before our ack arrived)."""
    while ready := poller.poll(50):
        for sock, _ in ready:
            sock.recv_multipart()


def _await_stop(ranks, sockets, codecs, poller, job, conn, timeout_s, instance) -> list[float]:
    """When the stop reached each rank (time.time()); acks and says bye after.

    The parent sends the command id once its request is answered; a message of an earlier
    round (re-sent before that round's ack arrived) is told apart by it. Waits with epoll on
    the sockets' ZMQ_FDs, so a wake-up costs what is ready, not a scan of every socket (which
    would steal the CPU the coordinator needs from this 2-core machine and inflate its figure).
    """
    arrivals: list[list[tuple[float, list[bytes]]]] = [[] for _ in sockets]
    by_fd = {sock.getsockopt(zmq.FD): i for i, sock in enumerate(sockets)}
    epoll = select.epoll()
    for fd in by_fd:
        epoll.register(fd, select.EPOLLIN)
    epoll.register(conn.fileno(), select.EPOLLIN)
    expected: bytes | None = None
    done: dict[int, tuple[float, list[bytes]]] = {}
    deadline = time.monotonic() + timeout_s
    fresh = list(range(len(sockets)))  # look at every socket once: anything already waiting
    try:
        while len(done) < len(sockets) and time.monotonic() < deadline:
            for i in fresh:
                sock = sockets[i]
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # also re-arms its ZMQ_FD
                    arrivals[i].append((time.time(), sock.recv_multipart(zmq.NOBLOCK)))
            if expected is not None:
                for i in fresh:
                    if i not in done:
                        match = next((a for a in arrivals[i] if expected in a[1][0]), None)
                        if match is not None:
                            done[i] = match
            fresh = []
            for fd, _ in epoll.poll(0.1):
                if fd == conn.fileno():
                    expected = b'"command_id":"%s"' % conn.recv().encode()
                    fresh = list(range(len(sockets)))
                    break
                fresh.append(by_fd[fd])
    finally:
        epoll.close()
    times = []
    for i, (when, frames) in sorted(done.items()):
        message = codecs[i].decode(frames)
        sockets[i].send_multipart(codecs[i].encode("ack", {"rank": ranks[i],
                                                           "command_id": message.body["command_id"]}, to=instance))
        sockets[i].send_multipart(codecs[i].encode("bye", {"rank": ranks[i], "job": job, "clean": True},
                                                   to=instance))
        times.append(when)
    _drain(poller)
    return times


# --- the coordinator --------------------------------------------------------------------------


class Coordinator:
    """``python -m nanguard coordinator`` on a free loopback port, with these secrets."""

    def __init__(self, log_path: Path, token: str | None, operator_token: str | None = OPERATOR_TOKEN):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if token:
            env["NANGUARD_TOKEN"] = token
        if operator_token:
            env["NANGUARD_OPERATOR_TOKEN"] = operator_token
        self.stderr = open(log_path.with_suffix(".stderr"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanguard", "coordinator", "--bind", "tcp://127.0.0.1:0",
             "--metrics-port", "0", "--log", str(log_path), "--dead-after-s", "3600",
             "--warn-kinds", ",".join(STOP_KINDS)],  # a flood of events, but no policy stop
            stdout=subprocess.PIPE, stderr=self.stderr, env=env, start_new_session=True)
        self.token = token
        self.log_path = log_path
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and select.select([self.proc.stdout], [], [], 1)[0]:
            line = self.proc.stdout.readline().decode()
            if line.startswith("nanguard coordinator ready"):
                fields = dict(part.split("=", 1) for part in line.split()[3:])
                self.address, self.metrics_url = fields["bind"], fields["metrics"]
                return
            if not line:
                break
        self.close()
        raise SystemExit(f"coordinator did not start:\n{log_path.with_suffix('.stderr').read_text()}")

    def samples(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: {(name, sorted label pairs): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=30) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def events_counted(self) -> float:
        return sum(value for (name, _), value in self.samples().items()
                   if name == "nanguard_nonfinite_events_total")

    def status(self) -> dict:
        return request(self.address, self.token, "status_request", {}, timeout_s=30).body

    def proc_stats(self) -> dict[str, float]:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        status = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        kib = lambda name: float(status[name].split()[0])  # noqa: E731
        return {"cpu_s": (int(fields[11]) + int(fields[12])) / ticks,
                "rss_mb": kib("VmRSS") / 1024, "peak_rss_mb": kib("VmHWM") / 1024}

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self.stderr.close()
        return self.proc.returncode


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _wait_until(coordinator: Coordinator, what: str, done, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done(coordinator.status()):
            return
        time.sleep(0.1)
    raise SystemExit(f"the coordinator did not get {what} within {timeout_s:g} s")


def _wait_registered(coordinator: Coordinator, job: str, count: int) -> None:
    _wait_until(coordinator, f"{count} ranks of job {job}",
                lambda status: status["job"] == job and len(status["ranks"]) == count)


def _wait_finished(coordinator: Coordinator) -> None:
    """Every rank's bye is in: the next hello starts a new job (else it is refused as wrong_job)."""
    _wait_until(coordinator, "every rank's bye", lambda status: all(r["finished"] for r in status["ranks"]))


def run(ranks: int, procs: int, senders: int, seconds: float, rounds: int, token: str | None,
        keep: bool = False) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="nanguard-load-"))
    load_before = os.getloadavg()[0]
    coordinator = Coordinator(workdir / "coordinator.jsonl", token)
    spawn = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    try:
        for p in range(procs):
            parent, child = spawn.Pipe()
            worker = spawn.Process(target=_worker, args=(list(range(p, ranks, procs)), coordinator.address,
                                                         token, child), daemon=True)
            worker.start()
            pipes.append(parent)
            workers.append(worker)

        def everyone(*command, replies: int = 1) -> list:
            for pipe in pipes:
                pipe.send(command)
            return [[pipe.recv() for _ in range(replies)] for pipe in pipes]

        # 1. ingest
        everyone("hello", "ingest", ranks)
        _wait_registered(coordinator, "ingest", ranks)
        for pipe in pipes:
            pipe.send(("ingest", seconds, max(1, senders // procs)))
        warmup = min(2.0, seconds / 4)
        time.sleep(warmup)
        start_count, start_time, start_stats = coordinator.events_counted(), time.time(), coordinator.proc_stats()
        log_start = coordinator.log_path.stat().st_size
        time.sleep(seconds - warmup - 0.5)
        end_count, end_time, end_stats = coordinator.events_counted(), time.time(), coordinator.proc_stats()
        log_end = coordinator.log_path.stat().st_size
        sent = sum(pipe.recv() for pipe in pipes)
        everyone("bye")
        _wait_finished(coordinator)
        ingest = {
            "events_per_s": (end_count - start_count) / (end_time - start_time),
            "window_s": end_time - start_time,
            "events_counted_total": end_count,
            "events_sent_total": sent,
            "log_mb_per_s": (log_end - log_start) / (end_time - start_time) / 2**20,
            "coordinator_cpu_share": (end_stats["cpu_s"] - start_stats["cpu_s"]) / (end_time - start_time),
        }

        # 2. fan-out
        last_rank_ms, every_rank_ms, from_request_ms = [], [], []
        for round_ in range(rounds):
            job = f"fanout-{round_}"
            everyone("hello", job, ranks)
            _wait_registered(coordinator, job, ranks)
            everyone("arm", 30.0)  # each worker answers "armed", then polls its sockets
            sent_at = time.time()
            reply = request(coordinator.address, token, "stop_request", {"reason": "benchmark"},
                            operator_token=OPERATOR_TOKEN, timeout_s=30)
            for pipe in pipes:
                pipe.send(reply.body["command_id"])
            times = [t for pipe in pipes for t in pipe.recv()]
            if len(times) != ranks:
                raise SystemExit(f"round {round_}: only {len(times)} of {ranks} ranks got the stop")
            decided_at = coordinator.status()["stop"]["time"]
            latencies = [(t - decided_at) * 1000 for t in times]
            _wait_finished(coordinator)
            last_rank_ms.append(max(latencies))
            every_rank_ms.extend(latencies)
            from_request_ms.append((max(times) - sent_at) * 1000)
        stats = coordinator.proc_stats()
        # the coordinator's own part: its log line says how long handing every stop to ZeroMQ took
        own_ms = [float(m.group(1)) for m in re.finditer(
            rb"sent to \d+ rank\(s\) in ([0-9.]+) ms", Path(coordinator.stderr.name).read_bytes())]
    finally:
        for pipe in pipes:
            pipe.send(("quit",))
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
        exit_code = coordinator.close()
        if keep:
            print(f"coordinator log and stderr kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
        "ranks": ranks, "processes": procs, "senders": senders, "token": token is not None, "cpus": os.cpu_count(),
        "ingest": ingest,
        "fanout": {"rounds": rounds, "last_rank_p50_ms": _percentile(last_rank_ms, 50),
                   "last_rank_p99_ms": _percentile(last_rank_ms, 99),
                   "every_rank_p50_ms": _percentile(every_rank_ms, 50),
                   "every_rank_p99_ms": _percentile(every_rank_ms, 99),
                   "from_request_p50_ms": _percentile(from_request_ms, 50),
                   "from_request_p99_ms": _percentile(from_request_ms, 99),
                   "last_rank_ms": [round(v, 2) for v in last_rank_ms],
                   "coordinator_send_p50_ms": _percentile(own_ms, 50) if own_ms else None,
                   "coordinator_send_p99_ms": _percentile(own_ms, 99) if own_ms else None},
        "coordinator": {**stats, "exit_code": exit_code},
    }


def report(result: dict) -> str:
    ingest, fanout, coordinator = result["ingest"], result["fanout"], result["coordinator"]

    def row(name: str, value: str, target: str = "", ok: bool | None = None) -> str:
        verdict = "" if ok is None else ("ok" if ok else "MISSED")
        return f"{name:<40}{value:>14}  {target:<12}{verdict}"

    lines = [
        f"nanguard coordinator load: {result['ranks']} simulated ranks ({result['senders']} sending events) "
        f"in {result['processes']} processes, "
        f"{result['cpus']} CPUs, token {'on' if result['token'] else 'off'}, load average "
        f"{result['load_average_before']:.2f} before / {result['load_average_after']:.2f} after",
        row("measure", "value", "target"),
        row("ingest, events/s (counted and logged)", f"{ingest['events_per_s']:,.0f}",
            f">= {TARGETS['ingest_events_per_s']:,}", ingest["events_per_s"] >= TARGETS["ingest_events_per_s"]),
        row("  log written, MB/s", f"{ingest['log_mb_per_s']:.1f}"),
        row("  coordinator CPU while ingesting, cores", f"{ingest['coordinator_cpu_share']:.2f}"),
        row(f"stop decided -> all ranks, p50 ms ({fanout['rounds']})", f"{fanout['last_rank_p50_ms']:.1f}"),
        row(f"stop decided -> all ranks, p99 ms ({fanout['rounds']})", f"{fanout['last_rank_p99_ms']:.1f}",
            f"<= {TARGETS['fanout_p99_ms']:g}", fanout["last_rank_p99_ms"] <= TARGETS["fanout_p99_ms"]),
        row("  coordinator's part (to the last send), p50/p99",
            "?" if fanout["coordinator_send_p50_ms"] is None else
            f"{fanout['coordinator_send_p50_ms']:.1f} / {fanout['coordinator_send_p99_ms']:.1f}"),
        row("stop to one rank, p50 / p99 ms", f"{fanout['every_rank_p50_ms']:.1f} / "
            f"{fanout['every_rank_p99_ms']:.1f}"),
        row("stop to all from `nanguard stop` sent, p50/p99", f"{fanout['from_request_p50_ms']:.1f} / "
            f"{fanout['from_request_p99_ms']:.1f}"),
        row("coordinator peak RSS, MB", f"{coordinator['peak_rss_mb']:.0f}", f"<= {TARGETS['peak_rss_mb']:g}",
            coordinator["peak_rss_mb"] <= TARGETS["peak_rss_mb"]),
        row("coordinator CPU, s (whole run)", f"{coordinator['cpu_s']:.1f}"),
        row("coordinator exit code on SIGTERM", str(coordinator["exit_code"])),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks (default %(default)s)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes (default %(default)s)")
    parser.add_argument("--senders", type=int, default=64,
                        help="simulated ranks that send events during the ingest (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="ingest duration (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="stops measured (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a short run: 6 s of ingest, 5 stops")
    parser.add_argument("--no-token", action="store_true", help="no NANGUARD_TOKEN (no MACs)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the coordinator's log and stderr")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = 6.0, 5
    result = run(args.ranks, args.procs, args.senders, args.seconds, args.rounds,
                 None if args.no_token else TOKEN, args.keep)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    missed = (result["ingest"]["events_per_s"] < TARGETS["ingest_events_per_s"]
              or result["fanout"]["last_rank_p99_ms"] > TARGETS["fanout_p99_ms"]
              or result["coordinator"]["peak_rss_mb"] > TARGETS["peak_rss_mb"])
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
