"""One writer per shard of a prepared folder: `scripts/prepare_data.py` holds an exclusive lock on
`--output/.prepare.lock-s<i>` while it writes shard i (the whole folder is shard 0 of 1), so a second run into the same
folder and shard (`srun` of one command on N tasks without --shard, a second terminal, an array job) is refused in one
line instead of "resuming" the first one's unfinished chunk: it deleted the open chunk and its tmp files, then both
wrote the same names. Shards of one preparation (--shard i/N) take different locks and run at once. The plan a shard is written under is
checked here too (check_plan; a merge's shards by check_rules), the tokenization rules' version included: only the
steps between two versions that changed rows the shard holds refuse it (packing.RULE_ROWS).

The lock is flock(2) (Python's fcntl.flock calls it) on an open file: the kernel drops it when the process dies, however
it dies (no stale lock to remove; a pid reused in another container does not hold it). Shared file systems:
- NFS: Linux emulates flock with a whole-file byte-range lock (NLM on v3, the protocol's own locks on v4): it holds
  across clients; a crashed client's lock lasts until its v4 lease expires (~90 s) or, on v3, until it reboots. Mounted
  with `nolock` / `local_lock=flock`: a lock of this node only.
- Lustre: across clients with `-o flock` (a crashed client's lock goes with its eviction), this node only with
  `-o localflock`; under `noflock` (the default of older releases) flock fails with ENOSYS.
- where a file system cannot lock at all (ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL: FUSE mounts, NFS without a lock daemon),
  or this user may not (EACCES / EPERM: another user's lock file), the run goes on after one note, unguarded as
  before, and is never refused for that. A lost node's lock (NFS v3, Lustre) stays until the server lets it go: the
  refusal names the file to delete.
Cost: one small file per shard, one open + flock at start (a round trip to the server on NFS / Lustre)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import time
import weakref

from data import packing, store

LOCK = ".prepare.lock"
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EACCES, errno.EPERM}
# (EACCES / EPERM: another user's lock file in a group folder, or an NFS lock it may not take: a note, not a refusal)
# locks this process holds, by lock file: a second prepare() of the same shard in this process (a test, a retry after
# a refusal) takes the one it holds instead of refusing itself (flock conflicts between two opens of one process)
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Held:
    """An open lock file holding its flock; closed (the lock released) when dropped, or by the kernel at exit."""

    def __init__(self, fd: int | None, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = release


def lock_path(output: str, shard: int) -> str:
    return os.path.join(output, f"{LOCK}-s{shard:05d}")


def holder(path: str) -> str:
    """Who holds the lock at `path`, as its holder wrote it ("host:pid, started ..."), or "unknown"."""
    try:
        with open(path) as fh:
            h = json.load(fh)
        return f"{h['host']}:{h['pid']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def try_lock(path: str) -> int | None:
    """An fd of `path` holding an exclusive flock; None where the file system cannot lock. BlockingIOError where
    another open file (another process) holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # another user's lock file (0644 under the usual umask), a read-only folder
        if e.errno in UNSUPPORTED:
            return None
        raise
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o664)  # the group's next user of a shared folder may lock it too
    except OSError:
        pass
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in UNSUPPORTED:
            return None
        raise
    return fd


def hold(output: str, shard: int, n_shards: int, log=print) -> Held:
    """Take shard `shard`'s lock of `output` (made if missing) for as long as the returned object lives (prepare()
    keeps it until it returns; the kernel releases it if the process dies). ValueError (one line) where another process
    holds it; where the file system cannot lock, one note and an unguarded run."""
    os.makedirs(output, exist_ok=True)
    path = lock_path(output, shard)
    key = os.path.realpath(path)
    if (held := _HELD.get(key)) is not None:
        return held
    try:
        fd = try_lock(path)
    except BlockingIOError:
        which = f" (shard {shard})" if n_shards > 1 else ""
        raise ValueError(f"--output {output}{which} is being written by another process ({holder(path)}): wait for it, "
                         f"or give each task --shard i/N (if that process is gone with a lost node, whose lock an NFS v3 "
                         f"or Lustre server keeps until the node is back or evicted, delete {path})") from None
    if fd is None:
        log(f"note: {output}: its lock file cannot be locked here (the file system, or another user's file): "
            "nothing stops a second run from writing this shard at the same time (give each task --shard i/N)")
    else:  # who holds it, for the refusal of another run (written after the lock is ours: never torn by a second one)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode(), 0)
    _HELD[key] = held = Held(fd, path)
    return held


def unfinished(path: str, flag: str = "--input") -> None:
    """ValueError (one line) where `path`, given as an input (--input, train.py's --dataset_path), is a preparation's own
    folder not finished: a shard's plan there (plan-s<i>.json, written first) and no manifest.json (preempted before
    it; shards finished and --merge never run). Read as rows, its chunk records were "not valid JSON ...
    --skip_bad_rows", and that advice "prepared" them. Cost: one listing of the folder and one small read."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, store.MANIFEST)):
        return
    names = os.listdir(path)
    plan = next((f for f in sorted(names) if re.fullmatch(r"plan-s\d{5}\.json", f)), None)
    try:
        n = int(store.read_json(os.path.join(path, plan))["shard"][1]) if plan else 0
    except (OSError, ValueError, KeyError, IndexError, TypeError):  # not ours: a data file of that name
        return
    if not n:
        return
    done = sorted(int(f[6:11]) for f in names if re.fullmatch(rf"shard-\d{{5}}-of-{n:05d}\.json", f))
    how = ("run the same prepare_data command again to resume it" if n == 1 else "--merge it (python "
           f"scripts/prepare_data.py --output {path} --merge)" if len(done) == n else "run the unfinished shards' "
           "prepare_data commands (--shard i/N) again to resume them, then --merge")
    state = "stopped before its end" if n == 1 else f"shard(s) {done} finished of {n}"
    raise ValueError(f"{flag} {path}: a preparation not finished (no {store.MANIFEST}: {state}): {how}; then pass the "
                     "folder itself as train.py's --dataset_path")


def is_held(folder: str) -> bool:
    """Whether a live process holds a lock of `folder` now (False where none is held or locks are unsupported)."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith(LOCK):
            try:
                fd = try_lock(os.path.join(folder, name))
            except BlockingIOError:
                return True
            except OSError:
                continue
            if fd is not None:
                os.close(fd)
    return False


# a kind of row packing.RULE_ROWS names -> (the shard record's count of it, the rows as a message names them)
KINDS = {"chat": ("chat_docs", "conversations"),
         "ids": ("ids_beside_rows", "pre-tokenized rows with loss-mask, packing or attention_mask columns"),
         "special": ("special_text_docs", "text documents holding a special-token string")}


def _parts(rules) -> dict[str, int] | None:
    found = [re.fullmatch(r"([a-z]+)(\d+)", p) for p in str(rules).split(":")]
    return {m.group(1): int(m.group(2)) for m in found} if all(found) else None


def steps(old, new: str) -> list[str] | None:
    """The versions a part took from rules `old` to `new` ("doc6" -> "doc8": doc7, doc8); None where they cannot be
    told apart so (another set of parts, a part newer than today's)."""
    o, w = _parts(old), _parts(new)
    if o is None or w is None or o.keys() != w.keys() or any(o[k] > w[k] for k in w):
        return None
    return [f"{k}{v}" for k in w for v in range(o[k] + 1, w[k] + 1)]


def judge(old, record: dict) -> tuple[list[str], list[str], list[str]]:
    """The steps from rules `old` to today's (packing.RULES) that changed rows the shard's `record` (a shard's or a
    committed chunk's: cumulative counts) holds, that it may hold (its record has no count of them: written before the
    count), and that it holds none of. A step of no kind listed (text rows, any row) counts as held."""
    out: tuple[list[str], list[str], list[str]] = ([], [], [])
    for s in steps(old, packing.RULES) or [f"{old} -> {packing.RULES}"]:
        kind = packing.RULE_ROWS.get(s)
        count = record.get(KINDS[kind][0]) if kind else 1
        out[0 if count else 1 if count is None else 2].append(s)
    return out


def said(which: list[str]) -> str:
    """Steps with the rows they changed: `chat9 (conversations), doc7, doc8 (pre-tokenized rows ...)`."""
    kinds = {s: packing.RULE_ROWS.get(s) for s in which}
    return "; ".join(f"{', '.join(s for s in which if kinds[s] == k)} ({KINDS[k][1] if k else 'text or any rows'})"
                     for k in dict.fromkeys(kinds.values()))


def _committed(output: str, shard: int) -> dict | None:
    """The last committed chunk's record of a shard (its counts so far), None with none: nothing held yet."""
    k = 0
    while os.path.exists(os.path.join(output, f"chunk-{store.chunk_name(shard, k)}.json")):
        k += 1
    return store.read_json(os.path.join(output, f"chunk-{store.chunk_name(shard, k - 1)}.json")) if k else None


def _unsaid(holds: str, may: list[str], clear: list[str]) -> str:
    """A note's words on steps that changed no row a shard holds (`holds`: "it holds"), or rows it cannot count."""
    return "; ".join(([f"{said(clear)} changed only rows {holds} none of"] if clear else []) + (
        [f"{said(may)} changed rows its record does not count (written before the count): if it held any, "
         "--overwrite redoes it"] if may else []))


def check_plan(output: str, shard: int, plan_path: str, plan: dict, finished: bool, log=print) -> None:
    """The shard's recorded plan against this command's `plan`: another preparation refused (one line); the
    tokenization rules' version (packing.RULES) compared only for an unfinished shard, whose chunks a continuation
    would write under other rules (a shard killed on one checkout and continued on another mixed both): refused where
    a step between the two changed rows its committed chunks hold (`judge`), else continued under today's rules with a
    note (its plan rewritten: its chunks are as today's rules write them); a finished shard under older rules is said,
    and `plan["rules"]` takes the shard's own (None: begun before it was recorded), so its record and a merge see
    what it holds. A shard whose plan differs only in keys recorded since (and its inputs named the older way) is
    refused as an older version's, with --overwrite (the same command resumed after a pull: it read as "another
    preparation"). A new shard's plan is written."""
    if not os.path.exists(plan_path):
        store.write_json_atomic(plan_path, plan)
        return
    old = store.read_json(plan_path)
    differs = sorted(k for k in plan if k != "rules" and old.get(k) != plan[k])
    added = [k for k in differs if k not in old]  # recorded since the shard began: an older version's plan
    if differs and set(differs) <= {*added, *(["units"] if _older_units(old.get("units"), plan["units"]) else [])}:
        # (the same command: its plan lacks what this version records, and names its inputs the older way; whether it
        # read them alike cannot be told, so it is not continued)
        why = [f"its plan has no {added}"] * bool(added) + ["it names its inputs the older way"] * ("units" in differs)
        raise ValueError(f"--output {output}: shard {shard} was begun by an older version of prepare_data "
                         f"({' and '.join(why)}): this version cannot continue it; --overwrite to start this shard "
                         "again (or finish it on that version)")
    if differs:
        raise ValueError(f"--output {output} holds shard {shard} of another preparation (differs in {differs}): "
                         "use another --output, or --overwrite to start this shard again")
    had = old.get("rules")
    if had == plan["rules"]:
        return
    if had is not None and not finished:
        rec = _committed(output, shard)
        held, may, clear = judge(had, rec) if rec else ([], [], [])  # nothing committed: nothing to mix
        # rows its chunks' record cannot count (written before the count) may be there: refused as held (a review: a
        # shard of padded ids rows begun yesterday kept its pads in its first chunks and stripped them in the rest);
        # a merge of finished shards, each whole under its own rules, says them instead (check_rules)
        if held or may:
            raise ValueError(f"--output {output}: shard {shard} was begun under other tokenization rules ({had}, today "
                             f"{packing.RULES}) and holds rows they read differently ({said(held + may)}"
                             f"{' if its chunks hold any: their record cannot say' if may and not held else ''}): "
                             "continuing would mix them in one shard: --overwrite to start it again")
        store.write_json_atomic(plan_path, plan)
        if rec:
            log(f"note: {output}: shard {shard} was begun under tokenization rules {had}, continued under today's "
                f"{packing.RULES}: {_unsaid('its committed chunks hold', may, clear)}")
        return
    plan["rules"] = had
    log(f"note: {output}: shard {shard} was " + ("prepared" if finished else "begun") + " by an older version "
        + ("" if finished else "(rows read differently since, e.g. a top-level system_prompt, may differ between its "
           "chunks) ") + "; today's rules read some rows differently: --overwrite redoes it")


def _older_units(old, new: list) -> bool:
    """Whether `old` names the same files as today's unit identities `new` ("kind:name/file:size:sample",
    data/discover.Unit.identity) in an older form without the sample ("kind:/abs/path/file:size", before 2026-11-30):
    the same kind, file name and size, in order."""
    if not isinstance(old, list) or len(old) != len(new) or not old:
        return False
    for was, now in zip(old, new):
        kind, _, rest = str(was).partition(":")
        path, _, size = rest.rpartition(":")
        got = now.split(":", 1)[-1].rsplit(":", 2)
        if len(got) != 3 or now.split(":", 1)[0] != kind or re.fullmatch(r"[0-9a-f]{16}", size or "") or (
                os.path.basename(path), size) != (os.path.basename(got[0]), got[1]):
            return False
    return True


def _in_order(step: str) -> tuple:
    """A step's place among steps: by part, then by number (doc9 before doc11)."""
    return re.sub(r"\d+", "", step), [int(n) for n in re.findall(r"\d+", step)]


def check_rules(output: str, records: list[dict], log=print) -> None:
    """A merge's shards (their records) under one tokenization rules' version: where they differ, a shard not under
    today's is refused where a step between its rules and today's changed rows it holds (`judge`), else merged with a
    note naming the steps and their rows; a shard begun before versions were recorded (None) said."""
    rules = [r["plan"].get("rules") for r in records]
    known = {r for r in rules if r is not None}
    if len(known) > 1:
        old = {i: judge(r, records[i]) for i, r in enumerate(rules) if r is not None and r != packing.RULES}
        if held := {i: v[0] for i, v in old.items() if v[0]}:
            raise ValueError(f"{output}: shards were prepared under different tokenization rules ({sorted(known)}): "
                             f"shard(s) {sorted(held)} hold rows today's ({packing.RULES}) read differently "
                             f"({said(sorted({s for v in held.values() for s in v}, key=_in_order))}): redo them with --overwrite")
        groups: dict[tuple, list[int]] = {}  # one note per kind of shard (100 shards of yesterday: one line)
        for i, (_, may, clear) in old.items():
            groups.setdefault((rules[i], tuple(may), tuple(clear)), []).append(i)
        for (had, may, clear), which in groups.items():
            log(f"note: {output}: shard(s) {which} were prepared under tokenization rules {had}, merged with today's "
                f"{packing.RULES}: {_unsaid('they hold', list(may), list(clear))}")
    if None in rules:
        log(f"note: {output}: shard(s) {[i for i, r in enumerate(rules) if r is None]} were prepared before the rules' "
            "version was recorded: a row read differently since may differ between shards")
