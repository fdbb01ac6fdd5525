"""Convert a saved run (or one checkpoint) to a Hugging Face folder loadable by AutoModelForCausalLM.

    python scripts/export_hf.py checkpoints/RUN [--checkpoint CKPT] [--out DIR] [--dtype auto|bf16|fp32]
                                [--tokenizer PATH|none] [--source PATH|none]
    python scripts/export_hf.py checkpoints/RUN/checkpoints/step_000300     # one checkpoint, as evaluate.py takes it

CKPT: a checkpoint folder (checkpoints/RUN/checkpoints/step_000300) or a stage's marker
(checkpoints/RUN/checkpoints/STAGE_1_s512: the model as that stage ended). --out defaults to RUN/hf_model
(RUN/hf_model_<step> for a checkpoint older than the run's newest); another folder that exists is replaced only when
it is a previous export (model_utils/export_target.check_out). --dtype: the weights on disk; auto (the default, as train.py's
own export) is the run's training precision: bf16 for a bf16 run (as save_pretrained of a bf16 model writes; half the
size), fp32 to keep the fp32 master weights exactly. --tokenizer / --source: where the run's tokenizer / the model it
started from (its generation_config.json is copied) are now, when the paths the checkpoint recorded no longer exist
(refused in one line otherwise); `none` exports without it. The tokenizer (recorded or given) must be the vocabulary
the run trained on (trainer.json's tokenizer_vocab, or the same tokens by id: tokenizer_pieces; another revision at the
recorded path is refused in one line).
"""

from __future__ import annotations

import argparse
import os
import sys

from data.chat_stops import reply_stops
from data.run_tokenizer import check_trained_vocab
from model_utils.export import check_recorded, export_hf
from training import rotation
from training.checkpoint import MANIFEST, Checkpointer
from training.checkpoint_files import manifest_sha256
from training.job import disk_full, disk_full_line

RUN: list[str] = []  # the run folder main() was given: a relative --checkpoint is found there too


def named(path: str) -> str:
    """A stage marker (STAGE_<i>_<name>, a file naming its checkpoint) -> that checkpoint's folder; else `path`. A
    relative `path` not found from here is looked for under the run folder, then its checkpoints/ folder (`--checkpoint
    checkpoints/STAGE_1_s512`, as docs/checkpoints.md writes it, or `step_000009`, `STAGE_1_s512` as the run names them)."""
    if not os.path.exists(path) and not os.path.isabs(path) and RUN:
        path = next((p for p in (os.path.join(RUN[0], path), os.path.join(RUN[0], "checkpoints", path))
                     if os.path.exists(p)), path)
    if os.path.isfile(path) and os.path.basename(path).startswith("STAGE_"):
        with open(path) as fh:
            return os.path.join(os.path.dirname(path), fh.read().strip())
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder or a STAGE_* marker (default: newest valid)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/hf_model for the run's newest checkpoint, "
                   "RUN/hf_model_<step> for an older one)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="the weights' dtype on disk (default auto: the run's training precision, bf16 for a bf16 run; "
                   "fp32: the fp32 master weights, twice the size)")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer folder or .model file where it is now "
                   "(default: the path the checkpoint recorded); none: export without a tokenizer")
    p.add_argument("--source", default=None, help="the model the run started from, where it is now (default: its "
                   "--model_name_or_path); none: export without its generation_config.json")
    a = p.parse_args(argv)
    first = a.run_dir.rstrip("/")
    if os.path.isfile(os.path.join(first, MANIFEST)) or os.path.basename(first).startswith("STAGE_"):
        if a.checkpoint:  # a checkpoint (or a stage's marker) named first: its run is two folders up
            print(f"error: {a.run_dir} is a checkpoint and --checkpoint names another: give one", file=sys.stderr)
            return 2
        a.checkpoint, a.run_dir = a.run_dir, os.path.dirname(os.path.dirname(os.path.abspath(first)))
    RUN[:] = [a.run_dir]
    ckpt = Checkpointer(a.run_dir, keep=2)
    # find_resume verifies what it returns (every byte's CRC, Adam's moments included: ~96 GB at Llama-3-8B on 32
    # ranks): the export does not read it all again
    path = named(a.checkpoint) if a.checkpoint else ckpt.find_resume("auto")
    try:
        return _export(a, ckpt, path, verified=not a.checkpoint)
    except OSError:  # its folder gone while it was read: the running job's rotation moved it into checkpoints/.trash
        if not path or os.path.isdir(path):
            raise
        print(f"error: {os.path.basename(path.rstrip('/'))} was rotated away by the running job while it was read "
              "(--save_total_limit): export a newer one, or copy it first", file=sys.stderr)
        return 2


def _export(a: argparse.Namespace, ckpt: Checkpointer, path: str | None, verified: bool = False) -> int:
    """Verify (unless `verified`: find_resume's answer) and export the checkpoint at `path` (None: the run has none);
    OSError where its folder went meanwhile."""
    gone = "no such folder" if path and not os.path.isdir(path) else None
    why = gone or (ckpt.verify(path) if path and not verified else None)
    if why and not gone and not os.path.isdir(path):  # there when verification started ("missing FILE"), gone now
        raise FileNotFoundError(path)
    if a.checkpoint and why:  # the checkpoint named, and why it is not one (not a message about the run folder)
        print(f"error: --checkpoint {a.checkpoint}: not a complete checkpoint ({why})", file=sys.stderr)
        return 2
    if path is None or why:
        print(f"error: no complete checkpoint under {a.run_dir}/checkpoints", file=sys.stderr)
        return 2
    trainer = Checkpointer.read_trainer(path)
    # the run's hf_model is its newest checkpoint's export (evaluate.py, a user, train.py's own end read it so): an
    # older one goes to hf_model_<tag> unless --out says (it replaced hf_model, evaluations then scored the old model)
    tag = os.path.basename(os.path.realpath(path.rstrip("/")))
    # the run's newest: find_resume's answer (`verified`), else the newest committed (a manifest) of its listing, never
    # LATEST as written (a kill between a commit's manifest and its pointers left it on the one before: the newest went
    # to hf_model_<tag>). One stat per listed checkpoint; no verification (the one exported was verified above)
    root = os.path.join(a.run_dir, "checkpoints")
    newest = tag if verified else next((t for t in reversed(rotation.tags(root))
                                        if os.path.isfile(os.path.join(root, t, MANIFEST))), tag)
    same = lambda x, y: os.path.realpath(x) == os.path.realpath(y)  # noqa: E731
    default = os.path.join(a.run_dir, "hf_model" if newest == tag else f"hf_model_{tag}")
    # the run's own hf_model: the default out of a checkpoint in the run's checkpoints/ folder
    owned = same(a.out or default, default) and same(os.path.dirname(path.rstrip("/")),
                                                     os.path.join(a.run_dir, "checkpoints"))
    cfg = trainer.get("config") or {}
    given = lambda flag, recorded: recorded if flag is None else None if flag == "none" else flag  # noqa: E731
    tok, source = given(a.tokenizer, trainer.get("tokenizer")), given(a.source, cfg.get("model_name_or_path"))
    # the chat template the rows were rendered with (a checkpoint before 2026-11-30: the tokenizer's own is written)
    template = trainer.get("trained_template")
    try:
        check_recorded(tok, source)  # before reply_stops reads the tokenizer
        # the same files as it trained with, as a resume checks: another revision at the recorded path (a new
        # cluster's /models) was exported beside these weights, its ids other tokens
        check_trained_vocab(tok, trainer, path, a.tokenizer is not None,
                            ", or --tokenizer none to export without one")
        if "reply_stops" in trainer:  # a chat SFT's end-of-turn, as the run read it (train.py's export adds the same)
            stops = trainer["reply_stops"]
        else:  # a checkpoint from before they were recorded: an SFT run's, through the template's default
            sft = cfg.get("data_kind") == "sft" or any((s or {}).get("kind") == "sft" for s in cfg.get("stages") or [])
            stops = reply_stops(tok) if sft else None
        out = export_hf(path, a.out or default, tok, source=source,
                        owned=owned, stops=stops, identity=manifest_sha256(path), template=template, dtype=a.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the export's folder on a full disk or quota (model_utils/export.disk_named names it): the
        full = disk_full(e)  # user's, one line and exit 2, not a traceback (exit 1); a write naming nothing is not
        if full is None or not full.filename:  # known to be the export's (training/job.users_disk's rule)
            raise
        print(f"error: {disk_full_line(full, '--out', 'then run this export again')}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
