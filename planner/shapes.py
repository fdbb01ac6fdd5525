"""Model shapes and memory features: the values the planner's models take (no torch, no transformers at
import: windowed_layers asks transformers' config class lazily, for a family whose window rule is not spelled out).

`ModelShape` is what memory and FLOPs depend on (from a preset of planner/presets.py or a config.json);
`Features` the memory features of a step, named as in training/config.py. Split out of memory_model.py so that
the attention-under-SP terms (planner/attention_sp.py) and the memory model can both import them without a cycle.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from planner.moe_keys import OTHER_MLP_NAME, moe_fields, or_default, tiled_mlp_refusal
from planner.presets import PRESETS

LOGITS_TILE_BYTES = 2**30  # tiled logits: shards of ~1 GiB of fp32 logits (ArcticTraining's rule)
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# The longest sample RoPE can position: transformers' rotary embedding (as Meta's reference and vLLM) computes
# position.float() * inv_freq in float32, exact only up to 2**24. Measured (Llama-3.1-8B's frequencies against float64):
# the relative angle of the highest-frequency dims is off by 0.06 rad at 1M, ~0.6-0.9 rad near 16M; at 19M half of
# adjacent positions share dim 0's angle. A run refuses a longer stage (model_utils/rope.check_positions), the planner
# plans none (planner/cluster.Planner.longest, planner/trainable.longest_trainable).
ROPE_MAX_POSITIONS = 2**24
# Families whose RMSNorm is Llama's formula, which model_utils/rmsnorm.py's lean RMSNorm replaces (--lean_rmsnorm)
LEAN_RMSNORM_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                                      "granite"})
# Families whose gated MLP is Llama's formula, which model_utils/mlp.py's lean MLP replaces (--lean_mlp)
LEAN_MLP_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "olmo2"})
# Families whose attention model_utils/head_chunks.py runs in chunks of heads exactly (each family built tiny and run
# in 2 chunks against the unchunked model, loss and gradients, transformers 5.23): q/k/v/o_proj Linear layers, RoPE
# the Llama way, q/k norms (where any) over head_dim only. Any other family gets attention_head_chunks 1: auto never
# offers it more, an explicit N > 1 is refused at start-up (model_utils/families.check_supported)
HEAD_CHUNK_MODEL_TYPES = frozenset({
    "apertus", "arcee", "aria_text", "cohere", "cohere2", "cohere2_moe", "cwm", "ernie4_5", "ernie4_5_moe", "exaone4",
    "exaone_moe", "gemma", "gemma3_text", "glm", "glm4", "glm4_moe", "granite", "granitemoe", "granitemoeshared",
    "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2",
    "kolibri1", "llama", "mellum", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral", "nemotron",
    "olmo", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "solar_open", "starcoder2"})
_ALL_HEADS_NORM = "normalizes q and k over all heads at once (a q/k norm of num_heads x head_dim), which a chunk cannot"
# why the families the same check found unchunkable are (the first chunked forward crashed, or install refused late)
NO_HEAD_CHUNKS = {
    **dict.fromkeys(("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2"), _ALL_HEADS_NORM),
    "stablelm": "reshapes q/k/v by the module's own head counts (and its optional q/k LayerNorm is per head over all)",
    "afmoe": "gates its output by a projection over all heads (gate_proj), which a chunk does not slice",
    "laguna": "gates its output per head by a projection over all heads (g_proj), which a chunk does not slice",
    "bitnet": "normalizes its output over all heads (attn_sub_norm) before o_proj, which a chunk cannot",
    **dict.fromkeys(("phi", "phi3", "lfm2"), "has no separate q/k/v/o_proj linear layers to slice"),
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), "has linear-attention layers, with no "
                    "self_attn module to chunk"),
    "gpt_oss": "has learned attention sinks, which head chunks do not split",
}


def head_chunks_refusal(cfg) -> str:
    """Why a model (an HF config, its text part, or a config.json dict) cannot run attention_head_chunks > 1; "" where
    it can. Config-level and torch-free: the planner offers chunks only where this is "" (ModelShape.head_chunks_ok),
    and the start-up refuses an explicit count where it is not (the first chunked forward used to crash on OLMo-2's
    norms over all heads)."""
    get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
    linear = "linear_attention" in (get("layer_types") or ())
    return family_head_chunks_refusal(str(get("model_type", "") or ""), bool(get("kv_lora_rank")), linear) or \
        _option_head_chunks_refusal(get)


def family_head_chunks_refusal(model_type: str, latent: bool = False, linear: bool = False) -> str:
    """head_chunks_refusal from the family alone (and whether it has latent attention or linear-attention layers)."""
    if latent:
        return "has latent attention (MLA): no per-head q/k/v projections to chunk"
    if model_type not in HEAD_CHUNK_MODEL_TYPES:
        return NO_HEAD_CHUNKS.get(model_type, "has an attention not checked in head chunks against the unchunked "
                                              "model (planner.shapes.HEAD_CHUNK_MODEL_TYPES lists the families that were)")
    return NO_HEAD_CHUNKS["qwen3_next"] if linear else ""


def _option_head_chunks_refusal(get) -> str:
    """The config options of a chunkable family that make it unchunkable."""
    if get("model_type") == "cohere" and get("use_qk_norm"):  # Command R+: CohereLayerNorm over [num_heads, head_dim]
        return "normalizes q and k by a per-head weight over all heads (use_qk_norm), which a chunk cannot slice"
    return ""


@dataclass(frozen=True)
class ModelShape:
    """The shapes that memory and FLOPs depend on (read from a preset or a Hugging Face config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3 has RMSNorm on q and k per head
    model_type: str = "llama"  # the HF model_type: whether the lean RMSNorm applies (LEAN_RMSNORM_MODEL_TYPES)
    # latent attention (MLA, DeepSeek-V2/V3): q/k and v head dims and the latent ranks (0: none). `head_dim` is then
    # the q/k head dim, and num_kv_heads the query heads (keys are expanded per head): what the all-to-all and the
    # core attention carry, v padded to the q/k head dim (model_utils/ulysses.py), so the attention terms hold as is.
    v_head_dim: int = 0  # 0: head_dim
    qk_rope_head_dim: int = 0  # the RoPE part of the q/k head dim (its key part is shared by all heads)
    q_lora_rank: int = 0  # 0: q projected from the hidden state directly
    kv_lora_rank: int = 0  # > 0: latent attention
    # mixture of experts (DeepSeek, Qwen-MoE, Mixtral): routed experts of moe_intermediate_size, `experts_per_token`
    # of them active, `shared_experts` always active (shared_intermediate_size wide in all; 0: shared_experts x
    # moe_intermediate_size), `dense_layers` of the layers a dense MLP of intermediate_size (from_config: moe_fields)
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate_size: int = 0
    dense_layers: int = 0
    shared_intermediate_size: int = 0
    # gated delta-net linear attention (Qwen3-Next, Qwen3.5: model_utils/linear_attention.py): how many layers are
    # linear, their q/k and v heads and head dims (0: none). Planner terms: planner.memory_model.linear_attention_bytes
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    # a config option that makes a chunkable family unchunkable (Cohere's use_qk_norm): why; "": none
    head_chunks_option: str = ""
    # sliding-window attention (gpt-oss, Mistral v0.1, Gemma-2/3's local layers, Qwen2/3 with use_sliding_window): the
    # window (keys per query, the query's own included: transformers' kv > q - window) and the layers that use it
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()

    @property
    def no_head_chunks(self) -> str:
        """Why attention_head_chunks > 1 cannot run this model (planner.shapes.head_chunks_refusal); "": it can."""
        return family_head_chunks_refusal(self.model_type, bool(self.kv_lora_rank), bool(self.linear_layers)) or \
            self.head_chunks_option

    @property
    def head_chunks_ok(self) -> bool:
        """Whether model_utils/head_chunks.py can run this model's attention in chunks of heads."""
        return not self.no_head_chunks

    def causal_attention_layers(self, seq_len: int, layers: Iterable[int] | None = None) -> float:
        """How many full causal attention layers the attention of `layers` (all) costs at `seq_len`: a full layer
        counts 1 (s^2/2 query-key pairs), a windowed one (s*w - w^2/2)/(s^2/2) with w = min(window, s) (each query
        sees its last w keys; the first w queries fewer). The dense model's int L unchanged, so its figures are too."""
        idx = range(self.num_layers) if layers is None else list(layers)
        windowed = sum(i in self.window_layers for i in idx) if self.sliding_window else 0
        if not windowed:
            return len(idx)
        s, w = float(seq_len), float(min(self.sliding_window, seq_len))
        return len(idx) - windowed + windowed * (2 * s * w - w * w) / (s * s)

    @classmethod
    def from_config(cls, cfg: Mapping) -> ModelShape:
        cfg = cfg.get("text_config") or cfg  # a composite config (Qwen3.5): its text model
        linear = sum(t == "linear_attention" for t in cfg.get("layer_types") or ())
        window, window_layers = windowed_layers(cfg)
        try:
            h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            latent = bool(cfg.get("kv_lora_rank"))
            qk = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0) if latent else 0
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=h,
                       intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                       num_heads=nh, num_kv_heads=nh if latent else int(cfg.get("num_key_value_heads") or nh),
                       head_dim=qk or int(cfg.get("head_dim") or h // nh),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
                       qk_norm=cfg.get("model_type") == "qwen3", model_type=str(cfg.get("model_type", "")),
                       v_head_dim=int(cfg.get("v_head_dim") or 0) if latent else 0,
                       qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if latent else 0,
                       q_lora_rank=int(cfg.get("q_lora_rank") or 0) if latent else 0,
                       kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
                       **moe_fields(cfg),
                       head_chunks_option=_option_head_chunks_refusal(cfg.get),
                       sliding_window=window, window_layers=window_layers,
                       **({"linear_layers": linear, **{f"linear_{k}": int(cfg[f"linear_{n}"]) for k, n in (
                           ("k_heads", "num_key_heads"), ("v_heads", "num_value_heads"), ("k_dim", "key_head_dim"),
                           ("v_dim", "value_head_dim"))}} if linear else {}))
        except KeyError as e:
            raise ValueError(f"model config lacks {e.args[0]!r}: need vocab_size, hidden_size, intermediate_size, "
                             "num_hidden_layers, num_attention_heads") from None

    @property
    def shared_width(self) -> int:
        """The intermediate width of the always-active (shared) experts of an MoE layer, all together."""
        return self.shared_intermediate_size or self.shared_experts * self.moe_intermediate_size

    @property
    def no_tiled_mlp(self) -> str:
        """Why --tiled_mlp cannot run this model (planner.moe_keys.tiled_mlp_refusal); "": it can."""
        return tiled_mlp_refusal(self.model_type) if self.num_experts or self.model_type in OTHER_MLP_NAME else ""

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def attention_params(self) -> int:
        """Parameters of one layer's attention: q/k/v/o projections, or MLA's latent projections and norms."""
        h, d, nh, nkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        if self.kv_lora_rank:  # q: [h -> q_lora -> nh * d] or [h -> nh * d]; kv: h -> kv_lora + rope -> nh * (nope + v)
            qr, kvr, rope, dv = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_dim
            q = (h * qr + qr + qr * nh * d) if qr else h * nh * d
            return q + h * (kvr + rope) + kvr + kvr * nh * (d - rope + dv) + nh * dv * h
        attn = h * d * (nh + 2 * nkv) + nh * d * h
        attn += d * (nh + 2 * nkv) if self.qkv_bias else 0
        return attn + (2 * d if self.qk_norm else 0)

    def _mlp_params(self, active: bool) -> float:
        """MLP parameters of the average layer (all experts, or with `active` those one token uses)."""
        dense = 3 * self.hidden_size * self.intermediate_size
        if not self.num_experts:
            return dense
        n = self.experts_per_token if active else self.num_experts
        moe = 3 * self.hidden_size * (self.moe_intermediate_size * n + self.shared_width) \
            + self.hidden_size * self.num_experts  # + router
        k = min(self.dense_layers, self.num_layers)
        return (k * dense + (self.num_layers - k) * moe) / self.num_layers

    def layer_params(self) -> int:
        """Parameters of one (average) decoder layer: attention, gated MLP (every expert), two norms."""
        return self.attention_params() + int(self._mlp_params(False)) + 2 * self.hidden_size

    def active_layer_params(self) -> int:
        """What one token multiplies by in one (average) layer: layer_params with only its routed experts."""
        return self.attention_params() + int(self._mlp_params(True)) + 2 * self.hidden_size

    def param_numels(self) -> list[int]:
        """Elements of each parameter in the order the model registers them (model.parameters(): what ZeRO-3's flat
        buffers and optimizer sub-groups follow): the embedding, per decoder layer the attention's q, k, v, o (each
        weight followed by its bias where the family has one; Qwen3's q/k norms after them), the MLP's gate, up, down
        and the two norms, then the final norm and the LM head (absent when tied). A family this does not spell out
        parameter by parameter (latent attention, experts) gives each layer as one entry of layer_params(): the
        totals agree, the sub-group boundaries are then approximate."""
        h, d, nh, nkv, inter = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        emb = self.vocab_size * h
        if self.kv_lora_rank or self.num_experts or self.linear_layers:
            layers = [self.layer_params()] * self.num_layers
        else:
            attn = []
            for rows in (nh * d, nkv * d, nkv * d):
                attn += [rows * h] + ([rows] if self.qkv_bias else [])
            attn.append(h * nh * d)
            attn += [d, d] if self.qk_norm else []
            layers = [attn + [inter * h] * 3 + [h, h]] * self.num_layers
            layers = [n for layer in layers for n in layer]
        return [emb, *layers, h] + ([] if self.tie_word_embeddings else [emb])

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_layers * self.layer_params() + self.hidden_size

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: all layers (the routed experts a token uses) plus the LM
        head (not the embedding lookup)."""
        return self.num_layers * self.active_layer_params() + self.vocab_size * self.hidden_size


# transformers 5.23, each family built tiny and run (tests/unit/planner/test_latent_shapes.py records the window each
# layer's attention receives). Families whose attention takes config.sliding_window in every layer, whatever
# layer_types say:
EVERY_LAYER_WINDOWED = frozenset({"mistral", "mixtral", "ministral3", "phi3", "phi4_multimodal", "starcoder2",
                                  "qwen3_moe", "deepseek_v4"})
# Families whose attention takes it in the layers its config's layer_types name "sliding_attention":
TYPED_LAYERS_WINDOWED = frozenset({
    "qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3", "gemma3_text", "gpt_oss", "cohere2", "cohere2_moe", "cwm",
    "exaone4", "exaone_moe", "flint", "gemma4_text", "gemma4_unified_text", "granite_swa", "granitemoe_swa",
    "kolibri1", "lfm3", "mimo_v2_flash", "ministral", "olmo3", "smollm3", "vaultgemma"})
# (MiniMax, which windows its softmax layers between linear ones, is in neither: its layers count full, the safe side.)
# Of those, the ones that window only with use_sliding_window on, which their config class defaults to off:
WINDOW_SWITCHED = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"})


def windowed_layers(cfg: Mapping) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that attend within it) as transformers runs the config; (0, ()) where none does.
    Any family not in the two tables above runs full attention whatever sliding_window says (Llama, Phi-MoE, Seed-OSS,
    GLM-4, Nemotron-H, ... take no window; one not measured counts none too: counting a windowed layer full
    over-counts its FLOPs, the safe side of a time limit). Which layers: `layer_types` where listed (what
    transformers' config holds once built); for a config.json without them the family's default, spelled out here
    for Qwen2/3 (the layers from max_window_layers on), Qwen2-MoE (the even ones below it), Gemma-2 and gpt-oss
    (every other layer from the first), Gemma-3 and Cohere-2 (all but every sliding_window_pattern-th: 6, 4), else
    the layer_types transformers' own config class derives (EXAONE-4's and OLMo-3's every 4th layer full, ...);
    none where transformers is not importable or refuses the dict."""
    kind = str(cfg.get("model_type") or "")
    n, w = int(cfg.get("num_hidden_layers") or 0), int(cfg.get("sliding_window") or 0)
    if w <= 0 or kind not in EVERY_LAYER_WINDOWED | TYPED_LAYERS_WINDOWED or (
            kind in WINDOW_SWITCHED and not cfg.get("use_sliding_window")):
        return 0, ()
    types = cfg.get("layer_types")
    if kind in EVERY_LAYER_WINDOWED:
        idx = range(n)
    elif types:
        idx = [i for i, t in enumerate(types[:n]) if t == "sliding_attention"]
    elif kind in ("qwen2", "qwen3"):
        idx = range(or_default(cfg.get("max_window_layers"), 28), n)
    elif kind == "qwen2_moe":
        idx = range(0, min(n, or_default(cfg.get("max_window_layers"), 28)), 2)
    elif kind in ("gemma2", "gpt_oss"):
        idx = range(0, n, 2)
    elif kind in ("gemma3", "gemma3_text", "cohere2"):
        every = int(cfg.get("sliding_window_pattern") or (4 if kind == "cohere2" else 6))
        idx = [i for i in range(n) if (i + 1) % every]
    else:
        idx = [i for i, t in enumerate(_derived_layer_types(cfg)[:n]) if t == "sliding_attention"]
    idx = tuple(idx)
    return (w, idx) if idx else (0, ())


def _derived_layer_types(cfg: Mapping) -> list:
    """The layer_types transformers' config class derives from a config.json that lists none; [] where transformers
    is not importable or the class refuses the dict. Imported here, not at the top: the planner's values need no
    transformers (importing it brings torch, ~3 s), only a windowed family whose rule is not spelled out above."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(getattr(AutoConfig.for_model(**cfg), "layer_types", None) or ())
    except Exception:  # noqa: BLE001 -- a dict its class refuses (strict validation, an unknown field): no window
        return []


def load_shape(model: str) -> ModelShape:
    """A preset name from planner/presets.py, a config.json path, or a folder holding one."""
    return ModelShape.from_config(load_config(model))


def load_config(model: str) -> dict:
    """The config dict of a preset name, a config.json path or a folder holding one; a one-line ValueError otherwise."""
    if model in PRESETS:
        return PRESETS[model]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a config.json path")
    with open(path) as fh:
        try:
            config = json.load(fh)
        except ValueError as e:  # a file that is not a model's config.json (JSONDecodeError: no file named)
            raise ValueError(f"model {model!r}: {path} is not JSON ({e}): give a model's config.json or its folder") \
                from None
    if not isinstance(config, dict):
        raise ValueError(f"model {model!r}: {path} is not a model's config.json (a JSON object)")
    return config


INT_FEATURES = ("checkpoint_every", "logits_tile_mb", "attention_head_chunks")  # the others are on / off


@dataclass(frozen=True)
class Features:
    """Memory features, named as in training/config.py (offloads are the ZeRO-3 CPU offloads)."""

    offload_params: bool = False
    offload_optimizer: bool = False
    tiled_mlp: bool = False
    tiled_logits: bool = False
    gradient_checkpointing: bool = False
    offload_activations: bool = False
    checkpoint_every: int = 0  # K: only decoder layers 0, K, 2K, ... checkpointed; 0: gradient_checkpointing decides
    lean_rmsnorm: bool = False  # model_utils/rmsnorm.py replaces HF's RMSNorm (train.py's default where supported)
    keep_attention: bool = False  # checkpointed layers keep the attention output; backward recomputes the rest
    lean_mlp: bool = False  # model_utils/mlp.py's gated product keeps gate and up only (train.py's default where supported)
    logits_tile_mb: int = 0  # tiled logits: MiB of fp32 logits per tile; 0: LOGITS_TILE_BYTES
    attention_head_chunks: int = 1  # attention in n chunks of heads (model_utils/head_chunks.py); 1: all heads at once
    ring_attention: bool = False  # context-parallel K/V passed in a ring, not gathered whole (model_utils/ring_attention.py)

    @property
    def tile_bytes(self) -> int:
        """Bytes of fp32 logits per tile of the tiled logits + loss."""
        return self.logits_tile_mb * 2**20 if self.logits_tile_mb > 0 else LOGITS_TILE_BYTES

    @property
    def every(self) -> int:
        """K of selective checkpointing; gradient_checkpointing alone is K=1; 0: none."""
        return self.checkpoint_every or (1 if self.gradient_checkpointing else 0)

    @classmethod
    def from_choice(cls, record: Mapping) -> Features:
        """The features of a run's `memory_choice` record (training/startup: the chooser's Choice.record, with the
        start-up fields beside them): its fields that name a feature, through `of`. The lean norm and MLP, which a
        record before they were logged does not name, are train.py's defaults (on); an absent or null value is the
        feature's default."""
        known = {f.name for f in fields(cls)}
        spec = {"lean_rmsnorm": True, "lean_mlp": True}
        spec.update({k: v for k, v in record.items() if k in known and v is not None})
        return cls.of(spec)

    @classmethod
    def of(cls, spec: Features | Mapping[str, bool] | Iterable[str] | None) -> Features:
        """From a Features, a {name: bool} mapping, or an iterable of the enabled names."""
        if isinstance(spec, str):
            spec = [spec]
        if spec is None or isinstance(spec, Features):
            feats = spec or cls()
        else:
            known = {f.name for f in fields(cls)}
            chosen = dict(spec) if isinstance(spec, Mapping) else dict.fromkeys(spec, True)
            unknown = sorted(set(chosen) - known)
            if unknown:
                raise ValueError(f"unknown memory feature(s) {unknown}: use {sorted(known)}")
            feats = cls(**{k: int(v) if k in INT_FEATURES else bool(v)
                           for k, v in chosen.items()})
        if feats.attention_head_chunks < 1:
            raise ValueError(f"attention_head_chunks {feats.attention_head_chunks}: use 1 (all heads at once) or more")
        if feats.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every {feats.checkpoint_every}: use 0 (off), 1 (every layer) or K > 1")
        if feats.offload_activations and not feats.every:
            raise ValueError("offload_activations offloads the checkpointed hidden states: it needs "
                             "gradient_checkpointing on too")
        if feats.keep_attention and not feats.every:
            raise ValueError("keep_attention changes what checkpointed layers recompute: it needs "
                             "gradient_checkpointing (or checkpoint_every K) on too")
        return feats

