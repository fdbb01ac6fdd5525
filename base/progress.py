"""A hang is found from progress, not from a collective's timeout: each rank publishes where it is (its step, its
phase and a counter) on the job's store, and rank 0 ends the job when a rank's progress has stopped for longer than a
bound derived from the measured durations of that phase, naming the rank and its host, well before NCCL's watchdog
(`dist_timeout_s`, 30 min) would raise somewhere else (where it used to blame the node whose watchdog fired first,
often a healthy one waiting for the hung rank). Under slurm.sbatch the named rank's node goes to LAUNCH_LOST_FILE:
the job is requeued without it, as a lost node is.

The heartbeat (base/watcher.py) only says a rank's process lives: its beat is a forked process that goes on while
the rank is stuck in a kernel or a collective. Progress is what the training loop itself marks (`mark(step, phase)`:
training/stage.py and training/step.py mark `data`, `forward` and `backward` per micro-batch, `optimizer`, `sync`
and `save`); a rank's
small publisher thread sets `progress/RANK = "COUNTER STEP PHASE"` on the store when it changed, every PUBLISH_S, off
the step's path. Rank 0's monitor reads every rank's value every POLL_S and keeps, on its own clock, when each last
changed (one decider, one clock; the ranks' clocks never meet).

The bound of a phase: FACTOR (2) x the longest that phase has lasted on any rank so far, at least MIN_S (300 s); a
phase not yet measured (the first step's compile and warm-up): FIRST_S (1200 s). A stage's evaluation (`eval`) runs
forwards whose layers tick as training's do (`watch_layers`): its bound is 2 x the longer of its own and the
forward's longest stretch, at least MIN_S (FIRST_S when neither is measured), so a rank stuck in an evaluation's
kernel is named after ~5 min, not after `dist_timeout_s` (30 min) in the others' collective. A restore (`restore`:
every rank reads its part of a checkpoint at once, no tick) is judged at RESTORE_S (1500 s, under `dist_timeout_s`'s
default 1800 s, so a rank stuck on a hung mount is named before NCCL's watchdog blames a waiting one), or 2 x the
longest restore measured; a restore that reads longer on every rank needs ULYSSES_HANG_RESTORE_S raised. `build` and
`idle` (building an engine, converting a checkpoint: rank 0's solo work may hold the others for hours; a stop's
teardown) are never judged. When ranks stall, the rank that is behind (the smallest step and mark counter: the others went on into a
collective that waits for it) is named; where none is behind (every rank in the same collective), the line says so
and names the ranks. The job ends with EXIT_PEER_LOST (69: a requeue, bounded by progress under slurm.sbatch): `rank R
(HOST) hung: no progress for S s in PHASE of step N (bound B s: 2 x the longest PHASE measured, M s)`.

Cost: one `set` per rank per PUBLISH_S at most, rank 0 one `multi_get` of WORLD keys per POLL_S (512 small keys at
512 ranks every 10 s). What it costs in detection time: a 10-s step of Llama-3-8B at 128K is judged after 5 min (the
floor). Inside a step every decoder layer ticks too (`watch_layers`: its forward, its recompute and its backward each
move the counter, the phase kept), so a phase's bound is 2 x its longest stretch without a tick, at least MIN_S: at
1M tokens, where one backward takes ~13 min on 32 ranks (~24 s a layer of Llama-3-8B's 32) and ~48 min on one GPU
(~90 s a layer), a hang is judged after the 5-min floor, not after 2 x 13 = 26 min (nearly NCCL's 30). A tick costs a
dict update and, per layer and micro-batch, one forward pre-hook and one gradient hook on the layer's output.
Environment: ULYSSES_HANG_MIN_S, ULYSSES_HANG_FIRST_S, ULYSSES_HANG_RESTORE_S, ULYSSES_HANG_POLL_S, ULYSSES_HANG=0
(off).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from base.host import cpu_ranges

FACTOR = 2.0
MIN_S = float(os.environ.get("ULYSSES_HANG_MIN_S", "300"))
FIRST_S = float(os.environ.get("ULYSSES_HANG_FIRST_S", "1200"))
RESTORE_S = float(os.environ.get("ULYSSES_HANG_RESTORE_S", "1500"))
POLL_S = float(os.environ.get("ULYSSES_HANG_POLL_S", "10"))
PUBLISH_S = POLL_S / 2
SUSPENDED_S = 3 * POLL_S  # a monitor that wakes this late was stopped with the job (scontrol suspend): clocks restart
# the hang this process's monitor declared (its line), set before it tells the others: the main thread, whose collective
# then fails as the named rank leaves, ends with the hang's code, not its own error's (training/job._fail)
DECLARED: str | None = None
UNJUDGED = ("build", "idle")  # an engine's build, a conversion (rank 0's solo work may hold the others for hours), a stop
TICKS_LIKE = {"eval": "forward"}  # a phase whose ticks come from the same layers' forwards as this measured one's


class Tracker:
    """Rank 0's view of every rank's progress, on its clock. Pure: `observe(now, values)` -> the hang's line or None."""

    def __init__(self, world: int, factor: float = FACTOR, min_s: float = MIN_S, first_s: float = FIRST_S,
                 restore_s: float = RESTORE_S):
        self.world, self.factor, self.min_s, self.first_s, self.restore_s = world, factor, min_s, first_s, restore_s
        self.last: dict[int, tuple[str, float]] = {}  # rank -> (its value, when it last changed)
        self.longest: dict[str, float] = {}  # phase -> the longest it lasted on any rank
        self.polled: float | None = None
        self.named: int | None = None  # the rank the last hang line named alone (None: none behind the others)

    def measured(self, phase: str) -> tuple[float, str] | None:
        """(seconds, phase): the longest stretch `phase`'s bound is FACTOR x, its own or its TICKS_LIKE phase's."""
        got = [(self.longest[p], p) for p in (phase, TICKS_LIKE.get(phase)) if p in self.longest]
        return max(got) if got else None

    def floor(self, phase: str) -> float:
        return self.restore_s if phase == "restore" else self.min_s

    def bound(self, phase: str) -> float:
        done = self.measured(phase)
        if done is None:
            return self.restore_s if phase == "restore" else self.first_s
        return max(self.floor(phase), self.factor * done[0])

    def observe(self, now: float, values: list[str], hosts: list[str] | None = None) -> str | None:
        if self.polled is not None and now - self.polled > SUSPENDED_S:  # stopped with the job: nothing measured
            self.last = {r: (v, now) for r, (v, _) in self.last.items()}
        self.polled = now
        stalled = []
        for r, value in enumerate(values):
            seen = self.last.get(r)
            if seen is None or seen[0] != value:
                if seen is not None and seen[0]:
                    phase = seen[0].split(" ")[-1]
                    self.longest[phase] = max(self.longest.get(phase, 0.0), now - seen[1])
                self.last[r] = (value, now)
                continue
            if not value:
                continue  # not marked yet
            count, step, phase = value.split(" ", 2)
            if phase not in UNJUDGED and now - seen[1] > self.bound(phase):
                stalled.append((seen[1], r, step, count, phase))
        if not stalled:
            return None
        # who is behind among every rank quiet for at least half as long as the latest stalled one: a hung rank in a
        # phase with a longer bound is among them (the others stalled waiting for it), and so is a hung rank whose
        # last mark reached the store a poll after theirs (it is behind them, so its publisher can be the later one:
        # "no later than a stalled one" named the waiting rank 0 in a clean-clone make test); a rank still marking
        # changed within the last phase and stays out
        latest = max(t for t, *_ in stalled)
        horizon = latest + (now - latest) / 2
        quiet = []
        for r, (value, t) in self.last.items():
            if value and t <= horizon and value.split(" ", 2)[2] not in UNJUDGED:
                count, step, phase = value.split(" ", 2)
                quiet.append((t, r, step, count, phase))
        since = min(t for t, *_ in quiet)
        behind = min((int(step), int(count)) for _, _, step, count, _ in quiet)
        first = [x for x in quiet if (int(x[2]), int(x[3])) == behind]
        t, r, step, _, phase = min(first)
        t0, _, _, _, p0 = min(stalled)  # the stop that passed its bound first
        done = self.measured(p0)
        how = (f"{self.factor:g} x the longest {done[1]} measured, {done[0]:.0f} s, at least {self.floor(p0):.0f} s"
               if done else f"{p0} not measured yet")
        bound = f"{p0}'s bound {self.bound(p0):.0f} s passed after {now - t0:.0f} s: {how}"
        if len(first) < len(quiet) or len(quiet) < len(values):
            self.named = r
            host = f" ({hosts[r]})" if hosts and hosts[r] else ""
            others = f", behind {len(quiet) - 1} other rank(s) stopped waiting for it" if len(quiet) > 1 else ""
            return f"rank {r}{host} hung: no progress for {now - t:.0f} s in {phase} of step {step}{others} ({bound})"
        return (f"ranks {cpu_ranges([x[1] for x in first])} hung together: no progress for {now - since:.0f} s in "
                f"{phase} of step {step} ({bound}); none is behind the others (a collective none of them left): the "
                "hung rank is not told apart by progress")


def record_node(rank: int, per_node: int, path: str | None) -> bool:
    """Name the hung rank's node where scripts/slurm.sbatch reads the lost nodes (LAUNCH_LOST_FILE, node 0's): the job
    is requeued without it, as a lost node is (bounded by progress; not when too few nodes would be left). A hang
    that every rank shares names no node. Returns whether it wrote."""
    from base.host_wait import name_nodes

    return per_node > 0 and name_nodes(path, [rank // per_node])


_MINE: dict = {}  # this rank's publisher: value, counter


def mark(step: int | None, phase: str) -> None:
    """This rank reached `phase` (of `step`; None: the step of its last mark). Costs a dict update; the first call
    starts this rank's publisher (and rank 0's monitor). Nothing in a world of one or without the abort channel."""
    if not _MINE:
        if not _start():
            _MINE["off"] = True
    if _MINE.get("off"):
        return
    _MINE["count"] += 1
    _MINE["step"] = _MINE["step"] if step is None else step
    _MINE["value"] = f"{_MINE['count']} {_MINE['step']} {phase}"


def tick() -> None:
    """Progress inside the current phase (a layer's forward, recompute or backward: `watch_layers`): the counter moves,
    step and phase stay. Nothing before this rank's first `mark` or where marks are off (never starts the publisher)."""
    if "count" not in _MINE:
        return
    _MINE["count"] += 1
    _MINE["value"] = f"{_MINE['count']} {_MINE['step']} {_MINE['value'].split(' ', 2)[2] if _MINE['value'] else 'data'}"


def watch_layers(layers) -> int:
    """Tick at every layer's forward (a recompute's included) and at the start of its backward (the gradient of its
    output arriving), so that a long phase is judged by its longest layer, not as a whole. Returns the hooks added."""
    def grad_tick(_grad):
        tick()

    def after(_module, _args, out):
        first = out[0] if isinstance(out, (tuple, list)) else out
        if getattr(first, "requires_grad", False):
            first.register_hook(grad_tick)

    n = 0
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: tick())
        layer.register_forward_hook(after)
        n += 2
    return n


def _start() -> bool:
    if os.environ.get("ULYSSES_HANG") == "0":
        return False
    from base import comm
    from base.watcher import key

    w = getattr(comm, "_WATCHER", None)  # the abort channel's store (base/comm.py): none for a world of one
    if w is None or w.world <= 1:
        return False
    _MINE.update(count=0, step=0, value="")

    def publish() -> None:
        sent = None
        while True:
            value = _MINE["value"]
            if value != sent:
                try:
                    w.ask(lambda st, v=value: st.set(key(f"progress/{w.rank}"), v))
                    sent = value
                except Exception:  # noqa: BLE001 -- the store gone: the watcher ends this rank
                    pass
            time.sleep(PUBLISH_S)

    threading.Thread(target=publish, name="progress-publish", daemon=True).start()
    if w.rank == 0:
        threading.Thread(target=_monitor, args=(w,), name="progress-monitor", daemon=True).start()
    return True


def _monitor(w) -> None:
    from base.exits import EXIT_PEER_LOST
    from base.watcher import key

    names = [key(f"progress/{r}") for r in range(w.world)]
    try:
        w.ask(lambda st: [st.compare_set(n, "", "") for n in names])  # exist, so multi_get never blocks
        hosts = [h.decode() if isinstance(h, bytes) else str(h)
                 for h in w.ask(lambda st: st.multi_get([key(f"host/{r}") for r in range(w.world)]))]
    except Exception:  # noqa: BLE001 -- no store: the watcher handles it
        return
    tracker = Tracker(w.world)
    while not w.stopped:
        try:
            values = [v.decode() if isinstance(v, bytes) else str(v) for v in w.ask(lambda st: st.multi_get(names))]
        except Exception:  # noqa: BLE001
            values = None
        line = tracker.observe(time.monotonic(), values, hosts) if values else None
        if line:
            global DECLARED
            DECLARED = line
            from base import comm
            from base.host import job_ranks_per_node

            print(f"error: {line}", file=sys.stderr, flush=True)
            if tracker.named is not None:
                record_node(tracker.named, job_ranks_per_node(), os.environ.get("LAUNCH_LOST_FILE"))
            comm.abort(line, EXIT_PEER_LOST)
            os._exit(EXIT_PEER_LOST)
        time.sleep(POLL_S)
