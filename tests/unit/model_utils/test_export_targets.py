"""Where model_utils/export.export_hf may write, and what it keeps in fp32, from a fake ZeRO checkpoint (the
consolidation patched to return a tiny model's state dict): a symlinked RUN/hf_model (or --out) pointing at a folder of
other work is refused in one line before any work, train.py's own export included (it wiped the folder); a link to a
missing or empty folder is written there; an unwritable folder beside the target is refused before the consolidation;
the model class's `_keep_in_fp32_modules_strict` (GLM-4.5's router bias) stays fp32 in a bf16 export, as
save_pretrained writes it. ~5 s."""

from __future__ import annotations

import os

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _checkpoint(tmp_path, monkeypatch, config, model=None) -> str:
    """A checkpoint folder whose consolidation returns `model`'s state dict (None: fails the test if called)."""
    import deepspeed.utils.zero_to_fp32 as z

    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "hf_config.json").write_text(config.to_json_string())
    state = model and {k: v.detach().clone() for k, v in model.state_dict().items()}

    def consolidate(root, tag):
        assert state is not None, "the consolidation ran"
        return dict(state)

    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", consolidate)
    return str(ck)


def _llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **TINY)
    return config, AutoModelForCausalLM.from_config(config)


def test_a_link_to_a_folder_of_other_work_is_refused_before_any_work(tmp_path, monkeypatch):
    """RUN/hf_model linked to a scratch folder holding other projects: train.py's export (owned) resolved the link and
    rmtree'd the target, the other projects with it."""
    from model_utils.export import export_hf
    from model_utils.export_target import check_out

    config, _ = _llama()
    ck = _checkpoint(tmp_path, monkeypatch, config)  # no state: the consolidation must not run
    scratch = tmp_path / "scratch"
    (scratch / "other_project").mkdir(parents=True)
    (scratch / "other_project" / "results.csv").write_text("precious")
    link = tmp_path / "run" / "hf_model"
    link.symlink_to(scratch)
    for call in (lambda: export_hf(ck, str(link), owned=True), lambda: export_hf(ck, str(link)),
                 lambda: check_out(str(link), None, owned=True)):  # the last: train.py's start-up form
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(link) in msg and str(scratch) in msg and "point the link" in msg
    assert (scratch / "other_project" / "results.csv").read_text() == "precious"
    (tmp_path / "a_file").write_text("notes")
    link.unlink()
    link.symlink_to(tmp_path / "a_file")
    with pytest.raises(ValueError, match="a file"):
        check_out(str(link), ck, owned=True)
    assert (tmp_path / "a_file").read_text() == "notes"


@pytest.mark.parametrize("target", ["missing", "empty"])
def test_a_link_to_a_missing_or_empty_folder_is_written_there(tmp_path, monkeypatch, target):
    from model_utils.export import export_hf
    from model_utils.export_target import MARKER

    config, model = _llama()
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    dest = tmp_path / "scratch" / "hf_model"
    dest.parent.mkdir()
    if target == "empty":
        dest.mkdir()
    link = tmp_path / "run" / "hf_model"
    link.symlink_to(dest)
    assert export_hf(ck, str(link), owned=True) == str(link)
    assert link.is_symlink() and (dest / "model.safetensors").is_file() and (dest / MARKER).is_file()
    export_hf(ck, str(link), owned=True)  # again: now a previous export
    assert sorted(os.listdir(dest.parent)) == ["hf_model"]


def test_a_copied_runs_link_never_replaces_the_original_runs_export(tmp_path, monkeypatch):
    """A run folder copied with its absolute hf_model link (cp -a, rsync -l): the copy's export replaced the original
    run's model where the link points (any previous export was replaceable). Refused in one line now, at the copy's
    start-up check too; the original run, and a run folder moved since (its recorded checkpoint gone, the same one
    here by content), still replace their own, and a moved finished run's export is still its current one."""
    import hashlib
    import shutil

    from model_utils.export import export_hf
    from model_utils.export_target import MARKER, check_out, exported_from, is_export_of

    config, model = _llama()
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    (tmp_path / "run" / "checkpoints" / "step_000002" / "MANIFEST.json").write_text('{"files": {}}')
    sha = hashlib.sha256(b'{"files": {}}').hexdigest()
    dest = tmp_path / "models" / "run_model"
    dest.parent.mkdir()
    (tmp_path / "run" / "hf_model").symlink_to(dest)
    export_hf(ck, str(tmp_path / "run" / "hf_model"), owned=True, identity=sha)
    export_hf(ck, str(tmp_path / "run" / "hf_model"), owned=True, identity=sha)  # the run's own: replaced
    shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=True)
    link, copied = tmp_path / "copy" / "hf_model", str(tmp_path / "copy" / "checkpoints" / "step_000002")
    for call in (lambda: export_hf(copied, str(link), owned=True, identity=sha),
                 lambda: check_out(str(link), None, owned=True)):  # the last: train.py's start-up form
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(link) in msg and "the run this folder was copied from" in msg, msg
        assert "remove the link" in msg and "point --out elsewhere" in msg
    assert exported_from(str(dest)) == (ck, sha) and (dest / MARKER).is_file()
    shutil.rmtree(tmp_path / "copy")
    # a link on purpose to another run's export (a served `current`): another run's checkpoints, not a copy's: passes
    (tmp_path / "other" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "other" / "checkpoints" / "step_000002" / "MANIFEST.json").write_text('{"files": {"x": 1}}')
    (tmp_path / "other" / "hf_model").symlink_to(dest)
    check_out(str(tmp_path / "other" / "hf_model"), None, owned=True)
    (tmp_path / "latest").symlink_to(dest)
    check_out(str(tmp_path / "latest"), str(tmp_path / "other" / "checkpoints" / "step_000002"))
    shutil.move(str(tmp_path / "run"), str(tmp_path / "moved"))  # a move (or a re-mount): its own export still
    moved = str(tmp_path / "moved" / "checkpoints" / "step_000002")
    # train.py's check of a finished run started again: current by content (by path it exported again: minutes at 8B)
    assert is_export_of(str(tmp_path / "moved" / "hf_model"), sha) and exported_from(str(dest))[0] != moved
    assert not is_export_of(str(tmp_path / "moved" / "hf_model"), "another") and not is_export_of(str(dest), None)
    export_hf(moved, str(tmp_path / "moved" / "hf_model"), owned=True, identity=sha)
    assert exported_from(str(dest)) == (moved, sha)


def test_an_unwritable_folder_beside_the_target_is_refused_before_the_consolidation(tmp_path, monkeypatch):
    """The export is built in TARGET.export-tmp and swapped in (os.replace: one file system): a link to a folder whose
    parent the user cannot write (a mount point) failed after the consolidation."""
    from model_utils import export

    config, _ = _llama()
    ck = _checkpoint(tmp_path, monkeypatch, config)
    dest = tmp_path / "mnt" / "disk"
    dest.mkdir(parents=True)
    link = tmp_path / "run" / "hf_model"
    link.symlink_to(dest)
    access = os.access
    monkeypatch.setattr(export.os, "access", lambda p, mode: access(p, mode) and p != str(dest.parent))  # root
    with pytest.raises(ValueError) as e:  # writes anywhere: chmod would not show it
        export.export_hf(ck, str(link), owned=True)
    assert len(str(e.value).splitlines()) == 1 and f"in {dest.parent}, which is not writable" in str(e.value)


def test_a_bf16_export_keeps_what_the_class_keeps_in_fp32(tmp_path, monkeypatch):
    """GLM-4.5 (glm4_moe): `e_score_correction_bias` is `_keep_in_fp32_modules_strict`; save_pretrained of a bf16
    model writes it fp32, the export wrote it bf16 (1.0 + 0.01 x noise rounded to steps of 2^-7: the routing bias
    flattened)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.export import export_hf

    config = AutoConfig.for_model("glm4_moe", **TINY, moe_intermediate_size=32, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for n, b in model.named_buffers():
        if "e_score_correction_bias" in n:
            b.copy_(torch.randn_like(b) * 0.01 + 1.0)
    base = tmp_path / "base"
    model.save_pretrained(base)
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(tmp_path / "base_bf16")
    ck = _checkpoint(tmp_path, monkeypatch, config, model)
    out = tmp_path / "run" / "hf_model"
    export_hf(ck, str(out), source=str(base), owned=True, dtype="bf16")

    def dtypes(folder):
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}

    got, want = dtypes(out), dtypes(tmp_path / "base_bf16")
    assert got == want and got["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        kept = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert torch.equal(kept, model.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_fp16_also_keeps_the_classs_fp16_only_modules():
    """gpt-oss keeps its norms in fp32 when loaded in fp16 (`_keep_in_fp32_modules`), not in bf16."""
    from transformers import AutoConfig

    from model_utils.export import kept_in_fp32, meta_model

    model = meta_model(AutoConfig.for_model("gpt_oss", **TINY, num_local_experts=4, num_experts_per_tok=2,
                                            layer_types=["sliding_attention", "full_attention"]))
    name = "model.layers.0.input_layernorm.weight"
    assert kept_in_fp32(model, "float16").search(name) and not (kept_in_fp32(model, "bfloat16") or
                                                                 kept_in_fp32(model, "float32"))
