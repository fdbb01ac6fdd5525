"""Every causal-LM model type the installed transformers registers, under Ulysses SP=2: parity with the plain
model or a one-line refusal at start-up, never a traceback and never a silently wrong loss.

Each decoder-only text type gets a tiny random config (bench/model_sweep.tiny_config: hidden 128, 2 layers, 4
heads / 2 KV heads where the config has them, the family's MoE / latent-attention / window fields small, peaked
weights initializer_range 0.3) and goes, with every other type, through ONE 2-rank launch of
tests/workers/model_sweep.py (a launch costs ~15 s; one per type would add minutes): the start-up checks
(`families.check_config`, `check_layout`), then one step of the real engine (ZeRO-3 + CPU offload, fp32) on two
packed samples of documents, then `check_routed`. A type passes when

- the start-up refused it in one line (ValueError: train.py exits 2 before any weight is read), or
- its loss is the plain single-process HF model's on each document alone within 1e-5 (relative), and its
  ZeRO-3 full gradients within 1e-4 (sdpa, and GPT-OSS's sinks path; flex_attention has no backward on CPU, so
  loss only).

A crash in the step, a refusal after the step, or a wrong loss fails the type's row. Multimodal,
encoder-decoder and BERT-style encoder types are skipped with the reason, as are the types whose tiny config
transformers cannot build (the reason is the build error). The full sweep is slow; FAST, a handful of
representative types, runs in `make test` in its own launch. A complete sweep writes
bench/results/model_sweep.json, which `python -m bench.model_sweep` renders into docs/models.md.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench.model_sweep import MAX_PARAMS, classify, param_count, tiny_config
from tests.distributed import ROOT, run
from tests.multiproc.test_doc_masking import GRAD_TOL, LOSS_TOL, SEQ, packed, rel, write_documents
from tests.multiproc.test_model_zoo import reference

SP = 2
SAMPLES = [0, 1]
# windows (OLMo-3), linear-attention hybrid (Qwen3.5), no sdpa (Bloom: the refusal): what test_model_zoo.py's fast
# launch does not run. Dense (llama), MoE under ZeRO-3 (qwen3_moe), latent attention (deepseek_v3) and attention sinks
# (gpt_oss) run in the slow sweep here; their parity at SP=2 stays fast in
# test_model_zoo.py::test_family_matches_plain_model_at_sp2 (llama3, qwen3_moe, deepseek_v3, gpt_oss).
FAST = ["olmo3", "qwen3_5_text", "bloom"]


def _all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


ALL = _all_types()
REST = [t for t in ALL if t not in FAST]
_LAUNCHES: dict = {}
_TABLE: dict = {}


def _attn(config) -> str:
    """The backend a user picks: sdpa where transformers has it, else flex_attention (the refusal's own hint);
    sdpa again where neither exists, which the start-up refuses."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not getattr(cls, "_supports_sdpa", False) and getattr(cls, "_supports_flex_attn", False):
        return "flex_attention"
    return "sdpa"


def _prepare(model_type: str, folder: str) -> dict:
    """The type's row before the launch: skipped (with why), or its saved tiny model and backend."""
    from transformers import AutoModelForCausalLM

    try:
        why = classify(model_type)
    except Exception as err:  # noqa: BLE001 - the family's default config itself does not build
        why = f"no default config: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    if why:
        return {"status": "skipped", "detail": why}
    try:
        config = tiny_config(model_type)
        n = param_count(config)
        if n > MAX_PARAMS:
            return {"status": "skipped", "detail": f"no tiny config: {n / 1e6:.0f}M parameters at the small sizes "
                                                   "(fixed-size fields the generic sizes do not reach)"}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model(input_ids=torch.randint(4, 2048, (1, 16)), use_cache=False)  # the plain model runs at all
        model.save_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - a family-specific field the generic sizes cannot satisfy
        line = (str(err).strip().splitlines() or [""])[-1][:160]
        return {"status": "skipped", "detail": f"no tiny config: {type(err).__name__}: {line}"}
    # gradients wherever the step has a CPU backward: sdpa, and flex_attention with learned sinks (GPT-OSS), whose
    # document-masked path runs sdpa pieces on CPU (model_utils/sinks.sink_sdpa)
    from model_utils.sinks import SINKS_COVERED

    attn = _attn(config)
    grads = attn == "sdpa" or config.get_text_config().model_type in SINKS_COVERED
    return {"status": "built", "path": folder, "attn": attn, "grads": grads}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    yield {"data": write_documents(d / "docs.jsonl"), "dir": str(d)}
    if set(_TABLE) == set(ALL):  # a complete sweep: the JSON docs/models.md is rendered from
        from bench.harness import result_path, write_json

        write_json(result_path("model_sweep.json"), dict(sorted(_TABLE.items())))


def launch(types: list[str], assets) -> dict:
    """Prepare every type in `types`, run the built ones in one SP=2 launch; cached per list."""
    key = tuple(types)
    if key in _LAUNCHES:
        return _LAUNCHES[key]
    d = assets["dir"]
    rows = {t: _prepare(t, os.path.join(d, t)) for t in types}
    cases = {t: {"model_name_or_path": r["path"], "dataset_path": assets["data"], "max_seq_length": SEQ,
                 "sequence_parallel_size": SP, "per_device_train_batch_size": len(SAMPLES),
                 "attn_implementation": r["attn"], "reset_position_ids": "yes", "learning_rate": 1e-3,
                 "max_steps": 1, "report_to": "none", "seed": 0,
                 "deepspeed": os.path.join(ROOT, "ds_configs/zero3_offload.json"), "samples": SAMPLES,
                 "grads": r["grads"], "bypass": False, "out": os.path.join(d, f"{t}.pt"),
                 "cache": os.path.join(d, "cache")}
             for t, r in rows.items() if r["status"] == "built"}
    todo = list(cases)
    while todo:  # normally one launch; a case that kills it (a rank-asymmetric crash) is recorded, the rest rerun
        logs = os.path.join(d, f"logs_{len(_LAUNCHES)}_{len(todo)}")
        codes = run(os.path.join(ROOT, "tests/workers/model_sweep.py"), [json.dumps([cases[t] for t in todo])], SP,
                    logs, timeout=60 + 20 * len(todo), expect=None)
        done = [t for t in todo if os.path.exists(cases[t]["out"] + ".json")]
        if len(done) < len(todo):
            dead = todo[len(done)]
            with open(os.path.join(logs, "rank0.log")) as fh:
                last = [ln for ln in fh.read().splitlines() if ln.strip()][-1:] or [""]
            with open(cases[dead]["out"] + ".json", "w") as fh:
                json.dump({"status": "crash", "detail": f"the launch died (exit codes {codes}): {last[0][:300]}"}, fh)
        todo = todo[len(done) + 1:] if len(done) < len(todo) else []
    for t, c in cases.items():
        with open(c["out"] + ".json") as fh:
            rows[t].update(json.load(fh))
        if rows[t]["status"] == "ran":
            rows[t]["result"] = torch.load(c["out"])
    _LAUNCHES[key] = rows
    return rows


def check(model_type: str, row: dict, assets) -> None:
    """The type's verdict: parity, a start-up refusal or a skip pass (and go in the table); anything else fails."""
    entry = {"status": row["status"], "attn": row.get("attn", ""), "detail": row.get("detail", "")}
    if row["status"] == "ran":
        res = row["result"]
        samples = packed(assets, SAMPLES)
        ref_loss, ref_grads = reference(row["path"], samples, "sdpa" if row["attn"] == "sdpa" else "eager")
        loss_err = abs(res["loss"] - ref_loss) / ref_loss
        # a parameter the step does not reach (an expert no token chose) has no gradient in either run
        reached = [n for n, g in ref_grads.items() if g is not None]
        worst = max(rel(res["grads"][n], ref_grads[n]) if n in res["grads"] else float("inf")
                    for n in reached) if res["grads"] else None
        ok = res["error"] is None and loss_err < LOSS_TOL and (worst is None or worst < GRAD_TOL)
        what = f"loss rel err {loss_err:.1e}" + (f", grads {worst:.1e}" if worst is not None else " (forward only)")
        if res["error"] is not None:  # check_routed after the first step: not before any heavy work
            entry.update(status="refused late", detail=res["error"])
        else:
            entry.update(status="parity" if ok else "wrong loss", detail=what)
    _TABLE[model_type] = entry
    print(f"SWEEP {model_type}: {entry['status']} [{entry['attn']}] {entry['detail'][:200]}")
    assert entry["status"] in ("parity", "refused", "skipped"), (model_type, entry)
    if entry["status"] == "refused":
        assert "\n" not in entry["detail"] and entry["detail"], (model_type, entry)


@pytest.mark.dist
@pytest.mark.parametrize("model_type", FAST)
def test_representative_types_train_or_are_refused(assets, model_type):
    check(model_type, launch(FAST, assets)[model_type], assets)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model_type", REST)
def test_every_registered_type_trains_or_is_refused(assets, model_type):
    check(model_type, launch(REST, assets)[model_type], assets)


def test_the_sweep_covers_text_decoders_and_skips_the_rest():
    """The catalog can fail: Llama is swept, BART (encoder-decoder), Gemma-3 (multimodal) and BERT are skipped."""
    assert classify("llama") is None and classify("deepseek_v3") is None
    assert classify("bart") == "encoder-decoder"
    assert classify("gemma3").startswith("multimodal")
    assert classify("bert").startswith("encoder")
    config = tiny_config("deepseek_v3")
    assert (config.hidden_size, config.num_hidden_layers, config.kv_lora_rank) == (128, 2, 32)


@pytest.mark.parametrize("model_type,attn,line", [
    ("flint", "flex_attention", r"^FlintForCausalLM \(flint\): learned attention sinks are not supported under "
                                r"sequence parallelism for this architecture yet \(only gpt_oss\)"),
    ("granite_swa", "flex_attention", r"^GraniteSWAForCausalLM \(granite_swa\): learned attention sinks are not"),
    ("gpt_oss", "flash_attention_2", r"^GptOssForCausalLM \(gpt_oss\): learned attention sinks with flash_attention_2"),
])
def test_sinks_are_refused_in_one_line(model_type, attn, line):
    """What the sweep relies on for these families, from the config alone (train.py's start-up): sinks of the
    architectures not checked against their plain model, and flash-attention (its kernels here drop the sinks)."""
    from model_utils.families import check_config

    with pytest.raises(ValueError, match=line):
        check_config(tiny_config(model_type), attn)


def test_latent_attention_passes_the_start_up_unless_v_is_wider():
    """MLA (q/k head dim 24, v 16, `head_dim` 8: RoPE's) is carried by ulysses.py with v padded to 24; a v head dim
    above the q/k one cannot be padded down and stays refused in one line."""
    from model_utils.families import check_config, latent_dims

    for model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        config = tiny_config(model_type)
        check_config(config, "sdpa")
        assert latent_dims(config) == ((24, 16) if model_type != "glm4_moe_lite" else (24, 24)), model_type
    assert latent_dims(tiny_config("llama")) is None
    wide = tiny_config("deepseek_v3")
    wide.v_head_dim = 32
    with pytest.raises(ValueError, match=r"^DeepseekV3ForCausalLM \(deepseek_v3\): latent attention with a v head "
                                         r"dim \(32\) above the q/k head dim \(24\)"):
        check_config(wide, "sdpa")
