"""The restore path of a checkpoint: which one a start resumes (`resume`, `find_resume`), its verification, and what
each stage starts from (`restore_stage`); loading it into an engine (`load`, through a universal conversion when
another world size wrote it) is training/checkpoint_load.py, whose `Loader` this class is. training/checkpoint.py
saves and commits; `Checkpointer` there is this class plus the save path (nothing else reads state: DESIGN.md).

Loading verifies the manifest in parallel: of a checkpoint of this world size each rank checks the files it will load
(its node's page cache then serves the load), the rest dealt by bytes (the largest first, each to the rank with the
fewest bytes so far); an incomplete or corrupt checkpoint is skipped with a warning naming it.

Every rank takes the same decision (docs/checkpoints.md): on a shared file system a node may list a directory as it
was up to a minute ago (NFS attribute caching), so a rank's own listing never picks what is loaded. Rank 0 alone
lists `checkpoints/` (with the one LATEST names: training/resume_listing.py), reads the manifest, `trainer.json` and
the pointer files, and broadcasts them; all ranks then verify the same checkpoint together and take the gathered
verdict. A file a rank cannot see yet is looked for again for up to `settle_s` (60 s) before the checkpoint counts
as incomplete; the rank that *loads* a file does the same (each rank looks up only what it is about to load, rank 0
also what no rank loads: `awaited`; then one gathered verdict), so a node that sees a file late does not fail the
resume. At Llama-3-8B on 32 ranks a checkpoint is ~100 GB (bf16 weights + fp32 master weights and Adam moments):
each rank writes and, at resume, re-reads ~3 GB.

A checkpoint written by another world size is converted to DeepSpeed's universal format (training/universal.py):
keyed by the checkpoint's content (its manifest's hash), never by its name, written under this run's
OUTPUT_DIR/universal/ (never beside a source it does not own), locked against another job converting the same
source, and started only if it can finish before the job's end (else exit 75 to be requeued).

`--resume PATH` (or `none`) starts a new branch from PATH (or from nothing) once (training/branches.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from base import comm
from base.log import print0
from training import branches, rotation
from training.checkpoint_files import (
    MANIFEST,
    POINTER,
    TAG,
    crc32,
    deal_by_bytes,
    list_files,
    not_visible,
    point,
    read_json,
)
from training.checkpoint_load import Loader, set_rng_state
from training.resume_listing import listing
from training.resume_notes import check_other_run, data_moved, moved_note, resume_notes, same_layout


@dataclass
class TrainState:
    """Where the run stands: what every checkpoint records (trainer.json, with the run's metadata) and a resume
    restores. `checkpoint` is the newest committed checkpoint, the one a resume or the next stage loads."""

    step: int = 0
    tokens: int = 0
    stage: int = 0
    wandb_id: str | None = None
    wandb_home: str | None = None  # the real path of the output folder whose W&B run wandb_id is (metrics.home)
    checkpoint: str | None = None
    stage_steps: list | None = None  # the checkpoint's stages' step counts as they ran (written with its metadata)
    heldout: dict | None = None  # the held-out split the run made at its first start (data/pipeline.open_run_data)
    stage_sizes: list | None = None  # what sized each stage then: steps, tokens:N, epochs:E (curriculum.Stage)
    stage_full: list | None = None  # each stage's whole-stage count at the rate its rest was planned at (keep_stage_steps)
    tokenizer_vocab: str | None = None  # whose ids it trained on (data/store.vocab_identity)
    optimizer_groups: int | None = None  # 2: norms and biases in a group of their own (no decay); None / 1: one group
    stage_names: list | None = None  # the checkpoint's stages up to its own, by name (None: one not recorded)
    # read at a resume, never saved: whether today's job runs the checkpoint's stage on its world, SP, micro-batch,
    # accumulation and length (resume_notes.same_layout; None: not known), and the RoPE its hf_config.json holds (the
    # one its stage trained with: training/curriculum_resume.keep_stage_steps)
    same_layout: bool | None = None
    trained_rope: dict | None = None
    # the open run of non-finite steps (training/step.bad_step): how many, and the first. Never saved: no save is taken
    # while one is open (training/stage.py), so every checkpoint's is 0
    bad_steps: int = 0
    first_bad: int | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "stage": self.stage, "wandb_id": self.wandb_id,
                "wandb_home": self.wandb_home, "optimizer_groups": self.optimizer_groups}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens, self.stage = int(d["step"]), int(d["tokens"]), int(d["stage"])
        self.wandb_id, self.wandb_home = d.get("wandb_id"), d.get("wandb_home")
        self.stage_steps = d.get("stage_steps")
        self.heldout = d.get("heldout")
        self.stage_sizes = d.get("stage_sizes")
        self.stage_full = d.get("stage_full")
        self.tokenizer_vocab = d.get("tokenizer_vocab")
        self.optimizer_groups = d.get("optimizer_groups")
        self.stage_names = recorded_stage_names(d)


def trained_rope(path: str) -> dict | None:
    """Rank 0: the rope_parameters the checkpoint's hf_config.json holds (its text config's, for a composite one):
    what its stage trained with; None where it does not say."""
    got = read_json(os.path.join(path, "hf_config.json")).get("json")
    for where in (got, got.get("text_config") if isinstance(got, dict) else None):
        if isinstance(where, dict) and isinstance(where.get("rope_parameters"), dict):
            return where["rope_parameters"]
    return None


def recorded_stage_names(d: dict) -> list:
    """The names of a checkpoint's stages up to its own (trainer.json): its `stage_names`, else (older checkpoints)
    the stages of the config it was saved with (training/curriculum.resolve_stages' names: `name` or stage<i>, `main`
    without stages) ending with its `stage_name`; None where neither says."""
    k = int(d["stage"])
    if isinstance(d.get("stage_names"), list):
        return d["stage_names"]
    raw = (d.get("config") or {}).get("stages")
    names = [s.get("name") or f"stage{i}" for i, s in enumerate(raw or [{"name": "main"}])] if isinstance(
        raw, list) else []
    names = (names + [None] * (k + 1))[:k + 1]
    names[k] = d.get("stage_name", names[k])
    return names


def named_checkpoint(path: str, output_dir: str) -> str:
    """Rank 0: the checkpoint `--resume PATH` names. A stage's marker (checkpoints/STAGE_<i>_<name>, a file holding
    its end checkpoint's name, as scripts/export_hf.py takes) -> that checkpoint's folder; a relative PATH not found
    here is looked for under OUTPUT_DIR too (`--resume checkpoints/STAGE_1_s512`, as docs/checkpoints.md writes it)."""
    if not os.path.exists(path) and not os.path.isabs(path) and os.path.exists(os.path.join(output_dir, path)):
        path = os.path.join(output_dir, path)
    if os.path.isfile(path) and os.path.basename(path).startswith("STAGE_"):
        with open(path) as fh:
            return os.path.join(os.path.dirname(path), fh.read().strip())
    return path


class Restorer(Loader):
    """Find, verify and load checkpoints under `root` (Checkpointer's restore half: it sets these fields and Loader's)."""

    root: str  # OUTPUT_DIR/checkpoints
    branched: bool = False  # this start took a branch (--resume PATH / none, the first time)

    def tags(self) -> list[str]:
        return rotation.tags(self.root)

    def verify(self, path: str) -> str | None:
        """None if the checkpoint at `path` is complete and intact, else the reason; the same answer on every rank.
        Collective: rank 0 reads the manifest (and lists the folder for unlisted files), every rank checks its
        deal of the files (by bytes), the first reason found by any rank is the verdict."""
        rank, world = comm.rank(), comm.world()
        manifest = comm.run_on_main(lambda: read_json(os.path.join(path, MANIFEST)))
        if "error" in manifest:
            return f"no readable manifest ({manifest['error']})"
        files = manifest["json"].get("files")
        if not isinstance(files, dict):
            return "no readable manifest (no file list)"
        reason = None
        if rank == 0:  # a state file the loaders would read (DeepSpeed's *.pt beside the manifest's, rank files) is
            # another writer's; anything else (a user's zero_to_fp32 output, NFS's .nfs* of a file deleted while
            # open) is noted: the checkpoint stays complete (skipped, it was rotated away with the user's file)
            extra = sorted(set(list_files(path)) - set(files)) if os.path.isdir(path) else []
            stray = [f for f in extra if f.endswith(".pt") and os.path.dirname(f) in ("", "state")]
            reason = f"files not in the manifest: {stray[:3]}" if stray else None
            if extra and not stray:
                print0(f"note: {path} holds files the run did not write ({extra[:3]}): not read, left as they are")
        own = manifest["json"].get("world") == world  # each rank first verifies what it will load (its node's cache)
        mine = deal_by_bytes({f: int(e["size"]) for f, e in files.items()}, world, own)[rank]
        reason = reason or self._check_files(path, {f: files[f] for f in mine})
        return next((r for r in comm.all_gather_object(reason) if r), None)

    def _check_files(self, path: str, files: dict) -> str | None:
        """The first problem among `files` (name -> manifest entry), or None. A file missing or shorter than its
        entry may be a stale view of this node: looked for again every 2 s for up to `settle_s`."""
        late = not_visible(path, {f: int(e["size"]) for f, e in files.items()}, self.settle_s)
        if late:
            f = min(late)
            return f"missing {f}" if late[f] is None else f"{f} has {late[f]} bytes, manifest says {files[f]['size']}"
        for f in sorted(files):
            full, want = os.path.join(path, f), files[f]
            if os.path.getsize(full) != want["size"]:
                return f"{f} has {os.path.getsize(full)} bytes, manifest says {want['size']}"
            if crc32(full) != want["crc32"]:
                return f"{f} checksum differs from the manifest"
        return None

    def find_resume(self, resume: str) -> str | None:
        """Path of the checkpoint to resume from, or None (fresh). Collective; rank 0 decides, every rank gets it.

        `auto`: this run's newest complete checkpoint. `PATH` and `none` start a branch (from PATH, or fresh) the
        first time this run folder is started with them, recorded in checkpoints/BRANCHES.json; started again with
        the same `--resume` (a SLURM requeue, a launch.sh re-run, a user re-running the command after a crash) the
        run continues like `auto`, from PATH again only while the branch has no complete checkpoint of its own. A
        branch is known by its source's content (the sha256 of its MANIFEST.json), not by its name: a new `step_N`
        written under an old name (after another branch) is a new branch point."""
        if resume not in ("auto", "none"):  # a stage's marker: its checkpoint
            resume = comm.run_on_main(lambda: named_checkpoint(resume, self.output_dir))
        if resume != "auto":
            taken = comm.run_on_main(lambda: branches.taken(self.root, resume))
            if taken is None:
                path = None if resume == "none" else self._checked(resume)
                comm.run_on_main(lambda: branches.start(self.root, path, resume, self._listed()))
                self.branched = True  # this start took it (its W&B steps restart below the run's: training/metrics.py)
                return path
            print0(f"--resume {resume}: this branch was taken on {taken}: continuing from this run's newest complete "
                   f"checkpoint (docs/checkpoints.md)")
        for tag in reversed(comm.run_on_main(self._listed)):  # rank 0's view is the only one read
            path = os.path.join(self.root, tag)
            t0 = time.perf_counter()
            why = self.verify(path)
            if why is None:
                print0(f"verified {path} in {time.perf_counter() - t0:.1f}s")
                return path
            print0(f"warning: skipping checkpoint {path}: {why}")
        if resume not in ("auto", "none"):  # the branch saved nothing of its own yet: from its source again
            return self._checked(resume)
        return None

    def _listed(self) -> list[str]:
        """Rank 0: this run's checkpoints, oldest first, LATEST's looked up by name (training/resume_listing.py)."""
        return listing(self.root, self.settle_s)

    def _checked(self, path: str) -> str:
        why = self.verify(path)
        if why:
            raise ValueError(f"--resume {path}: not a complete checkpoint ({why}); use --resume auto or another "
                             "checkpoint")
        return path

    def resume(self, resume: str, model_hash: str, model_name: str, config: dict | None = None,
               check=None) -> TrainState:
        """The run's state at start: fresh, or restored from the checkpoint `resume` picks (find_resume), refused
        in one line when that checkpoint was written for another architecture or `check(state)` refuses it (today's
        stages: training/curriculum_resume.check_resumed_stages) or when it ends a finished run whose dataset or base model
        differ from today's (training/resume_notes.check_other_run), all before a universal conversion (up to ~45 min
        at 8B); a note names the run's settings (`config`, training/config.to_dict) that differ from the ones that wrote
        it. Collective: every rank decides on rank 0's copy of trainer.json."""
        state = TrainState()
        path = self.find_resume(resume)
        if path is None:
            print0("starting fresh")
            return state
        trainer = self.read_trainer(path)
        if trainer.get("model_hash") != model_hash:
            raise ValueError(f"checkpoint {path} was written for a different model architecture than {model_name}: "
                             "use the same model, another --output_dir, or --resume none")
        state.load_state_dict(trainer)
        state.checkpoint = path
        state.same_layout = same_layout(trainer, config or {}, comm.world())
        state.trained_rope = comm.run_on_main(lambda: trained_rope(path))
        if check is not None:
            check(state)
        check_other_run(path, self.output_dir, trainer, config or {}, resume)
        self._universal(path)  # another world size: converted now, before any engine holds memory (or exit 75/2)
        comm.run_on_main(lambda: self._repoint(path))  # LATEST names what it resumes, before training on
        print0(f"resuming from {path} (step {state.step}, stage {state.stage})")
        for note in resume_notes(path, trainer.get("config") or {}, config or {}, trainer, comm.world()):
            print0(note)
        return state

    def _repoint(self, path: str) -> None:
        """Rank 0: a checkpoint of this run resumed, newer than the one LATEST names (a kill between a commit's manifest
        and its pointers), is named by LATEST and `latest` now (left, they named the older one for good); a branch's
        point (branches.py points both at it), another folder's and an older one (a newer failed verification) are not."""
        tag, pointer = os.path.basename(path.rstrip("/")), os.path.join(self.root, POINTER)
        try:
            with open(pointer) as fh:
                named = TAG.match(fh.read().strip())
        except (OSError, UnicodeDecodeError):
            named = None
        own = TAG.match(tag) and os.path.dirname(os.path.realpath(path.rstrip("/"))) == os.path.realpath(self.root)
        if own and (named is None or int(named.group(1)) < int(TAG.match(tag).group(1))):
            point(self.root, tag)
            print0(f"{pointer} named {named.group(0) if named else 'no checkpoint'}, older than {tag}, the newest "
                   "complete one (a kill inside its commit): LATEST and `latest` name it now")

    def evaluated(self) -> str:
        """What scripts/evaluate.py loads for `output_dir`, the same on every rank (collective): a run folder (checkpoints/
        with a LATEST or a step_N) -> what `--resume auto` resumes (find_resume, verified; not LATEST as written: a kill
        inside a commit left it on the one before); a checkpoint -> itself, verified; anything else -> itself."""
        path, root = self.output_dir, self.root
        what = comm.run_on_main(lambda: "checkpoint" if os.path.isfile(os.path.join(path, MANIFEST)) else "run" if (
            os.path.lexists(os.path.join(root, POINTER)) or rotation.tags(root)) else "other")
        found = self.find_resume("auto") if what == "run" else path
        why = self.verify(path) if what == "checkpoint" else None
        if found is None or why:
            raise ValueError(f"{path}: " + (f"not a complete checkpoint ({why})" if why else
                                            f"no complete checkpoint in {root}") + ": name another one")
        return found

    def stage_end(self, index: int, name: str) -> tuple[str, int] | None:
        """The checkpoint that ended stage `index` of this run and its step, for a stage finished before this start
        whose evaluation is not on record: the one its marker (checkpoints/STAGE_<index>_<name>, `named_checkpoint`;
        a stage renamed since: the one marker of that index) names, complete. None, with a note, where this folder
        does not hold it (a branch into a new folder from a later stage, a marker moved to abandoned/): the stage is
        not evaluated, never from the resumed checkpoint (a later model recorded as that stage's). Collective: rank 0
        reads the marker and the checkpoint's trainer.json, every rank verifies it (reads its share of the bytes
        once: ~3 GB per rank at Llama-3-8B on 32 ranks, as a resume's verification)."""
        def find() -> dict:
            names = sorted(n for n in (os.listdir(self.root) if os.path.isdir(self.root) else [])
                           if n.startswith(f"STAGE_{index}_") and os.path.isfile(os.path.join(self.root, n)))
            marker = f"STAGE_{index}_{name}"
            marker = marker if marker in names else (names[0] if len(names) == 1 else None)
            path = marker and named_checkpoint(os.path.join(self.root, marker), self.output_dir)
            got = read_json(os.path.join(path, "trainer.json")) if path and TAG.match(os.path.basename(path)) else {}
            trainer = got.get("json") or {}
            if trainer.get("stage") != index or not os.path.isfile(os.path.join(path, MANIFEST)):
                return {}
            return {"path": path, "step": int(trainer["step"]), "world": trainer.get("world")}

        got, world = comm.run_on_main(find), comm.world()
        if not got:
            print0(f"note: stage {index}'s end is not in this folder: not evaluated")
            return None
        if got["world"] not in (None, world):  # its load would convert it (universal: ~45 min, 2x its disk at 8B)
            print0(f"note: stage {index}'s end, {got['path']}, was saved by {got['world']} ranks, this job has {world}: "
                   f"not evaluated here (scripts/evaluate.py {got['path']} does)")
            return None
        why = self.verify(got["path"])
        if why:
            print0(f"note: stage {index}'s end, {got['path']}, is not a complete checkpoint ({why}): not evaluated")
            return None
        return got["path"], got["step"]

    def restore_stage(self, engine, state: TrainState, stage: int, sampler, reset_optimizer: bool,
                      ended: str | None = None) -> bool:
        """Load what stage `stage` starts from into `engine` and `sampler`: in the middle of the stage, the whole
        engine state, the data position and (same world) every rank's RNG; at its start, the previous stage's
        final weights (and Adam moments unless `reset_optimizer`) with a fresh LR schedule; nothing on a fresh
        run. A stage before the resumed checkpoint's (finished before this start, evaluated only now) loads `ended`,
        its own end (`stage_end`), never the resumed checkpoint. Returns whether the RNG streams were restored (else
        the caller seeds them for the stage)."""
        if state.checkpoint is None:
            return False
        if stage < state.stage:
            assert ended is not None, "a finished stage is evaluated from its own end (stage_end), or not at all"
            self.load(engine, ended, load_optimizer=False, load_scheduler=False)
            return False
        if state.stage == stage:
            saved = self.load(engine, state.checkpoint)
            moved = data_moved(saved["sampler"], sampler.state_dict())
            if moved:  # appended documents, another packing: the position is a fraction of another order now
                print0(moved_note(state.checkpoint, moved))
            sampler.load_state_dict(saved["sampler"])
            if "rng" in saved:
                set_rng_state(saved["rng"])
                return True
            return False
        self.load(engine, state.checkpoint, load_optimizer=not reset_optimizer, load_scheduler=False)
        return False

    @staticmethod
    def read_trainer(path: str) -> dict:
        """The counters, stage and config a checkpoint was saved with: rank 0 reads them, every rank gets its copy."""
        got = comm.run_on_main(lambda: read_json(os.path.join(path, "trainer.json")))
        if "error" in got:
            raise RuntimeError(f"checkpoint {path}: trainer.json unreadable after verification ({got['error']})")
        return got["json"]
