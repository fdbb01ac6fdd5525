"""The abort channel's control plane at 512 ranks, on one machine: the job's store, the heartbeats, the abort and the
start-up agreement with 512 light ranks (threads, no model), under the descriptor limits a cluster has.

    python -m bench.control_plane                 # 512 ranks, ~3 min on 2 cores -> bench/results/control_plane.json
    python -m bench.control_plane --world 64 --steady-s 5 --out /tmp/cp.json

A rank here is a thread holding the three connections a real rank opens to the job's store (its heartbeat process's,
its watcher's, the rendezvous'), running the real `base.watcher.Watcher` (its thread, its `_Asker` from base/watch_io.py, POLL_S,
STALL_S) on the watcher's connection and beating `hb/R` every POLL_S on the heartbeat's, as the forked heartbeat
process does. 4 worker processes hold 128 ranks each (one process per rank would need 512 torch imports: ~150 GB).
The server is a TCPStore as `base/node_store.py serve` and rank 0's `open_channel` create it, in its own process
under the scenario's RLIMIT_NOFILE, with the same `raise_fd_limit` / `publish_fd_limit` calls (or none: `before`).

Scenarios (each a fresh server and fresh ranks):
- before: soft = hard = 1024, the limit never raised (the code before issue 41): how many ranks get their three
  connections within CONNECT_S, the start-up hang of item 5;
- raised: soft 1024, hard 20000 (this machine's): the server raises it; then every phase of a job's control plane:
  connections accepted, the start-up agreement (every rank `add`s its arrival, the last one releases all: what
  torch's store-based rendezvous does) and a decision broadcast (rank 0 `set`s, all `get`), heartbeat load over
  --steady-s (requests/s the ranks made, the server's CPU), one rank going silent (heartbeat and watcher stopped,
  connections kept: a lost node) -> rank 0 declares it after STALL_S and posts the abort -> every other rank's
  watcher reads it (the spread) -> rank 0 has every rank's done mark (what it waits for before its store goes);
- refused: soft = hard = 1024: the server cannot raise it; every rank connects (heartbeat + watcher, as
  `open_channel` does first) and refuses in one line (`comm.fd_refusal`), as every real rank raises it before any
  work; the ranks that refused close their connections, so the ones still waiting for a descriptor get one.

All times are `time.monotonic()` (one clock for every process on the machine). 2 cores run the server, 512 watcher
threads and 512 heartbeat threads together: a cluster's server has a core to itself, so its figures are upper bounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "control_plane.json")
CONNECT_S = 30.0  # `before`: how long a rank waits for its connections (a real rank waited START_WAIT_S, 30 min)
WAIT_S = 180.0  # any other wait here (a rank's get/wait on the store, the controller's phases)
_P = "bench/"


def _client(port: int, timeout_s: float):
    from base.comm import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    store.set_timeout(datetime.timedelta(seconds=WAIT_S))
    return store


class _Counted:
    """A store whose requests are counted (the heartbeat load), as the server sees them."""

    def __init__(self, store, counter: list):
        self._store, self._n = store, counter

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self._n[0] += 1
            return fn(*a, **k)
        return call


def _rank(r: int, world: int, port: int, scenario: str, soft: int, rec: dict, alive: dict, steady, slots) -> None:
    """One light rank: its three connections, its refusal check, the agreement, then the watcher and heartbeat."""
    from base import comm, watcher

    t0 = time.monotonic()
    wait = CONNECT_S if scenario == "before" else WAIT_S
    try:
        with slots:
            hb = _client(port, wait)  # the heartbeat process's connection (forked first in open_channel)
            st = _client(port, wait)  # the watcher's
        if scenario == "refused":
            rec.update(connected=True, connect_s=time.monotonic() - t0)
        if scenario != "before":
            refusal = comm.fd_refusal(st, world, r, soft)
            if refusal:
                rec.update(refused_at=time.monotonic(), line=refusal if r == 0 else None)
                del hb, st  # the rank exits 2: its descriptors on the server are freed
                return
        with slots:
            rdv = _client(port, wait)  # the rendezvous' own (torch's env:// init)
    except Exception as e:  # noqa: BLE001 -- a rank that never connected: what `before` counts
        rec.update(connected=False, error=watcher.one_line(e)[:120], waited_s=time.monotonic() - t0)
        return
    rec.update(connected=True, connect_s=time.monotonic() - t0)
    if scenario == "before":
        alive["hold"].wait(WAIT_S)  # keep the three connections until every rank has tried
        try:  # does the server still answer on each? (past its descriptors it accepts and drops connections)
            for c in (hb, st, rdv):
                c.set_timeout(datetime.timedelta(seconds=5))
                c.check([_P + "probe"])
            rec["answering"] = True
        except Exception:  # noqa: BLE001
            rec["answering"] = False
        return
    counter = [0]
    stop = threading.Event()

    def hard_exit(code: int) -> None:  # the watcher would os._exit here: record, stop polling and beating
        rec.setdefault("exit", (time.monotonic(), code))
        w._stop.set()
        w.stopped = True
        stop.set()

    w = watcher.Watcher(_Counted(st, counter), r, world, hard_exit=hard_exit, say=lambda line: None,
                        log=lambda line: None)
    post = w.post
    w.post = lambda reason, code=1: (rec.setdefault("posted_at", time.monotonic()), post(reason, code))[1]
    w.start()

    def beat() -> None:  # base.watcher._heartbeat's loop, as a thread
        while not stop.wait(watcher.POLL_S):
            counter[0] += 1
            try:
                hb.add(watcher.key(f"hb/{r}"), 1)
            except Exception:  # noqa: BLE001
                pass

    threading.Thread(target=beat, daemon=True).start()
    alive[r] = (w, stop, counter)
    if rdv.add(_P + "arrived", 1) == world:  # the start-up agreement: the last arrival releases everyone
        rdv.set(_P + "all_arrived", "1")
    rdv.wait([_P + "all_arrived"])
    rec["agreed_at"] = time.monotonic()
    if r == 0:
        rec["decision_set_at"] = time.monotonic()
        rdv.set(_P + "decision", "resume step 1200")
    assert rdv.get(_P + "decision") == b"resume step 1200"
    rec["decided_at"] = time.monotonic()
    rdv.add(_P + "steady", 1)
    steady.wait(WAIT_S)
    del rdv


def run_ranks(port: int, world: int, ranks: range, scenario: str, silent: int | None = None,
              connect_slots: int = 0) -> list[dict]:
    """Ranks `ranks` of the job as threads; phases driven by the controller's keys on the store. Returns one record
    per rank, plus this process's request counts in the heartbeat window. `connect_slots`: at most that many
    connects in flight (0: all at once)."""
    import contextlib

    from base import watcher

    slots = threading.BoundedSemaphore(connect_slots) if connect_slots else contextlib.nullcontext()

    soft, _ = watcher.raise_fd_limit()
    recs = {r: {"rank": r} for r in ranks}
    alive: dict = {"hold": threading.Event()}
    steady = threading.Event()
    ctl = _client(port, WAIT_S)  # first: under `before` the ranks fill the server's descriptors
    ctl.add(_P + "ready", 1)  # torch imported, connected: the controller starts every worker's ranks at once
    ctl.wait([_P + "go"])
    threads = [threading.Thread(target=_rank, args=(r, world, port, scenario, soft, recs[r], alive, steady, slots),
                                daemon=True) for r in ranks]
    for t in threads:
        t.start()
    extra: dict = {"rank": None, "worker": True}
    if scenario == "before":
        ctl.wait([_P + "end"])
        alive["hold"].set()
        for t in threads:
            t.join(WAIT_S)
    elif scenario == "refused":
        for t in threads:
            t.join(WAIT_S)
    else:
        ctl.wait([_P + "window_start"])
        extra["window"] = [(time.monotonic(), sum(alive[r][2][0] for r in ranks if r in alive))]
        ctl.wait([_P + "window_end"])
        extra["window"].append((time.monotonic(), sum(alive[r][2][0] for r in ranks if r in alive)))
        ctl.wait([_P + "silence"])
        if silent in alive:
            w, stop, _ = alive[silent]
            w.stop()
            stop.set()
            extra["silenced_at"] = time.monotonic()
        end = time.monotonic() + watcher.STALL_S + 4 * watcher.ABORT_WAIT_S
        while time.monotonic() < end and not all("exit" in recs[r] for r in ranks if r != silent):
            time.sleep(0.1)
        steady.set()
    return [recs[r] for r in ranks] + [extra]


def _server(port: int, scenario: str) -> None:
    """The job's store as node_store.serve creates it (raise, serve, publish), or as before (no raise)."""
    import resource

    from base.comm import TCPStore, publish_fd_limit
    from base.watcher import key, raise_fd_limit

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if scenario == "before" else raise_fd_limit()[0]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=datetime.timedelta(seconds=10))
    store.compare_set(key("abort"), "", "")
    if scenario != "before":
        publish_fd_limit(store, soft)
    print("ready", soft, flush=True)
    time.sleep(3600)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(args: list[str], extra: dict | None = None, **kw) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, TORCH_CPP_LOG_LEVEL="FATAL", **(extra or {}))
    return subprocess.Popen([sys.executable, "-m", "bench.control_plane", *args], env=env, cwd=root, **kw)


def _control(ctl, name: str, world: int, workers: int, steady_s: float, server_pid: int) -> tuple[float, dict]:
    """The controller's side of one scenario: start every worker's ranks at once, drive the phases; returns the
    start time and the server-side figures."""
    while int(ctl.add(_P + "ready", 0)) < workers:
        time.sleep(0.05)
    t_start = time.monotonic()
    ctl.set(_P + "go", "1")
    out: dict = {}
    if name == "before":
        time.sleep(CONNECT_S + 5)
        out["server_fds"] = len(os.listdir(f"/proc/{server_pid}/fd"))
        ctl.set(_P + "end", "1")
    elif name == "raised":
        while int(ctl.add(_P + "steady", 0)) < world and time.monotonic() - t_start < WAIT_S:
            time.sleep(0.05)
        out["all_steady_s"] = time.monotonic() - t_start
        from base import watcher

        time.sleep(2 * watcher.POLL_S)  # every watcher and heartbeat in its rhythm
        cpu0, t0 = _cpu_s(server_pid), time.monotonic()
        ctl.set(_P + "window_start", "1")
        time.sleep(steady_s)
        ctl.set(_P + "window_end", "1")
        out["server_cpu_share"] = (_cpu_s(server_pid) - cpu0) / (time.monotonic() - t0)
        out["server_fds"] = len(os.listdir(f"/proc/{server_pid}/fd"))
        ctl.set(_P + "silence", "1")
    return t_start, out


def _numeric_names() -> str | None:
    """A preloadable getnameinfo that answers numerically (None without a C compiler). This machine's resolver has no
    DNS server: every reverse lookup of a peer's address (torch formats each new socket's peer) stalls 5 s when a few
    run at once, which a cluster's resolver answers in milliseconds; the bench measures the store, not that."""
    import shutil

    so = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ulysses_numeric_names.{os.getuid()}.so")
    if os.path.exists(so):
        return so
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    src = so[:-3] + ".c"
    with open(src, "w") as fh:
        fh.write("#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <netdb.h>\n#include <sys/socket.h>\n"
                 "int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen, "
                 "char *serv, socklen_t servlen, int flags) {\n"
                 "  static int (*real)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);\n"
                 "  if (!real) real = dlsym(RTLD_NEXT, \"getnameinfo\");\n"
                 "  return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST);\n}\n")
    ok = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", so, src, "-ldl"], capture_output=True).returncode == 0
    return so if ok else None


def scenario(name: str, world: int, workers: int, steady_s: float, silent: int, preload: str | None) -> dict:
    """One scenario end to end: a server process under its limits, `workers` processes of ranks, the controller."""
    import resource
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limits = {"before": (1024, 1024), "raised": (1024, hard), "refused": (1024, 1024)}[name]
    env = {"LD_PRELOAD": preload} if preload else {}
    server = _spawn(["--serve", str(port), name], stdout=subprocess.PIPE, text=True, extra=env,
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits))
    soft = int(server.stdout.readline().split()[1])
    ctl = _client(port, WAIT_S)
    per = -(-world // workers)
    slots = "0" if preload else "1"  # without the numeric resolver, one connect at a time (see _numeric_names)
    procs = [_spawn(["--worker", str(port), str(world), str(a), str(min(a + per, world)), name, str(silent), slots],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, extra=env)
             for a in range(0, world, per)]
    out = {"scenario": name, "world": world, "server_limit": list(limits), "server_soft_after": soft}
    try:
        t_start, got = _control(ctl, name, world, len(procs), steady_s, server.pid)
        out.update(got)
        recs = []
        for p in procs:
            text, _ = p.communicate(timeout=WAIT_S + 200)
            recs += json.loads(text.strip().splitlines()[-1])
    finally:
        for p in procs:
            p.kill()
        server.kill()
    out.update(summarize(recs, world, silent, t_start))
    return out


def in_process(world: int, steady_s: float, silent: int, store_fds: int | None = None) -> dict:
    """The `raised` scenario (or, with `store_fds` published too low, `refused`) in this process: the server, the
    ranks' threads (one connect at a time: see _numeric_names) and the controller. For the suite's fast check."""
    import socket

    from base.comm import TCPStore, publish_fd_limit
    from base.watcher import key, raise_fd_limit

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                      timeout=datetime.timedelta(seconds=10))
    server.compare_set(key("abort"), "", "")
    publish_fd_limit(server, store_fds or raise_fd_limit()[0])
    name = "raised" if store_fds is None else "refused"
    box: list = []
    t = threading.Thread(target=lambda: box.append(run_ranks(port, world, range(world), name, silent, 1)),
                         daemon=True)
    t.start()
    ctl = _client(port, WAIT_S)
    t_start, out = _control(ctl, name, world, 1, steady_s, os.getpid())
    t.join(WAIT_S)
    out.update(summarize(box[0], world, silent, t_start))
    return out


def summarize(recs: list[dict], world: int, silent: int, t_start: float) -> dict:
    """The figures of one scenario from every rank's record."""
    ranks = [r for r in recs if r.get("rank") is not None]
    workers = [r for r in recs if r.get("worker")]
    out: dict = {"ranks_connected": sum(1 for r in ranks if r.get("connected"))}
    if any("answering" in r for r in ranks):  # `before`: who had three answering connections within CONNECT_S
        out["ranks_in_time"] = sum(1 for r in ranks if r.get("answering") and r["connect_s"] <= CONNECT_S)
        out["ranks_late"] = sum(1 for r in ranks if r.get("connected") and r["connect_s"] > CONNECT_S)
    connects = sorted(r["connect_s"] for r in ranks if "connect_s" in r)
    if connects:
        out["connect_s_median"], out["connect_s_max"] = connects[len(connects) // 2], connects[-1]
    refused = [r for r in ranks if "refused_at" in r]
    if refused:
        out["ranks_refused"] = len(refused)
        out["last_refusal_s"] = max(r["refused_at"] for r in refused) - t_start
        out["refusal_line"] = next((r["line"] for r in refused if r.get("line")), None)
    agreed = [r["agreed_at"] for r in ranks if "agreed_at" in r]
    if len(agreed) == world:
        out["agreement_spread_s"] = max(agreed) - min(agreed)  # last arrival released -> every rank knows
        set_at = next(r["decision_set_at"] for r in ranks if r["rank"] == 0)
        out["decision_s"] = max(r["decided_at"] for r in ranks) - set_at
    windows = [w["window"] for w in workers if "window" in w]
    if windows:
        span = max(w[1][0] for w in windows) - min(w[0][0] for w in windows)
        out["requests_per_s"] = sum(w[1][1] - w[0][1] for w in windows) / span
    silenced = [w["silenced_at"] for w in workers if "silenced_at" in w]
    r0 = next((r for r in ranks if r["rank"] == 0), {})
    if silenced and "posted_at" in r0:
        out["silent_declared_after_s"] = r0["posted_at"] - silenced[0]
        others = [r["exit"][0] - r0["posted_at"] for r in ranks if r["rank"] not in (0, silent) and "exit" in r]
        out["abort_read_by"] = len(others)
        if others:
            others.sort()
            out["abort_spread_s_median"], out["abort_spread_s_max"] = others[len(others) // 2], others[-1]
        out["exit_codes"] = sorted({r["exit"][1] for r in ranks if "exit" in r})
        if "exit" in r0:
            out["rank0_all_done_s"] = r0["exit"][0] - r0["posted_at"]  # every other rank's done mark seen
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=512)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--scenarios", default="before,raised,refused")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--serve", nargs=2, metavar=("PORT", "SCENARIO"))
    p.add_argument("--worker", nargs=7, metavar=("PORT", "WORLD", "FIRST", "END", "SCENARIO", "SILENT", "SLOTS"))
    p.add_argument("--no-numeric-names", action="store_true", help="measure with this machine's resolver as it is")
    p.add_argument("--check", type=int, metavar="WORLD",
                   help="the suite's quick check: `raised` and `refused` in one process, POLL_S 0.2 s, STALL_S 1.5 s")
    a = p.parse_args(argv)
    if a.check:
        from base import watcher

        watcher.POLL_S, watcher.STALL_S, watcher.ABORT_WAIT_S = 0.2, 1.5, 2.0
        got = {"raised": in_process(a.check, 0.5, a.check // 2 + 1),
               "refused": in_process(a.check, 0.5, a.check // 2 + 1, store_fds=watcher.store_fds(a.check) - 1)}
        print(json.dumps(got), flush=True)
        return 0
    if a.serve:
        _server(int(a.serve[0]), a.serve[1])
        return 0
    if a.worker:
        port, world, first, end, name, silent, slots = a.worker
        recs = run_ranks(int(port), int(world), range(int(first), int(end)), name, int(silent), int(slots))
        print(json.dumps(recs), flush=True)
        return 0
    from base import watcher

    silent = a.world // 2 + 1
    preload = None if a.no_numeric_names else _numeric_names()
    results = {"numeric_names_preloaded": bool(preload), "world": a.world, "workers": a.workers, "poll_s": watcher.POLL_S, "stall_s": watcher.STALL_S,
               "store_fds_needed": watcher.store_fds(a.world), "cores": os.cpu_count(), "scenarios": []}
    for name in a.scenarios.split(","):
        t = time.monotonic()
        got = scenario(name, a.world, a.workers, a.steady_s, silent, preload)
        got["wall_s"] = time.monotonic() - t
        results["scenarios"].append(got)
        print(json.dumps(got), flush=True)
    print(table(results))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"wrote {a.out}")
    return 0


def table(results: dict) -> str:
    rows = [f"control plane, {results['world']} light ranks ({results['cores']} cores; POLL_S {results['poll_s']:.0f} s,"
            f" STALL_S {results['stall_s']:.0f} s; the store needs {results['store_fds_needed']} descriptors)",
            "| scenario | server limit (soft/hard -> soft) | ranks connected (`before`: in time) | connect median/max s | "
            "other |",
            "|---|---|---|---|---|"]
    for s in results["scenarios"]:
        lim = f"{s['server_limit'][0]}/{s['server_limit'][1]} -> {s['server_soft_after']}"
        conn = (f"{s.get('connect_s_median', 0):.2f} / {s.get('connect_s_max', 0):.2f}"
                if "connect_s_max" in s else "-")
        other = []
        if "ranks_refused" in s:
            other.append(f"{s['ranks_refused']} refused in one line, the last {s['last_refusal_s']:.1f} s in")
        if "agreement_spread_s" in s:
            other.append(f"agreement {s['agreement_spread_s']:.3f} s, decision {s['decision_s']:.3f} s")
        if "requests_per_s" in s:
            other.append(f"{s['requests_per_s']:.0f} requests/s, server {100 * s['server_cpu_share']:.0f}% of a "
                         f"core, {s['server_fds']} fds")
        if "silent_declared_after_s" in s:
            other.append(f"silent rank declared after {s['silent_declared_after_s']:.1f} s; abort read by "
                         f"{s['abort_read_by']} ranks in {s.get('abort_spread_s_median', 0):.2f} / "
                         f"{s.get('abort_spread_s_max', 0):.2f} s (median/max); rank 0 saw all done "
                         f"{s.get('rank0_all_done_s', float('nan')):.2f} s after its post; codes {s['exit_codes']}")
        if s["scenario"] == "before":
            other.append(f"{s['ranks_in_time']} ranks had their 3 connections within {CONNECT_S:.0f} s, the server "
                         f"then at {s['server_fds']} descriptors; {s['ranks_late']} got them only after others left, "
                         f"{s['world'] - s['ranks_connected']} never: a real rank waits START_WAIT_S")
        got = s["ranks_in_time"] if "ranks_in_time" in s else s["ranks_connected"]
        rows.append(f"| {s['scenario']} | {lim} | {got} / {s['world']} | {conn} | "
                    f"{'; '.join(other)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
