"""Communication of sequence parallelism per decoder layer and rank, sp = u x cp, and whether compute hides it.

Two factors (base.parallel: SP groups are consecutive ranks, Ulysses groups consecutive inside them):
- Ulysses (u ranks, consecutive): one all-to-all of q, k, v before attention and one of the output after it,
  mirrored in backward (dO, then dq, dk, dv). Per rank it sends (u-1)/u of its [T, nh + 2*kv_send, d] and of its
  [T, nh, d]. Inside a node (u | gpus_per_node) it runs over NVLink.
- Context parallelism (cp ranks at stride u): an all-gather of K and V ([S, kv_loc, d] each once gathered) in
  forward and a reduce-scatter of dK and dV in backward; (cp-1)/cp of the gathered size per rank each way. Over
  InfiniBand when the cp group crosses nodes (sp > gpus_per_node), over NVLink when it does not.
A checkpointed layer's recompute repeats the forward's collectives.

Times are bytes / the link's per-GPU bandwidth in one direction (NVLINK_BYTES_PER_S, IB_BYTES_PER_S): nominal
figures, no latency or protocol overhead, so a lower bound (NCCL reaches roughly 70-90% of them on large
messages). An all-to-all whose group spans nodes sends part of its bytes over each link; both run at once, the
slower sets the time. A ring collective that crosses nodes runs at the InfiniBand hop's speed. Compute comes
from the FLOP model (planner.flops.flops_per_sequence: attention 6*nh*d*s^2 per layer and step, causal,
forward : backward = 1 : 2; the zigzag layout gives every rank 1/sp of it) at MFU x peak.

    from planner.comm_model import layer_comm
    layer_comm(load_shape("llama3-8b"), 2**20, sp=32, cp=4, gpus_per_node=8)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from planner.memory_model import DTYPE_BYTES, ModelShape, attention_split, tokens_per_rank

# H100 SXM5: NVLink 4, 18 links x 25 GB/s per direction = 450 GB/s per GPU each way (NVIDIA's H100 datasheet quotes
# "900 GB/s", both directions together).
NVLINK_BYTES_PER_S = 450e9
# DGX H100 / HGX H100 clusters: one ConnectX-7 NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s each way (NVIDIA
# DGX H100 user guide: 8 single-port ConnectX-7 for the compute fabric). About 9x below NVLink per GPU.
IB_BYTES_PER_S = 50e9
MFU, PEAK_TFLOPS = 0.4, 989.0  # the H100 bf16 figures planner.auto_features and scripts/plan.py use


@dataclass(frozen=True)
class Collective:
    """One collective of a decoder layer on one rank: bytes it sends in forward and backward, link, seconds."""

    name: str
    group: int  # ranks in the group
    link: str  # "NVLink", "IB" or "NVLink+IB" (an all-to-all spanning nodes uses both)
    fwd_bytes: int
    bwd_bytes: int
    fwd_s: float
    bwd_s: float


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's `size` ranks (spaced `stride` apart, the first at a multiple of size * stride) share
    a node of `gpus_per_node` consecutive ranks. Ulysses groups: stride 1; cp groups: stride u."""
    if gpus_per_node <= 0:
        return size  # one machine
    if gpus_per_node % stride:
        return 1
    return math.gcd(size, gpus_per_node // stride)


def _link(size: int, per_node: int) -> str:
    return "NVLink" if per_node >= size else ("IB" if per_node == 1 else "NVLink+IB")


def all_to_all_seconds(local_bytes: int, size: int, per_node: int) -> float:
    """An all-to-all of a rank's `local_bytes`: 1/size stays, (per_node - 1)/size goes over NVLink, the rest over
    InfiniBand, at the same time."""
    nvl = local_bytes * (per_node - 1) / size / NVLINK_BYTES_PER_S
    ib = local_bytes * (size - per_node) / size / IB_BYTES_PER_S
    return max(nvl, ib)


def ring_seconds(full_bytes: int, size: int, per_node: int) -> float:
    """An all-gather (or reduce-scatter) whose gathered tensor is `full_bytes`: (size-1)/size of it passes each
    rank's link; the ring runs at its slowest hop (InfiniBand once the group crosses nodes)."""
    return full_bytes * (size - 1) / size / (NVLINK_BYTES_PER_S if per_node >= size else IB_BYTES_PER_S)


def layer_collectives(shape: ModelShape, seq_len: int, sp: int, cp: int = 1, gpus_per_node: int = 8,
                      precision: str = "bf16", ring: bool = False) -> list[Collective]:
    """The SP collectives of one decoder layer on one rank (empty at sp = 1).

    Llama-3-8B, 1M tokens, 32 ranks on 4 nodes of 8 (bf16): as u=8 x cp=4 the all-to-all sends 0.59 GB per pass
    over NVLink (1.3 ms) and the K/V all-gather 0.40 GB over IB (8.1 ms); as pure Ulysses sp=32 the all-to-all
    sends 1.04 GB, 0.81 GB of it over IB (16.1 ms). Qwen2.5-7B at 1M, 4 x 2 inside each node: all-to-all 1.61 GB
    (3.6 ms), K/V all-gather 0.27 GB (0.6 ms), NVLink only. Backward: the same again.
    ring (model_utils/ring_attention.py): forward passes the same K/V bytes in cp - 1 hops of one block; backward
    passes K/V again and dK/dV in cp hops (the compute dtype): the gather's bytes plus the whole gathered size, 2x.
    Each hop starts before its step's attention and is waited after it, so a hop is hidden when it is shorter than
    1/cp of the pass's attention (at 16M on 8 x 4: 0.04 s per 2 GiB block over IB against ~11 s per step)."""
    if sp == 1:
        return []
    b = DTYPE_BYTES[precision]
    u, _, kv_loc = attention_split(shape, sp, cp)
    tokens = tokens_per_rank(seq_len, sp, cp)
    d, nh = shape.head_dim, shape.num_heads
    out = []
    if u > 1:
        kv_send = max(shape.num_kv_heads, u)  # KV heads replicated up to u before the all-to-all
        local = tokens * d * b * (2 * nh + 2 * kv_send)  # q, k, v in and o out (backward: dO in, dq, dk, dv out)
        m = members_per_node(u, 1, gpus_per_node)
        sent = local * (u - 1) // u
        t = all_to_all_seconds(local, u, m)
        out.append(Collective("ulysses all-to-all q,k,v + o", u, _link(u, m), sent, sent, t, t))
    if cp > 1:
        full = 2 * tokens * sp * kv_loc * d * b  # K and V of the whole sequence: [S, kv_loc, d] each
        m = members_per_node(cp, u, gpus_per_node)
        sent = full * (cp - 1) // cp
        t = ring_seconds(full, cp, m)
        if ring:
            t_bwd = t + full / (NVLINK_BYTES_PER_S if m >= cp else IB_BYTES_PER_S)
            out.append(Collective("cp ring K,V / K,V + dK,dV", cp, _link(cp, m), sent, sent + full, t, t_bwd))
        else:
            out.append(Collective("cp all-gather K,V / reduce-scatter dK,dV", cp, _link(cp, m), sent, sent, t, t))
    return out


def layer_compute_seconds(shape: ModelShape, seq_len: int, sp: int, mfu: float = MFU,
                          peak_tflops: float = PEAK_TFLOPS) -> dict[str, float]:
    """Seconds of one decoder layer on one rank from the FLOP model: attention (causal; the average layer's where
    some have a sliding window) and the dense part (projections and MLP), forward and backward (2x forward).
    Recompute not included."""
    rate = mfu * peak_tflops * 1e12
    share = shape.causal_attention_layers(seq_len) / shape.num_layers  # 1.0 without windows
    attn_fwd = 2.0 * shape.num_heads * shape.head_dim * seq_len**2 * share / sp / rate
    dense_fwd = 2.0 * shape.layer_params() * seq_len / sp / rate
    return {"attention_fwd_s": attn_fwd, "attention_bwd_s": 2 * attn_fwd,
            "dense_fwd_s": dense_fwd, "dense_bwd_s": 2 * dense_fwd}


def layer_comm(shape: ModelShape, seq_len: int, sp: int, cp: int = 1, gpus_per_node: int = 8,
               precision: str = "bf16", mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS, ring: bool = False) -> dict:
    """Per layer and rank: the collectives, their total seconds per forward and backward, the compute they sit
    next to, and
    - `hidden`: every pass's communication is shorter than that pass's attention compute, so an implementation
      that overlaps them (the K/V gather with the local chunk's attention, the next layer's all-to-all with this
      one's MLP) can hide it;
    - `exposed_share`: the share of the layer's time it takes if nothing overlaps (DeepSpeed's all-to-all is
      synchronous), comm / (comm + compute)."""
    colls = layer_collectives(shape, seq_len, sp, cp, gpus_per_node, precision, ring)  # ring: ring_attention
    comp = layer_compute_seconds(shape, seq_len, sp, mfu, peak_tflops)
    fwd = sum(c.fwd_s for c in colls)
    bwd = sum(c.bwd_s for c in colls)
    compute = sum(comp.values())
    return {"ulysses": sp // cp, "cp": cp, "collectives": [asdict(c) for c in colls],
            "fwd_bytes": sum(c.fwd_bytes for c in colls), "bwd_bytes": sum(c.bwd_bytes for c in colls),
            "fwd_s": fwd, "bwd_s": bwd, **comp, "compute_s": compute,
            "hidden": fwd <= comp["attention_fwd_s"] and bwd <= comp["attention_bwd_s"],
            "exposed_share": (fwd + bwd) / (fwd + bwd + compute)}
