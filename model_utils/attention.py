"""Document-masked core attention: every packed document attends only to itself, with or without Ulysses.

Why: DeepSpeed's `UlyssesSPAttentionHF` drops the model's attention mask after its all-to-all (sdpa then
runs plain causal attention over the whole packed sample; its flex_attention path hard-codes a causal
BlockMask), so documents packed into one sample attend across their boundaries under SP and a model's
sliding window is lost. What survives the all-to-all are the position ids: the wrapper all-gathers them,
so the core attention function sees the FULL sequence's `position_ids` [bs, sl] in its kwargs. A document
is a run of consecutive positions (a restart, pos[i] != pos[i-1] + 1, begins the next one: the rule of
transformers' `find_packed_sequence_indices`), so the core function can rebuild the right mask itself.

`register(model, attn)` puts that function in transformers' `ALL_ATTENTION_FUNCTIONS` under the model's own
backend name (so transformers' per-backend branches still run, and DeepSpeed then wraps it as its
`core_attn_implementation`); it also makes the model skip building its own mask for sdpa / flex (an
O(sl^2) tensor at long lengths, dropped by Ulysses anyway). Per backend, after the all-to-all:
- sdpa: one causal sdpa call per document, short documents grouped into blocks of <= BLOCK tokens with a
  small block-diagonal mask, a long windowed document in query chunks with a [chunk, chunk + window) mask;
  never an [sl, sl] mask. Monotonic positions (no restart) and no window: one plain causal call.
- flex_attention: a BlockMask built from document ids (+ window) at block granularity, O((sl/128)^2).
- flash_attention_2/3: varlen with cu_seqlens from the documents, micro-batch rows flattened into one
  packed row (FA's own window). Written by construction, untested here (no GPU).
Learned attention sinks (GPT-OSS's `s_aux`, one logit per query head, already sliced to the rank's heads by ulysses.py):
on CPU every backend's call runs the sdpa pieces with `sinks.sink_sdpa` (transformers' flex refuses sinks there); on a
GPU flex applies them from its lse; flash-attention is refused for them. Latent attention (`families.latent_dims`: q/k
and v of different head dims) needs nothing here: ulysses.py pads v for the all-to-all. Which architectures and
backends this path takes, and the one-line refusals of the others: families.py.
What each backend needs (host bounds and sdpa pieces, device document ids, BlockMasks, cu_seqlens) is built
once per micro-batch by its first layer's call (`Documents`, `documents_for`) and reused by every other layer
and by the activation-checkpointing recompute: at most one host sync per micro-batch, not one per layer.
`track(model, attn)` counts which attention modules went through the registered function, and
`check_routed(model)` (train.py calls it after the first micro-step) refuses a model whose attention
bypasses it: under SP such a model would silently attend only within its own shard.
"""

from __future__ import annotations

import bisect
import math

import torch

from model_utils import sinks

# sdpa: documents up to BLOCK tokens are grouped into one call with a [<=BLOCK, <=BLOCK] mask. torch keeps that mask
# (as floats) and the GQA-repeated K/V of a masked call for backward, so small blocks: at 2048 a 16k sample of
# 500-2500-token documents saved 4.3x the plain causal call's bytes and ran 1.3x slower than at 512, which saves
# what the plain call saves (bench/attention.py's notes in docs/results/attention.md).
BLOCK = 512
FLEX_BLOCK = 128  # flex_attention's sparse block size
# flex_attention's document BlockMask grows with (sl / FLEX_BLOCK)^2 per sample of a micro-batch: measured (CPU,
# 2k-token documents) 41-48 B per block pair while doc_block_mask builds it ([bs, nb, nb] bools, an int64 argsort)
# and 16 B kept (four int32 index tables): at 1M tokens 2.8 GB built + 1.07 GB kept, at 4M ~44 GB; under context
# parallelism each rank builds its 1/cp of it (rect_block_mask). The planner does not count it, so a mask past
# FLEX_MASK_MAX_BYTES a rank is refused at start-up (check_flex_length: 1,048,576 tokens a sample without cp, the
# gpt-oss recipe's 1M stage at cp 2 builds 2 GiB; 4M needs cp 16).
FLEX_MASK_BYTES_PER_PAIR = 64
FLEX_MASK_MAX_BYTES = 4 * 2**30
SUPPORTED = ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ORIGINAL: dict = {}  # (interface, name) -> the function we replaced
_STATE: dict = {"attn": None, "modules": set(), "calls": 0, "windows": set()}


class Documents:
    """The documents of one micro-batch, built once from its [bs or 1, sl] position ids and reused by every
    layer's attention call of that forward and of its activation-checkpointing recompute (`documents_for`).

    On the device, without a host sync: `start` [bs, sl] (True where a document begins) and `doc` [bs, sl] int32
    (the document index of every token) -> flex_attention's BlockMask per window. The single device -> host copy
    (`host_starts`, one `.nonzero().tolist()`) happens on first need only (sdpa's pieces, flash-attention's
    max length, the "no restart" test of sdpa / flash); flex never makes it. Everything derived from it
    (bounds, sdpa pieces per window, cu_seqlens, BlockMasks) is cached here.

    Cost at Llama-3-8B, 1M tokens, SP=8, 32 layers, activation checkpointing (64 attention calls per
    micro-batch, each on the whole 1M sequence after the all-to-all). Before: every call made one host sync
    (the GPU queue drained before the layer's attention), then built the [1, 1M] document ids on the host and
    copied their 4 MB to the device, and flex hashed str(bounds): 3.2 ms of host work per call measured here
    (1M tokens, 684 documents of 500-2500 tokens), so per micro-batch 64 syncs + 64 x 4 MB copies + ~0.2 s of
    host work. Now: 1 sync (sdpa / flash; 0 for flex) and no copy per micro-batch, plus [1, 1M] bool + int32
    (5 MB) and, per window, the BlockMask (flex) or the piece list (sdpa) held until the next micro-batch.
    A micro-batch there is >= ~20 s of GPU time (6.4e16 dense FLOPs with the recompute over 8 GPUs at ~400
    TFLOP/s; minutes when documents are long), so the saving is ~1% of a step or less; it is larger at short
    sequences, where a step is milliseconds and 64 syncs stall the launch queue each time."""

    def __init__(self, position_ids: torch.Tensor, bs: int):
        pos = position_ids.expand(bs, -1)
        self.bs, self.sl, self.device = bs, pos.shape[1], pos.device
        self.start = torch.ones(bs, self.sl, dtype=torch.bool, device=pos.device)
        self.start[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1  # a restart begins the next document
        self.doc = self.start.cumsum(1, dtype=torch.int32) - 1  # [bs, sl], nondecreasing along each row
        self._flat: list[int] | None = None
        self._cache: dict = {}

    def host_starts(self) -> list[int]:
        """Flat indices (row * sl + column) of every document start, row starts included: the one host sync."""
        if self._flat is None:
            self._idx = self.start.flatten().nonzero()[:, 0]  # [n_documents] on the device
            self._flat = self._idx.tolist()
        return self._flat

    @property
    def bounds(self) -> list[list[int]] | None:
        """Per row [0, s1, ..., sl]; None when no row restarts (one document per row)."""
        if "bounds" not in self._cache:
            flat, sl = self.host_starts(), self.sl
            rows: list[list[int]] = [[] for _ in range(self.bs)]
            for i in flat:
                rows[i // sl].append(i % sl)
            self._cache["bounds"] = None if len(flat) == self.bs else [row + [sl] for row in rows]
        return self._cache["bounds"]

    def pieces(self, row: int, window: int | None) -> list[tuple[int, int, int, int]]:
        key = ("pieces", row, window, BLOCK)
        if key not in self._cache:
            b = self.bounds[row] if self.bounds is not None else [0, self.sl]
            self._cache[key] = sdpa_pieces(b, window, BLOCK)
        return self._cache[key]

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens [n_documents + 1] int32 on the device, the longest document) over the rows flattened."""
        if "varlen" not in self._cache:
            flat = self.host_starts() + [self.bs * self.sl]
            cu = torch.cat([self._idx, self._idx.new_full((1,), self.bs * self.sl)]).to(torch.int32)
            self._cache["varlen"] = cu, max(e - s for s, e in zip(flat[:-1], flat[1:]))
        return self._cache["varlen"]

    def block_mask(self, window: int | None):
        key = ("flex", window)
        if key not in self._cache:
            self._cache[key] = doc_block_mask(self.doc, window)
        return self._cache[key]

    def drop_block_masks(self) -> None:
        """Forget the BlockMasks (16 B per block pair each: 1.07 GB a mask at 1M tokens), context_parallel's rectangular
        ones ("cp_flex") too; rebuilt if asked again."""
        for key in [k for k in self._cache if isinstance(k, tuple) and k[0] in ("flex", "cp_flex")]:
            del self._cache[key]


_DOCS: list = []  # [(key tensor, its version, bs, sl, Documents)], newest last
_KEEP = 4  # micro-batches remembered: a recompute may come after another forward (evaluation, a probe); only the
# newest keeps its flex BlockMasks (an older one's recompute rebuilds them: time, not memory held for 4)
_OUTER: list = []  # the position ids of the outermost attention call in progress (this rank's shard under SP)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter (and cannot change in place)
        return -1


def documents_for(position_ids: torch.Tensor, bs: int) -> Documents:
    """The Documents of the micro-batch whose position ids these are, built on the first layer's call.

    Keyed by the IDENTITY (and version) of the position-ids tensor the model was called with: every decoder
    layer, and every recompute under activation checkpointing, gets that same tensor object (the caller moves
    a micro-batch to the device once). Under Ulysses the core function sees a fresh all-gathered tensor in
    every layer, so the key is then the local tensor the outermost (tracked) call received (`_OUTER`); the
    gathered content is the same for every layer of the forward. Holding the key tensor keeps its id from being
    reused by another micro-batch."""
    key = _OUTER[-1] if _OUTER else position_ids
    sl, ver = position_ids.shape[-1], _version(key)
    for k, v, b, s, docs in _DOCS:
        if k is key and v == ver and b == bs and s == sl:
            return docs
    docs = Documents(position_ids, bs)
    for *_, older in _DOCS:
        older.drop_block_masks()
    _DOCS.append((key, ver, bs, sl, docs))
    del _DOCS[:max(len(_DOCS) - _KEEP, 0)]
    return docs


def doc_bounds(position_ids: torch.Tensor, bs: int) -> list[list[int]] | None:
    """Document boundaries per row of [bs or 1, sl] position ids: [0, s1, ..., sl]; None when no row restarts."""
    return Documents(position_ids, bs).bounds


def _window(module, kwargs: dict) -> int | None:
    """The layer's sliding window: kwargs["sliding_window"] (Mistral, Qwen2/3, Gemma-3, Phi-3 pass it) or
    `module.sliding_window`; None for full attention."""
    w = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return int(w) if w else None


# ---- sdpa -------------------------------------------------------------------------------------------------

def sdpa_pieces(bounds: list[int], window: int | None, block: int = BLOCK) -> list[tuple[int, int, int, int]]:
    """Cover the queries [0, sl) of one row, in order, by pieces (q_lo, q_hi, k_lo, k_hi) that each hold whole
    documents (or a query chunk of one long windowed document and the keys its window reaches)."""
    pieces, group = [], None
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        if n <= block and (group is None or e - group[0] <= block):
            group = (group[0] if group else s, e)
            continue
        if group:
            pieces.append((group[0], group[1], group[0], group[1]))
            group = None
        if n <= block:
            group = (s, e)
        elif window is None or window >= n:
            pieces.append((s, e, s, e))
        else:  # windowed long document: query chunks of max(block, window), keys reaching back window - 1
            step = max(block, window)
            pieces += [(a, min(a + step, e), max(s, a - window + 1), min(a + step, e)) for a in range(s, e, step)]
    if group:
        pieces.append((group[0], group[1], group[0], group[1]))
    return pieces


def _piece_mask(doc: torch.Tensor, bounds: list[int], piece, window: int | None) -> torch.Tensor | None:
    """[1, 1, q, k] bool mask (True = attend) for one piece of a row; None when plain causal attention is exact."""
    q_lo, q_hi, k_lo, k_hi = piece
    nxt = bisect.bisect_right(bounds, q_lo)  # the first boundary after q_lo
    one_doc = nxt == len(bounds) or bounds[nxt] >= q_hi
    if (q_lo, q_hi) == (k_lo, k_hi) and one_doc and (window is None or window >= q_hi - q_lo):
        return None
    q = torch.arange(q_lo, q_hi, device=doc.device)[:, None]
    k = torch.arange(k_lo, k_hi, device=doc.device)[None, :]
    mask = (doc[q_lo:q_hi, None] == doc[None, k_lo:k_hi]) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask[None, None]


def masked_sdpa(orig, module, query, key, value, mask, kwargs) -> torch.Tensor:
    """One piece through transformers' sdpa (`orig`); with an explicit mask, on SDPA's backends but cuDNN: torch
    2.11-2.13's cuDNN backward returns NaN grad_q with a mask tensor where the length is 64 mod 128 and a row's
    logsumexp is below ln(FLT_MAX) ~ -88.7 (pytorch#196678; TRL#7181 hit it through a Qwen2.5 head), and SDPA's
    default on H100 / H200 is cuDNN (the GPU run's calls: sdpa:cudnn). A causal piece without a mask keeps SDPA's
    choice (clean there). Backward runs the kernel the forward picked; a recompute enters this again. Cost: a
    context per masked piece, microseconds."""
    if mask is None:
        return orig(module, query, key, value, None, **kwargs)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return orig(module, query, key, value, mask, **kwargs)[0]


def _sdpa_docs(orig, module, query, key, value, docs: Documents, window, kwargs):
    # query [bs, hq, sl, hd], key/value [bs, hkv, sl, hd] (hq, hkv: this rank's heads after the all-to-all)
    bs, _, sl, _ = query.shape
    rows = []
    for r in range(bs):
        b = docs.bounds[r] if docs.bounds is not None else [0, sl]
        outs = []
        for piece in docs.pieces(r, window):
            q_lo, q_hi, k_lo, k_hi = piece
            out = masked_sdpa(orig, module, query[r:r + 1, :, q_lo:q_hi], key[r:r + 1, :, k_lo:k_hi],
                              value[r:r + 1, :, k_lo:k_hi], _piece_mask(docs.doc[r], b, piece, window), kwargs)
            outs.append(out)  # [1, q_hi - q_lo, hq, hd]
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0), None  # [bs, sl, hq, hd]


# ---- flex_attention ---------------------------------------------------------------------------------------

def _doc_ids(bounds: list[list[int]] | None, bs: int, sl: int, device) -> torch.Tensor:
    """[bs, sl] int32 document index of every token (nondecreasing along each row), from host bounds: for tests
    and tools (training builds it on the device: `Documents.doc`)."""
    starts = torch.zeros(bs, sl, dtype=torch.int32)
    for r, b in enumerate(bounds or []):
        starts[r, b[1:-1]] = 1
    return starts.cumsum(1, dtype=torch.int32).to(device)


def doc_block_mask(doc: torch.Tensor, window: int | None, block: int = FLEX_BLOCK):
    """A flex_attention BlockMask for causal attention within each document (and window) of `doc` [bs, sl].

    Built at block granularity from each block's first and last document id (ids are nondecreasing), so
    nothing of size [sl, sl] is ever made: [bs, nb, nb] with nb = ceil(sl / block)."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, sl = doc.shape
    nb = -(-sl // block)
    pad = nb * block - sl
    ids = torch.cat([doc, doc[:, -1:].expand(bs, pad)], dim=1)  # [bs, nb * block]: mask_mod may read the tail
    lo, hi = ids.view(bs, nb, block)[..., 0], ids.view(bs, nb, block)[..., -1]  # [bs, nb]
    qi = torch.arange(nb, device=doc.device)[:, None]
    kj = torch.arange(nb, device=doc.device)[None, :]
    lo_q, hi_q, lo_k, hi_k = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    some = (lo_q <= hi_k) & (lo_k <= hi_q) & (kj <= qi)  # [bs, nb, nb]: some pair may attend
    full = (lo_q == hi_q) & (lo_k == hi_k) & (lo_q == lo_k) & (kj < qi)  # every pair attends
    if window is not None:
        some &= (qi - kj) * block - (block - 1) < window  # nearest pair within the window
        full &= (qi - kj) * block + (block - 1) < window  # farthest pair within the window
    if pad:
        full[:, -1, :] = False
        full[:, :, -1] = False
    partial = some & ~full

    def blocks(m):  # -> [bs, 1, nb] counts, [bs, 1, nb, nb] indices (the selected ones first, in order)
        return m.sum(-1).to(torch.int32)[:, None], torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]

    def mask_mod(b, h, q, k):
        keep = (ids[b, q] == ids[b, k]) & (q >= k)
        return keep & (q - k < window) if window is not None else keep

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(sl, sl))


def flex_mask_bytes(seq_len: int, micro_batch: int = 1) -> int:
    """Peak bytes of building one flex_attention document BlockMask for `micro_batch` samples of `seq_len` tokens."""
    nb = -(-seq_len // FLEX_BLOCK)
    return FLEX_MASK_BYTES_PER_PAIR * micro_batch * nb * nb


def check_flex_length(attn: str, seq_len: int, micro_batch: int = 1, where: str = "", cp: int | str = 1) -> None:
    """One-line ValueError where --attn_implementation flex_attention's BlockMask would pass FLEX_MASK_MAX_BYTES on
    a rank: the whole sample's, over the context-parallel factor (rect_block_mask builds each rank's rows; an `auto`
    cp not yet split counts as 1)."""
    cp = cp if isinstance(cp, int) and cp > 0 else 1
    need = flex_mask_bytes(seq_len, micro_batch) // cp
    if attn == "flex_attention" and need > FLEX_MASK_MAX_BYTES:
        longest = math.isqrt(FLEX_MASK_MAX_BYTES * cp // (FLEX_MASK_BYTES_PER_PAIR * micro_batch)) * FLEX_BLOCK
        raise ValueError(f"{where}{': ' if where else ''}--attn_implementation flex_attention at max_seq_length "
                         f"{seq_len:,} (micro-batch {micro_batch}, cp {cp}): its "
                         f"document BlockMask takes {need / 2**30:.1f} GiB a rank, growing with (length / 128)^2, "
                         f"which the memory plan does not count; it takes at most {longest:,} tokens: use "
                         "flash_attention_2 or sdpa, or a larger context_parallel_size")


def _flex_docs(orig, module, query, key, value, docs: Documents, window, kwargs):
    # query [bs, hq, sl, hd]; one BlockMask per window, shared by the layers of a forward and its recompute
    return orig(module, query, key, value, docs.block_mask(window), **kwargs)


# ---- flash_attention_2 / 3 --------------------------------------------------------------------------------

def _flash_docs(orig, module, query, key, value, docs: Documents, window, kwargs):
    # UNTESTED on a GPU here (no GPU). query [bs, hq, sl, hd] -> one packed row [1, hq, bs * sl, hd], cu_seqlens at
    # every document start of every row (built once per micro-batch, on the device); FA applies
    # kwargs["sliding_window"] inside each document itself.
    bs, hq, sl, hd = query.shape
    if docs.bounds is None and bs == 1:
        return orig(module, query, key, value, None, **kwargs)
    cu, longest = docs.varlen()
    kwargs = {k: v for k, v in kwargs.items() if k != "position_ids"}

    def flat(t):  # [bs, h, sl, hd] -> [1, h, bs * sl, hd]
        return t.transpose(0, 1).reshape(1, t.shape[1], bs * sl, t.shape[-1])

    out, weights = orig(module, flat(query), flat(key), flat(value), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=longest, max_length_k=longest, **kwargs)
    return out.reshape(bs, sl, hq, -1), weights  # [1, bs * sl, hq, hd] -> [bs, sl, hq, hd]


_BY_BACKEND = {"sdpa": _sdpa_docs, "flex_attention": _flex_docs, "flash_attention_2": _flash_docs,
               "flash_attention_3": _flash_docs}


def document_masked(attn: str, orig):
    """The core attention function for backend `attn`: `orig` (transformers' own) applied per document."""
    impl = _BY_BACKEND[attn]

    def attention(module, query, key, value, attention_mask, **kwargs):
        _STATE["windows"].add(_window(module, kwargs))
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            # a padding mask or a KV cache (only without SP: Ulysses drops masks): the model's own path
            return orig(module, query, key, value, attention_mask, **kwargs)
        if kwargs.get("position_ids") is None:
            raise ValueError(f"{type(module).__name__} passes no position_ids to its attention function: document "
                             "masking (and Ulysses SP) need them; use a model whose attention forwards **kwargs")
        docs = documents_for(kwargs["position_ids"], query.shape[0])  # built by the first layer only
        window = _window(module, kwargs)
        if window is not None and window >= query.shape[2]:
            window = None
        if kwargs.get("s_aux") is not None and query.device.type == "cpu":  # sinks on CPU: flex cannot (its lse)
            return _sdpa_docs(sinks.sink_sdpa, module, query, key, value, docs, window, kwargs)
        if attn != "flex_attention" and window is None and docs.bounds is None:
            return orig(module, query, key, value, None, **kwargs)  # monotonic positions: one causal call
        return impl(orig, module, query, key, value, docs, window, kwargs)

    return attention


def _no_mask(orig):
    """Mask builder that returns None (the attention function builds its own) unless padding or a cache offset
    is involved, which only the model's own path handles."""
    def build(*args, q_length=None, kv_length=None, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
        if q_length == kv_length and not q_offset and not kv_offset and (attention_mask is None or attention_mask.all()):
            return None
        return orig(*args, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                    attention_mask=attention_mask, **kwargs)

    return build


def resets_positions(setting: str, attn: str) -> bool:
    """Whether position ids restart at every packed document (`--reset_position_ids auto | yes | no`).

    `auto` is yes wherever this module masks documents: every backend in SUPPORTED (sdpa, flex_attention,
    flash_attention_2/3), at every SP degree (train.py registers the document-masked function at SP 1 too,
    and `check_config` refuses any other backend before this is asked). It used to mean flash-attention only,
    from when only FA's varlen path read the restarts; sdpa and flex then attended across documents by default.
    A model with its own attention code is refused by `check_routed`, not masked wrongly."""
    if setting not in ("auto", "yes", "no"):
        raise ValueError(f"--reset_position_ids {setting!r}: use auto, yes or no")
    return setting == "yes" or (setting == "auto" and attn in SUPPORTED)


def register(model, attn: str) -> None:
    """Put the document-masked function for `attn` in ALL_ATTENTION_FUNCTIONS (and skip the model's own sdpa /
    flex mask). Call before Ulysses registers, which then wraps it; ulysses.register checks the model first
    (families.check_supported)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    restore()
    orig = ALL_ATTENTION_FUNCTIONS[attn]
    _ORIGINAL[("attn", attn)] = orig
    ALL_ATTENTION_FUNCTIONS[attn] = document_masked(attn, orig)
    if attn in ("sdpa", "flex_attention"):
        _ORIGINAL[("mask", attn)] = ALL_MASK_ATTENTION_FUNCTIONS[attn]
        ALL_MASK_ATTENTION_FUNCTIONS[attn] = _no_mask(ALL_MASK_ATTENTION_FUNCTIONS[attn])


def track(model, attn: str) -> None:
    """Record every module that calls the (outermost) registered attention function, for `check_routed`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[attn]

    def tracked(module, *args, **kwargs):
        _STATE["modules"].add(id(getattr(module, "_chunk_of", module)))  # a head chunk's view counts as its module
        _STATE["calls"] += 1
        _OUTER.append(kwargs.get("position_ids"))  # the key of this micro-batch's Documents (documents_for)
        try:
            return inner(module, *args, **kwargs)
        finally:
            _OUTER.pop()

    ALL_ATTENTION_FUNCTIONS[attn] = tracked
    _STATE.update(attn=attn, modules=set(), calls=0, windows=set())


def check_routed(model) -> None:
    """After the first forward: every decoder layer's attention went through the registered function (Ulysses
    + document masking), and a sliding-window model's window reached it. One-line ValueError otherwise."""
    model = getattr(model, "module", model)  # a DeepSpeed engine
    cfg = model.config.get_text_config()
    linear = sum(t == "linear_attention" for t in getattr(cfg, "layer_types", None) or ())  # linear_attention.py's
    name, want, seen = type(model).__name__, cfg.num_hidden_layers - linear, len(_STATE["modules"])
    if seen != want:
        raise ValueError(f"{name}: {seen} of its {want} attention layers called the registered "
                         f"{_STATE['attn']!r} attention function, so the others bypass Ulysses sequence parallelism "
                         "and document masking (attending only within their shard); use a model whose attention "
                         "calls transformers' ALL_ATTENTION_FUNCTIONS, or sequence_parallel_size 1 with "
                         "reset_position_ids no")
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"]
    if getattr(cfg, "sliding_window", None) and "sliding_attention" in types and _STATE["windows"] == {None}:
        raise ValueError(f"{name}: config.sliding_window={cfg.sliding_window} but no attention call received a "
                         "window (neither kwargs['sliding_window'] nor module.sliding_window): it would be lost; "
                         "set sliding_window to null for full attention")


def restore() -> None:
    """Put back transformers' own attention and mask functions."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for (kind, name), fn in _ORIGINAL.items():
        (ALL_ATTENTION_FUNCTIONS if kind == "attn" else ALL_MASK_ATTENTION_FUNCTIONS)[name] = fn
    _ORIGINAL.clear()
    _DOCS.clear()
