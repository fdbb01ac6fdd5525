"""Whether the output folder can hold the next checkpoint, asked before a byte of it is written: before each save
(`_room`, in the same all-reduce as the refusal of a non-finite optimizer state) and at start (`check_room`: a failed
save's partial folders moved to the trash, rotation to today's --save_total_limit, another user's files), each refused
in one line on every rank naming what to free. `Checkpointer` (training/checkpoint.py) is a `CheckpointRoom`.

What it costs per save: one all-reduce of four numbers (one more before the first checkpoint: the parameters), rank 0's
listing of checkpoints/ and read of the newest manifest, every rank's statvfs; the trash's bytes are counted, never
walked (a killed conversion leaves ~10^5 fragments there: minutes per save on NFS).
"""

from __future__ import annotations

import os
import shutil
import socket

from base import comm
from base.atomic import nearest_folder
from base.log import print0
from training import rotation, universal
from training.checkpoint_files import MANIFEST, POINTER
from training.step import nonfinite_state

# Bytes per parameter of a first checkpoint, before any was written to measure: ZeRO-3's fp32 master and Adam's m and
# v (12; its model-states files hold no weights under ZeRO-3), as bench/checkpoint.py measures (bench/results:
# bytes_per_param 12.0). 14 counted a bf16 copy that is not saved, and refused a fresh 8B run at start-up with room
# for its first checkpoint. Later saves take the newest committed one's size from its manifest.
CKPT_BYTES_PER_PARAM = 12
DISK_MARGIN = universal.DISK_MARGIN


def _own_params(engine) -> int:
    """Parameters this rank's files hold: its ZeRO-3 partitions (ds_tensor), else all of them over the world."""
    n = 0
    module = getattr(engine, "module", None)  # (the tests' stand-in engines have none: nothing to estimate)
    for p in module.parameters() if module is not None else ():
        part = getattr(p, "ds_tensor", None)
        n += part.numel() if part is not None else p.numel() // max(1, comm.world())
    return n


class CheckpointRoom:
    """The room checks of checkpoints under `root` (Checkpointer's: it sets these fields)."""

    root: str  # OUTPUT_DIR/checkpoints
    keep: int  # --save_total_limit
    trash: rotation.Trash  # rank 0's deletions, off the step path

    def _room(self, engine, tag: str) -> None:
        """Refuse, on every rank and in one line, a save the output folder's file system cannot hold, before any byte
        is written (a short write surfaced as torch.save's 'unexpected pos' after a ~21 GB file; Llama-3-8B's
        checkpoint is ~100 GB, and every stage's final one is kept). Need: the newest committed checkpoint's size
        (its manifest, rank 0), else each rank's parameters x CKPT_BYTES_PER_PARAM summed; room: `_space`. A quota
        (EDQUOT) is not seen by statvfs: a write it refuses ends the job in one line too (training/job.py). First, in
        the same all-reduce: a rank whose optimizer state holds a non-finite value (training/step.nonfinite_state)
        refuses the save. Collective."""
        mine = nonfinite_state(engine)
        last, room, bad = self._space(lambda: self._leftovers(tag), vote=float(comm.rank() + 1) if mine else 0.0)
        if bad:
            self._nonfinite(tag, mine)
        need = last or comm.all_reduce([float(_own_params(engine) * CKPT_BYTES_PER_PARAM)])[0].item()
        if need * DISK_MARGIN > room:
            raise ValueError(self._refusal(f"checkpoint {tag}", need, room))

    def _space(self, tidy, create: bool = True, vote: float = 0.0) -> tuple[float, float, float]:
        """(bytes of the newest committed checkpoint or 0, room for the next one, the largest `vote`), the same on every
        rank. Rank 0 first
        runs `tidy` (moves what goes into the trash), then counts the trash, whose deletion starts only once counted (a
        file deleted between the count and the free space would count twice); room: the least free space any rank sees
        there (the folder is shared: train.py refuses one that is not) plus the trash rank 0 is deleting (a job killed
        during its deletion left a checkpoint there, which only a commit emptied: the first save of the next job was
        refused for the room it held). One all-reduce of four numbers. Collective."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        last = trash = 0  # (not created at start-up: a refusal after it must leave the output folder as it was)
        here = nearest_folder(self.root)  # the folder's file system, from its nearest existing parent
        if comm.rank() == 0 and os.path.isdir(self.root):
            self.trash.paused = True
            try:
                tidy()
                # counted, not walked (a walk per save of a killed conversion's ~10^5 fragments: minutes on NFS)
                last, trash = (self._newest_size() or 0), self.trash.bytes()
            finally:
                self.trash.paused = False
            if os.path.isdir(self.trash.folder):
                self.trash.empty()  # deleted while this save writes (a partial conversion counted 0 too)
        top = comm.all_reduce([float(last), -float(shutil.disk_usage(here).free), float(trash), vote], op="max")
        return top[0].item(), -top[1].item() + top[2].item(), top[3].item()

    def _nonfinite(self, tag: str, mine: int) -> None:
        """Some rank's optimizer state holds a non-finite value (every rank is here, after the same vote): nothing of
        `tag` is written, LATEST stays; one line naming the ranks and their hosts (one all-gather, on this path only)."""
        got = [(r, h) for r, h, n in comm.all_gather_object((comm.rank(), socket.gethostname(), mine)) if n]
        where = ", ".join(f"rank {r} on {h}" for r, h in got[:4]) + (f" and {len(got) - 4} more" * (len(got) > 4))
        newest = self._pointer()
        raise ValueError(f"checkpoint {tag} not written: the fp32 master weights or Adam moments of {where} hold "
                         "non-finite values (silent data corruption, a faulty GPU or host memory, or the non-finite "
                         "steps said above); the newest checkpoint, " + (os.path.join(self.root, newest) if newest
                         else "none") + ", stays the resume point: --resume auto (a host's fault: without it, sbatch "
                         "--exclude; non-finite steps: --resume PATH with a lower --learning_rate)")

    def _leftovers(self, tag: str | None) -> None:
        """Rank 0: move into the trash every step_N without a manifest (a failed or killed save's partial folder, at
        any step: it held its bytes until a save at that very step) but the one LATEST names (its manifest may not be
        visible on this node yet: training/restore.py _listed), and whatever is at `tag` (replaced by this save)."""
        latest = self._pointer()
        for t in rotation.tags(self.root):
            if t == tag or t != latest and not os.path.exists(os.path.join(self.root, t, MANIFEST)):
                self.trash.discard(os.path.join(self.root, t))

    def _pointer(self) -> str | None:
        try:
            with open(os.path.join(self.root, POINTER)) as fh:
                return fh.read().strip()
        except OSError:
            return None

    def _refusal(self, what: str, need: float, room: float) -> str:
        """The one line for `what` the folder cannot hold. A lower --save_total_limit helps only at a start (rotated
        there, before the first save: `check_room`); at the minimum (2) the checkpoints to delete by hand are named
        instead, oldest first, with their sizes (a stage's final one is kept for good: only a user removes it).
        Collective (rank 0 lists them)."""
        line = f"{what} needs ~{need / 1e9:.1f} GB in {self.root}, {room / 1e9:.1f} GB free there: "
        if self.keep > 2:
            return line + (f"free space, lower --save_total_limit (now {self.keep}; a start rotates to it before its "
                           "first save), or give --output_dir a larger file system")
        old = comm.run_on_main(self._spare)
        return line + (f"free space (the oldest checkpoints: {old}; each stage's final one is kept for good, the newest "
                       "is the one to resume from) or give --output_dir a larger file system" if old else
                       "free space or give --output_dir a larger file system")

    def _spare(self) -> str:
        """Rank 0: the committed checkpoints but the newest, oldest first (3 at most), with their sizes."""
        out = []
        for t in [t for t in rotation.tags(self.root) if os.path.exists(os.path.join(self.root, t, MANIFEST))][:-1][:3]:
            m, gb = rotation._manifest(self.root, t), self._size(t) / 1e9
            out.append(f"{os.path.join(self.root, t)} {gb:.1f} GB" + (f" ({m['stage_end']})" if m.get("stage_end") else ""))
        return ", ".join(out)

    def check_room(self, resumed: str | None, params: int, stages: int) -> None:
        """At start, after the resume decision and before any engine is built: refuse in one line a first save the
        folder cannot hold (it came after a whole save interval of training before: ~9 min at auto, lost), and print
        what the curriculum will hold. Rank 0 first moves a failed save's partial folders to the trash and rotates to
        today's --save_total_limit (a lower one applied only after a commit, which needed the room first), never the
        resumed checkpoint nor a stage's final one. Need: the newest committed checkpoint's size, else `params` x
        CKPT_BYTES_PER_PARAM. Every rank takes rank 0's decision (`_space`'s all-reduce). Collective.
        A folder another user wrote (a requeue in a root container, then a run as this user): rank 0 removes DeepSpeed's
        recovery scripts it cannot write (engine._copy_recovery_script copies them over the old ones at every save:
        PermissionError at the first save of every restart, a save interval lost each time), or refuses in one line
        where it cannot remove them, or cannot write the folder or its trash (rank 0's decision on every rank)."""

        def foreign() -> None:
            for where in (self.root, self.trash.folder):
                if os.path.isdir(where) and not os.access(where, os.W_OK | os.X_OK):
                    raise ValueError(f"{where}: this user (uid {os.getuid()}) cannot write there (written by another "
                                     "user: a run as root in a container?): give it this user (chown -R) or use "
                                     "another --output_dir")
            for name in ("zero_to_fp32.py", "zero_to_torch.py"):  # deepspeed/runtime/engine.py _copy_recovery_script
                path = os.path.join(self.root, name)
                if os.path.isfile(path) and not os.access(path, os.W_OK):
                    try:
                        os.remove(path)  # the folder is this user's: DeepSpeed copies it afresh at the next save
                    except OSError as e:
                        raise ValueError(f"{path}: another user's file this user (uid {os.getuid()}) cannot replace "
                                         f"({e.strerror}), which DeepSpeed rewrites at every save: remove it or use "
                                         "another --output_dir") from None
                    print0(f"note: removed {path} (another user's, not writable here): DeepSpeed writes it at each save")

        comm.run_on_main(foreign)
        root = os.path.abspath(self.root)
        tag = os.path.basename(resumed.rstrip("/")) if resumed else None
        tag = tag if tag and os.path.dirname(os.path.abspath(resumed.rstrip("/"))) == root else None

        def tidy() -> None:
            self._leftovers(None)
            if tag is not None and rotation.TAG.match(tag):
                rotation.rotate(self.root, self.keep, keep_tag=tag, trash=self.trash)  # renames only

        last, room, _ = self._space(tidy, create=False)
        need = last or float(params * CKPT_BYTES_PER_PARAM)
        if need * DISK_MARGIN > room:
            raise ValueError(self._refusal("the first checkpoint of this start", need, room))
        held = comm.run_on_main(lambda: sum(self._size(t) for t in rotation.tags(self.root)) if os.path.isdir(
            self.root) else 0)
        count = self.keep + 1 + max(stages - 1, 0)  # rolling (+1 being written) and the earlier stages' final ones
        total = need * count
        line = (f"checkpoint room: this curriculum keeps up to {self.keep + 1} rolling (--save_total_limit {self.keep}, "
                f"+1 being written) + {max(stages - 1, 0)} stage-end checkpoints of ~{need / 1e9:.1f} GB: "
                f"~{total / 1e9:.1f} GB; {room / 1e9:.1f} GB free in {self.root} (its trash included) + "
                f"{held / 1e9:.1f} GB its checkpoints hold now")
        print0(("warning: " + line + ": it may fill before the run ends (a quota is not seen here)")
               if total > room + held else line)

    def _size(self, tag: str) -> int:
        """Bytes of committed checkpoint `tag` (its manifest's files; 0 without one)."""
        return sum(int(f.get("size", 0)) for f in rotation._manifest(self.root, tag).get("files", {}).values())

    def _newest_size(self) -> int | None:
        """Bytes of the newest committed checkpoint (its manifest's files), None when there is none."""
        tag = self._pointer()
        return (self._size(tag) or None) if tag else None
