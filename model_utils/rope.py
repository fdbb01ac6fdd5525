"""RoPE settings per stage, applied through transformers' own `rope_parameters` (transformers 5), so the
rotary embedding is computed by transformers' implementations and an exported model carries them.

Supported stage `rope_type`s: default (with a raised `rope_theta`: ABF), linear (position interpolation),
dynamic (NTK), yarn, llama3. Formulas: transformers.modeling_rope_utils. `stage_rope` computes what a stage runs with
from the model's own settings (its text config's, for a composite config: Qwen3.5, Gemma 3, Llama 4):
- the legacy key `type` (Qwen2.5's own YaRN block writes it) is read as `rope_type` (it was ignored: no scaling);
- the same type: the model's fields merged with the stage's (gpt-oss keeps beta_fast / beta_slow, llama3 its
  factors, so a stage may give its factor alone); another type keeps `rope_theta`, `partial_rotary_factor`
  (Phi-4-mini, Qwen3-Next, GLM-4 rotate part of a head: dropped, every dimension rotated from the first step) and, for
  a type that reads it, the model's `original_max_position_embeddings` (its pretraining length), and says once what
  scaling of the model's it replaces; a stage without `rope_type` is `default`;
- yarn needs `original_max_position_embeddings` from the stage or the model: `max_position_embeddings` is often a
  length the model was already extended to (Qwen2.5 base 131072 for a native 32768, Mistral Nemo 1024000), and
  yarn over it stretched some frequencies too little (up to 3.9x too fast a rotation);
- a model with RoPE per layer type (Gemma 3, OLMo 3: `{full_attention: {...}, sliding_attention: {...}}`) takes the
  stage's per type too (`rope: {full_attention: {...}}`); a flat one was merged where no layer reads it (no scaling,
  while hf_config.json showed the stage's theta) or, for another type, crashed at the stage's engine build;
- `dynamic` and `longrope` (Phi-3 / 3.5 / 4-mini) choose their frequencies from the largest position in each
  forward: under sequence parallelism each rank computes RoPE on its own shard (before the all-to-all), so the ranks
  would rotate one sequence differently: refused at SP > 1. `dynamic` keeps the model's max_position_embeddings (its
  threshold: raised to the stage's length, it never scaled), longrope its `factor` (raising max_position_embeddings
  changed its attention scaling at every position).
- a stage's RoPE that lowers the model's rope_theta, or reaches (factor x original length) fewer positions than its
  max_position_embeddings, is said once (`_cut_back`): a 128k recipe's yarn copied after one's own 1M extension.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math

from planner.shapes import ROPE_MAX_POSITIONS

ROPE_TYPES = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
OPTIONAL = {  # the other keys transformers reads for each type (modeling_rope_utils' _validate_*_rope_parameters)
    "default": set(),
    "linear": {"original_max_position_embeddings"},
    "dynamic": {"original_max_position_embeddings"},
    "yarn": {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": set(),
}
COMMON = {"rope_type", "rope_theta", "partial_rotary_factor"}
KEEP = ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings")  # what a change of type keeps
DERIVED = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")  # null: transformers
# derives them (a stage's `attention_factor: null` is not given); any other null is no setting
PER_SHARD = ("dynamic", "longrope")  # frequencies from each forward's largest position
NUMBERS = ("rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings", "low_freq_factor",
           "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def normalized(rope: dict, where: str) -> dict:
    """`rope` with the legacy `type` read as `rope_type` (one-line ValueError when both are given and disagree) and
    its numbers written as text read as numbers: YAML 1.1 reads `rope_theta: 1e6` (no dot) and a quoted "2048" as
    text, which crashed the checks (a TypeError) or multiplied a string; text that is no number is one line."""
    rope = dict(rope)
    if "type" in rope:
        legacy = rope.pop("type")
        if rope.setdefault("rope_type", legacy) != legacy:
            raise ValueError(f"{where}: type {legacy!r} and rope_type {rope['rope_type']!r} disagree: give rope_type")
    for key in NUMBERS:
        if isinstance(rope.get(key), str):
            text = rope[key].strip()
            try:
                rope[key] = int(text) if text.lstrip("+-").isdigit() else float(text)
            except ValueError:
                _not_a_number(key, rope[key], where)
    return rope


def _not_a_number(key: str, value, where: str) -> None:
    raise ValueError(f"{where}: {key} {value!r} is not a finite number: write it as one (e.g. {key}: "
                     f"{1000000.0 if key == 'rope_theta' else 2048 if key.startswith('original') else 4.0})")


def _per_shard(kind: str, where: str, sp: int) -> None:
    if kind in PER_SHARD and sp > 1:
        raise ValueError(f"{where}: rope_type {kind} scales each rank's frequencies from the positions of its own "
                         f"sequence shard, so under sequence_parallel_size {sp} the ranks would disagree: use yarn "
                         "or linear, or sequence_parallel_size 1")


def check_rope(rope: dict, where: str, sp: int = 1, inherited: dict | None = None) -> None:
    """One-line ValueError for a stage's RoPE setting that cannot work (at SP degree `sp`); `inherited`: the model's
    own fields of the same type, which supply what the stage leaves out (a llama3 stage giving its factor alone)."""
    rope = normalized(rope, where)
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {kind!r} is not supported: use one of {sorted(ROPE_TYPES)}")
    _per_shard(kind, where, sp)
    missing = ROPE_TYPES[kind] - set(rope) - set(inherited or {})
    if missing:
        raise ValueError(f"{where}: rope_type {kind} needs {sorted(missing)}")
    known = COMMON | ROPE_TYPES[kind] | OPTIONAL[kind]
    for key in sorted(set(rope) - known):  # a typo (`theta`) was carried along unused: the model's frequencies
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
        raise ValueError(f"{where}: {key!r} is no setting of rope_type {kind}" + (f" (did you mean {near[0]!r}?)"
                         if near else "") + f": it takes {sorted(known - {'rope_type'})}")
    for key in NUMBERS:  # a stage's own (the model's are its config's): true, a list, nan or inf is no setting; a
        v = rope.get(key, 0.0)  # null for an optional one is not given (transformers derives its default), as before
        if v is None and key in DERIVED:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            _not_a_number(key, v, where)
    if "rope_theta" in rope and not rope["rope_theta"] > 0:
        raise ValueError(f"{where}: rope_theta must be > 0, got {rope['rope_theta']}")
    if "factor" in rope and not rope["factor"] >= 1:
        raise ValueError(f"{where}: rope factor must be >= 1 (it stretches the context), got {rope['factor']}")


def nested(params) -> bool:
    """RoPE per layer type (Gemma 3, OLMo 3): {layer type: its parameters}."""
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def text_config(hf_config):
    """The config that holds the decoder's RoPE (a composite config's text config)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def stage_rope(config, rope: dict | None, where: str = "rope", sp: int = 1) -> tuple[dict, list[str]]:
    """(the rope_parameters a stage runs with, the notes to say once) from the model's text config `config` and the
    stage's `rope` (None: the model's own); one-line ValueError for what cannot work at SP degree `sp`."""
    base = dict(getattr(config, "rope_parameters", None) or {})
    if not nested(base):
        if rope is not None and nested(rope):
            raise ValueError(f"{where}: a rope per layer type ({', '.join(rope)}), and the model has one RoPE for "
                             "every layer: give it flat")
        out, notes = _one(config, base, rope, where, sp)
        if rope is not None:
            _accepted(config, out, where)
        return out, notes
    if rope is not None and not (nested(rope) and set(rope) <= set(base)):
        first = next(iter(base))
        raise ValueError(f"{where}: the model sets RoPE per layer type ({', '.join(base)}): give the stage's per type, "
                         f"e.g. rope: {{{first}: {{rope_type: default, rope_theta: ...}}}} (a flat one reaches no layer)")
    out, notes = {}, []
    for kind, params in base.items():
        out[kind], said = _one(config, dict(params), (rope or {}).get(kind), f"{where} ({kind})", sp)
        notes += said
    if rope is not None:
        _accepted(config, out, where)
    return out, notes


def _types(params: dict) -> list:
    return sorted(str(p.get("rope_type")) for p in (params.values() if nested(params) else [params]))


def _accepted(config, params: dict, where: str) -> None:
    """A one-line ValueError where the model's config class refuses or rewrites the stage's RoPE: the training build
    sets it without the class (it trained), and the export, every `from_pretrained` of it, failed after the run
    (Phi3Config turns yarn into longrope and then wants its short / long factors; it refuses linear)."""
    import copy

    if not hasattr(config, "to_dict"):  # a recipe check without the model's config: nothing to build
        return
    try:
        length = yarn_length(params)  # as apply_rope sizes it (the base's own beside a yarn: transformers warns)
        made = type(config)(**{**config.to_dict(), "rope_parameters": copy.deepcopy(params),
                               **({"max_position_embeddings": length} if length else {})})
    except Exception as e:  # noqa: BLE001 (each family's validation raises its own kind)
        raise ValueError(f"{where}: {type(config).__name__} refuses rope_type {'/'.join(_types(params))} "
                         f"({str(e).splitlines()[0][:120]}): a model of it could not be loaded after the run; use "
                         "rope_type default (rope_theta) or the model's own type") from None
    got = dict(getattr(made, "rope_parameters", None) or {})
    if _types(got) != _types(params):
        raise ValueError(f"{where}: {type(config).__name__} turns rope_type {'/'.join(_types(params))} into "
                         f"{'/'.join(_types(got))}: the exported model would not compute what trained; use rope_type "
                         "default (rope_theta) or the model's own type")


def _one(config, base: dict, rope: dict | None, where: str, sp: int) -> tuple[dict, list[str]]:
    base, notes = normalized(base, where), []
    if rope is None:
        out = base
        _per_shard(out.get("rope_type", "default"), where.replace("rope", "the model's rope_parameters", 1), sp)
    else:
        rope = normalized(rope, where)
        kind, had = rope.get("rope_type", "default"), base.get("rope_type", "default")
        check_rope(rope, where, sp, base if kind == had else None)
        keep = KEEP if kind in ("yarn", "llama3", "linear", "dynamic") else KEEP[:2]  # default reads no length
        out = base if kind == had else {k: base[k] for k in keep if k in base}
        if kind == had == "yarn" and rope.get("factor", base.get("factor")) != base.get("factor") \
                and "attention_factor" not in rope and "attention_factor" in base:  # OLMo 3's 0.1 ln 8 + 1 for
            out = {k: v for k, v in out.items() if k != "attention_factor"}  # factor 8: derived again from the new one
        out = {**out, **rope, "rope_type": kind}  # a stage without rope_type is default (transformers needs it said)
        if kind != had and had != "default":
            notes.append(f"{where}: the model's rope_type {had} ({_fields(base)}) is replaced by {kind} "
                         f"({_fields(rope)}): its own scaling is not kept")
    kind = out.get("rope_type", "default")
    top = getattr(config, "original_max_position_embeddings", None)  # Phi-3 keeps it at the top level
    if kind == "yarn" and "original_max_position_embeddings" not in out and rope is not None:
        if not top:
            raise ValueError(f"{where}: rope_type yarn needs original_max_position_embeddings, the length the model "
                             f"was pretrained at (max_position_embeddings, {config.max_position_embeddings}, is "
                             "often one it was already extended to: Qwen2.5's 131072 for a native 32768)")
        out["original_max_position_embeddings"] = top
    if kind in ("llama3", "linear", "dynamic"):
        out.setdefault("original_max_position_embeddings", top or config.max_position_embeddings)
    if kind == "longrope" and "factor" not in out:  # its attention scaling, fixed before the table grows
        orig = out.get("original_max_position_embeddings") or top or config.max_position_embeddings
        out["factor"] = config.max_position_embeddings / orig
    if rope is not None:  # with its yarn / llama3 / linear length filled in
        notes += _cut_back(config, base, out, where)
    return out, notes


def _cut_back(config, base: dict, out: dict, where: str) -> list[str]:
    """A note where a stage's RoPE lowers the model's rope_theta or reaches (factor x original length) fewer positions
    than its max_position_embeddings: the 128k SFT recipe's yarn x4 over 32768 at theta 1e6, copied after one's own
    ABF extension to 1M (default type, theta 1.6e8), trained and shipped a 128k model without a word."""
    said = []
    theta, had = out.get("rope_theta"), base.get("rope_theta")
    if theta is not None and had is not None and theta < had:
        said.append(f"rope_theta {theta} is below the model's {had}")
    f, orig, most = out.get("factor"), out.get("original_max_position_embeddings"), \
        getattr(config, "max_position_embeddings", None) or 0
    if base.get("factor") and base.get("original_max_position_embeddings"):  # a scaled model's own reach (Llama 3.1:
        most = int(base["factor"] * base["original_max_position_embeddings"])  # x8 over 8192, declared 131072)
    scaled = base.get("rope_type", "default") not in (None, "default") or said  # a default-type model's
    # max_position_embeddings is often only declared (the demo's tiny base: 131072, trained at 256): its reach counts
    # where the stage also lowers its theta (an ABF extension undone)
    if out.get("rope_type") in ("yarn", "linear", "llama3", "dynamic") and f and orig and f * orig < most and scaled:
        said.append(f"{out['rope_type']} factor {f} over {orig} reaches {int(f * orig)} positions, fewer than the "
                    f"model's max_position_embeddings {most}")
    return [f"{where}: {' and '.join(said)}: after your own extension this stage cuts the model back (drop `rope:`: a "
            "stage without rope keeps the previous stage's, the first one the model's)"] if said else []


def check_positions(params: dict, length: int) -> None:
    """One-line ValueError for a RoPE model's (`params` non-empty) sample longer than ROPE_MAX_POSITIONS (2**24):
    float32 position * inv_freq (transformers, vLLM, Meta's reference) stops telling positions apart past it
    (planner/shapes.ROPE_MAX_POSITIONS: the measured errors), and a float64 one would train what no server runs."""
    if params and length > ROPE_MAX_POSITIONS:
        raise ValueError(f"max_seq_length {length:,}: positions >= {ROPE_MAX_POSITIONS:,} collapse in float32 RoPE (HF, "
                         f"vLLM, Meta's reference): at most {ROPE_MAX_POSITIONS:,} tokens a sample")


def short_scaling(params: dict, length: int) -> list[str]:
    """Notes where a stage's yarn / linear scaling reaches fewer positions (factor x original length) than the stage
    trains at: "factor 2" written to double a model already x32 cut its scaling 16x, unsaid. Refuses (check_positions)
    a length past what float32 RoPE positions (training/curriculum.check_stages calls it for every stage at start-up)."""
    check_positions(params, length)
    out = []
    for p in (params.values() if nested(params) else [params]):
        kind, f, orig = p.get("rope_type"), p.get("factor"), p.get("original_max_position_embeddings")
        if kind in ("yarn", "linear") and f and orig and f * orig < length:
            out.append(f"rope_type {kind} factor {f} over {orig} reaches {int(f * orig)} positions, fewer than its "
                       f"max_seq_length {length}: the positions past them train beyond the scaling (factor "
                       f"{length / orig:g} reaches it)")
    return out


def _fields(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items() if k != "rope_type" and not isinstance(v, list)) or "-"


def apply_rope(hf_config, rope: dict | None, max_seq_length: int) -> None:
    """Set a stage's RoPE on the model config (in place, its text config's for a composite one: checked at start-up
    by stage_rope with the stage's SP degree) and size the position table (not past a dynamic model's threshold).
    A flat yarn with its factor and pretraining length extends to factor x original positions, as the export writes
    it (model_utils/export.py): the base's own max_position_embeddings beside them (a tiny base's 131072 over 256)
    made transformers warn at every config built from it, the run's and its checkpoints' hf_config.json, that the
    factor disagrees with their ratio. The explicit factor is what YaRN reads, so the frequencies and the attention
    scaling are the same either way (tests/unit/model_utils/test_rope_stages.py)."""
    config = text_config(hf_config)
    params, _ = stage_rope(config, rope)
    check_positions(params, max_seq_length)
    config.rope_parameters = params
    kinds = {p.get("rope_type") for p in (params.values() if nested(params) else [params])}
    if "dynamic" not in kinds:
        config.max_position_embeddings = max(yarn_length(params) or config.max_position_embeddings, max_seq_length)


def yarn_length(params: dict) -> int | None:
    """factor x original_max_position_embeddings of a flat yarn setting (the length it extends to), else None."""
    if nested(params) or params.get("rope_type") != "yarn":
        return None
    factor, orig = params.get("factor"), params.get("original_max_position_embeddings")
    return int(orig * factor) if factor and orig else None


ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def model_hash(hf_config) -> str:
    """Hash of the fields that decide the weights' shapes (RoPE and attention backend excluded)."""
    d = hf_config.to_dict()
    return hashlib.sha256(json.dumps({k: d.get(k) for k in ARCH_FIELDS}, sort_keys=True).encode()).hexdigest()[:16]
