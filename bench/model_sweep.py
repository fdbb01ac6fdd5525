"""Every causal-LM model type the installed transformers registers, as a tiny config: which are swept under
sequence parallelism (decoder-only text models), which are skipped and why, and docs/models.md rendered from
the sweep's JSON (tests/multiproc/test_model_sweep.py writes it).

    python -m bench.model_sweep --render bench/results/model_sweep.json   # -> docs/models.md

The sweep itself (tests/multiproc/test_model_sweep.py, worker tests/workers/model_sweep.py) runs every swept type
at SP=2 on 2 ranks (ZeRO-3 + CPU offload, fp32) in one launch and requires parity with the plain model or a
one-line refusal. This module imports no torch at import time (the catalog is cheap to list).
"""

from __future__ import annotations

import argparse
import os
import sys

from base.atomic import atomic_write
from bench.harness import ROOT, read_json
from planner.shapes import HEAD_CHUNK_MODEL_TYPES

# the sizes every tiny config gets, where the config has the field (hidden 128, 2 layers, 4 heads, 2 KV heads)
SMALL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)
# family-specific sizes, applied only where the config class has the field: MoE experts, latent attention (MLA)
# ranks and head dims, sliding windows smaller than a shard, linear-attention / SSM widths
FAMILY = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              n_shared_experts=1, shared_expert_intermediate_size=64, n_group=1, topk_group=1, first_k_dense_replace=1,
              kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              sliding_window=16, max_position_embeddings=4096, n_positions=4096, max_window_layers=1,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              mamba_d_state=16, mamba_n_heads=8, mamba_d_head=32, state_size=16, expand=2, num_heads=8,
              rotary_dim=16,
              global_attn_every_n_layers=2)
MAX_PARAMS = 20_000_000  # a config that ignores the small sizes (fixed vocabularies, wide defaults) is not "tiny"


def classify(model_type: str) -> str | None:
    """Why `model_type` is not swept (multimodal, encoder-decoder, BERT-style encoder), or None. BERT-style: the
    type has a masked-LM head in transformers (it used to be any config declaring add_cross_attention / is_decoder,
    which skipped decoders such as gpt2, gpt_neox and gpt_bigcode as "encoders": they are swept, and refused)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder"
    subs = [k for k in ("vision_config", "audio_config", "text_config", "decoder") if getattr(cfg, k, None) is not None]
    if subs:
        return f"multimodal or composite ({', '.join(subs)}); its text model type is swept where registered"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder (bidirectional, BERT-style; causal only as a decoder head)"
    return None


def tiny_config(model_type: str):
    """AutoConfig.for_model with SMALL and the FAMILY fields this config class has."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    fields = {**{k: v for k, v in SMALL.items() if hasattr(default, k)},  # a field the class lacks is not read
              **{k: v for k, v in FAMILY.items() if hasattr(default, k) and getattr(default, k) is not None}}
    # training-mode randomness (dropout, router jitter: Seed-OSS, PhiMoE) would differ from the plain model in eval
    fields.update({k: 0.0 for k, v in default.to_dict().items() if isinstance(v, float) and v > 0
                   and any(w in k for w in ("dropout", "jitter", "noise"))})
    if hasattr(default, "qk_rope_head_dim"):  # latent attention: head_dim is the RoPE part's, one KV head per head
        fields.pop("head_dim")
        fields["num_key_value_heads"] = fields["num_attention_heads"]
        if default.v_head_dim == default.qk_nope_head_dim + default.qk_rope_head_dim:  # GLM-4.7-Flash: one head dim
            fields["v_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    if getattr(default, "layer_types", None):  # keep the family's pattern over 2 layers (one of each kind)
        kinds = list(dict.fromkeys(default.layer_types))
        fields["layer_types"] = (kinds * 2)[:2]
    for _ in range(len(fields)):
        try:
            return AutoConfig.for_model(model_type, **fields)
        except AttributeError as err:  # a derived field (a property without setter): let the family derive it
            name = str(err).split("'")[1] if "'" in str(err) else None
            if name not in fields:
                raise
            fields.pop(name)
        except Exception:
            if "layer_types" not in fields:  # a config that derives its layer types from other fields
                raise
            fields.pop("layer_types")
    return AutoConfig.for_model(model_type, **fields)


def param_count(config) -> int:
    """Parameters of the causal LM built from `config`, counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def render(results: dict) -> str:
    """docs/models.md from the sweep's JSON: {model_type: {status, detail, ...}}."""
    import transformers

    order = {"parity": 0, "refused": 1, "skipped": 2}
    rows = sorted(results.items(), key=lambda kv: (order.get(kv[1]["status"], 3), kv[0]))
    count = {s: sum(r["status"] == s for r in results.values()) for s in order}
    lines = ["# Supported models", "",
             "Generated by `python -m bench.model_sweep --render bench/results/model_sweep.json` from the output of "
             "`tests/multiproc/test_model_sweep.py` (do not edit by hand).", "",
             f"Every causal-LM model type that transformers {transformers.__version__} registers "
             f"({len(results)}), as a tiny random config (hidden 128, 2 layers, 4 heads / 2 KV heads where the config "
             "has them, peaked weights), run at Ulysses SP=2 on 2 ranks (ZeRO-3 + CPU offload, fp32) on packed "
             "documents through the start-up checks and one training step:", "",
             f"- **parity** ({count['parity']}): the loss (and gradients where listed) matches the plain "
             "single-process Hugging Face model run on each document alone;",
             f"- **refused** ({count['refused']}): the start-up stops it with one line (exit 2) naming why;",
             f"- **skipped** ({count['skipped']}): not a decoder-only text model, or no tiny config could be built.",
             "", "A real checkpoint of a listed type can still differ from its tiny config (other options of the same "
             "config class); the start-up checks read the real config. Options refused there whatever the type: "
             "`use_bidirectional_attention: true` or `is_causal: false` (documents are masked causally). "
             "Mixture-of-experts models: the router's load-balancing (aux) loss is not trained here (the loss is "
             "the logits' cross-entropy, `router_aux_loss_coef` is unused), which every MoE start says in one "
             'note; `output_router_logits: true` (tencent/Hy3 ships it) is turned off (the router logits would '
             "cost every layer's [tokens, experts]). `tiled_mlp` (a flag or a stage's `memory_features`) is "
             'refused at start-up for an MoE (its expert blocks are no token-wise MLP to tile) and for LFM2 (its '
             'MLP is `feed_forward`), and `memory_features: auto` never picks it there; any other dense MLP tiles '
             "(Phi-3's fused gate_up_proj too). The planner reads each family's expert keys (ERNIE-4.5's "
             "`moe_num_experts` / `moe_k` / `moe_layer_start_index`, Hunyuan's `moe_topk`, Qwen2-MoE's "
             "`shared_expert_intermediate_size`, GraniteMoeShared's `shared_intermediate_size`; "
             'tests/unit/planner/test_moe_shapes.py checks its parameter count against the built model) and '
             'refuses an MoE config that names no top-k.', "",
             'Model folders refused at start-up whatever the type, in one line before any data or weight is read: '
             "quantized weights (`quantization_config` in config.json: they would load outside ZeRO-3's partitioning, "
             'FP8 layers give no weight gradient): fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3/R1) and MXFP4 (gpt-oss '
             'as OpenAI ships it) become a dense bf16 folder once with `python scripts/dequantize.py --model <folder '
             'or hub id> --output <dir>` (one CPU process holding the whole model in bf16: gpt-oss-20b ~42 GB of host '
             'memory, gpt-oss-120b ~234 GB), other methods (bitsandbytes, GPTQ, AWQ, compressed-tensors) need the '
             "model's unquantized release; a local folder whose weight file or an index's shard is missing; custom "
             'code (`auto_map` with a model_type transformers lacks: trust_remote_code is never on); a PEFT adapter '
             '(merge it first: `merge_and_unload()`, `save_pretrained`). When the weights load, any tensor the model '
             'needs that the files lack (a `tie_word_embeddings` changed to false, names saved with a `_orig_mod.` / '
             '`module.` prefix, `num_hidden_layers` above the saved layers) is refused instead of training from random '
             'init; extra tensors the class does not use (multi-token-prediction layers) are accepted.', "",
             "`attention_head_chunks` > 1 (docs/attention.md) runs only for the types checked chunked against the "
             "unchunked model (2 chunks, loss and gradients; `planner.shapes.HEAD_CHUNK_MODEL_TYPES`): "
             f"{', '.join(f'`{t}`' for t in sorted(HEAD_CHUNK_MODEL_TYPES))}. For any other type `auto` keeps 1 and "
             "an explicit count is refused at start-up with the reason (q/k norms over all heads: OLMo-2/3, OLMoE, "
             "FlexOlmo, MiniMax-M2; output gates or norms over all heads: AFMoE, Laguna, BitNet; fused qkv: Phi, "
             "Phi-3; linear-attention layers: Qwen3-Next / Qwen3.5; latent attention; sinks; Cohere's "
             "`use_qk_norm`).", "",
             "| model type | status | attention | detail |", "|---|---|---|---|"]
    for mt, r in rows:
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{mt}` | {r['status']} | {r.get('attn', '')} | {detail} |")
    return "\n".join(lines) + "\n"


def read_sweep(path: str) -> dict:
    """The sweep's JSON ({model_type: {status, ...}}); ValueError (one line) for anything else: {} or a list would
    render docs/models.md as an empty table."""
    results = read_json(path, "--render", "give bench/results/model_sweep.json (tests/multiproc/test_model_sweep.py "
                        "writes it)")
    if not (isinstance(results, dict) and results
            and all(isinstance(r, dict) and isinstance(r.get("status"), str) for r in results.values())):
        raise ValueError(f"--render {path}: not a model sweep ({{model_type: {{status: parity, ...}}}}, at least one "
                         "type): give bench/results/model_sweep.json")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", default=os.path.join(ROOT, "bench", "results", "model_sweep.json"),
                    help="the sweep's JSON (tests/multiproc/test_model_sweep.py writes it)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "models.md"))
    args = ap.parse_args(argv)
    results = read_sweep(args.render)
    atomic_write(args.out, render(results).encode())  # the whole page or the old one, never a torn one
    print(f"wrote {args.out} ({len(results)} model types)")
    return 0


if __name__ == "__main__":
    from base.exits import EXIT_USAGE

    try:
        sys.exit(main())
    except ValueError as e:  # the user's input: one line, exit 2 as every script (base/exits.py)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
