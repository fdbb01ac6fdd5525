"""Per-phase memory of one train.py rank for bench.gpu's long-length sections (issue 43): imported by
bench/gpu_site/sitecustomize.py in the ranks of those launches only (BENCH_GPU_PHASES=<file>), never by the product.

It changes no computation: global module forward hooks (which return nothing), gradient hooks on the outputs of
the attention, the MLP and the two RMSNorms of each decoder layer (which return nothing), and a wrapper around
torch.utils.checkpoint.checkpoint that calls the same function. At every event it reads the device's peak since
the previous event and resets it (torch.cuda.max_memory_allocated / max_memory_reserved, reset_peak_memory_stats;
on a CPU dry run the process' VmHWM, reset through /proc/self/clear_refs), so each phase's peak is exact over its
events. Phases, per decoder layer i (one JSON line per closed phase in BENCH_GPU_PHASES):

- `forward`: the layer's forward (its __call__, pre-hook to hook);
- `recompute`: a checkpointed layer's forward run again in backward (the function torch.utils.checkpoint calls the
  second time; a `finally` closes it even when torch's early stop ends it with an exception);
- `mlp_backward`: from the gradient of the MLP's output to that of its input (the post-attention norm's output);
  a checkpointed layer's recompute runs inside it (at the first saved tensor it unpacks): `peak` counts only the
  events where no inner phase was open, `peak_incl` all of them;
- `attention_backward`: from the gradient of the attention output to that of its input (the input norm's output).

Segments while no phase is open (the embedding, the logits and loss, the optimizer step, an engine build) are
written as `between` records naming the events around them; the last one is written at the rank's exit (atexit).
Every record carries its process id (a subprocess a rank starts inherits the hooks and writes its own short
records: bench.gpu_compare.read_probe keeps the rank's), its time, the process RSS and peak RSS (VmHWM, GPU runs) and
torch.cuda.host_memory_stats()' pinned bytes (GPU only) at its end: bench.gpu takes the most the caching host
allocator held (it keeps freed blocks) and the peak RSS over the step; and `arena`: the bytes base/host_arena.py
holds page-locked at their exact size (the offloaded checkpoints, the async save's copy of GPU states: registered
with cudaHostRegister, so not in host_memory_stats), what its fallback pinned instead, and which path ran. train.py's own peak_mem_gb reads
max_memory_allocated since this probe's last reset, so bench.gpu takes the step's peak from these records (the
max over all of them: every segment is in one).
Which attention kernel ran (issue 49): torch.nn.functional.scaled_dot_product_attention is wrapped to count, per
backend its default dispatch picks for the call's arguments (torch._fused_sdp_choice: the same C++ selection the call
then runs), the calls and the first call's shapes; flash-attn's entry points where installed (the public functions
under both names transformers and we import them by, and the ring's private varlen op), the same way. Every
record carries the counts so far (`attention_kernels`).
Cost: two procfs reads or two CUDA stat calls per event, a few dozen events per step; one dispatch query per
attention call (a few microseconds; 32 head chunks x 2 layers x (forward + recompute) calls a step here).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time

import torch

ROLES = ("attn", "mlp", "attn_in", "mlp_in")


def _rss() -> int:
    """VmRSS now: base.host's reader of /proc/self/status, the one the stage end's record reads too."""
    from base.host import rss_bytes

    return rss_bytes()


def _hwm() -> int:
    from base.host import peak_rss_bytes

    return peak_rss_bytes()


def pinned_stats() -> dict:
    """The caching host allocator's pinned bytes (held = active + cached, rounded blocks), {} where torch has none."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    try:
        s = torch.cuda.host_memory_stats()
    except Exception:  # an older torch without the host stats
        return {}
    keys = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "active_bytes.peak",
            "allocations.current", "num_host_alloc")
    return {k: int(s[k]) for k in keys if k in s}


def arena_stats() -> dict:
    """base/host_arena.STATS (registered_bytes, fallback_pinned_bytes, fallbacks, registrations) and its path():
    "registered", "pinned-fallback" (registration failed: torch's rounded blocks) or "pageable" (no CUDA)."""
    from base import host_arena

    return {**host_arena.STATS, "path": host_arena.path()}


class Probe:
    def __init__(self, path: str):
        self.path = path
        self.cuda = torch.cuda.is_available()
        self.stack: list[dict] = []  # open phases, innermost last
        self.roles: dict[int, tuple[str, int]] = {}  # id(module) -> (role, layer)
        self.step_alloc = self.step_reserved = 0
        self.events = 0
        self.errors: list[str] = []
        self.t0 = time.time()
        self.last = "start"  # the previous event, for the segments outside every phase

    # --- the counter --------------------------------------------------------------------------------------
    def _segment(self) -> tuple[int, int]:
        """(allocated, reserved) peak bytes since the previous event; starts the next segment."""
        if self.cuda:
            a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            return a, r
        a = _hwm()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass
        return a, a

    def event(self, kind: str, phase: str, layer: int) -> None:
        try:
            a, r = self._segment()
            self.events += 1
            self.step_alloc, self.step_reserved = max(self.step_alloc, a), max(self.step_reserved, r)
            label = f"{kind} {phase} L{layer}"
            if kind == "open" and phase == "forward" and layer == 0 and self.stack:
                # a step's first layer opens with nothing open: a phase still open here lost its closing event (and
                # with it every `between` record since): named, and closed so the next step is measured whole
                self.errors.append("left open at a step's start: " + ", ".join(
                    f"{p['phase']} L{p['layer']} (opened at {p['t_open']} s)" for p in self.stack))
                self.stack.clear()
            if not self.stack:  # outside every phase: the embedding, the logits and loss, the optimizer step
                self.write({"phase": "between", "layer": -1, "after": self.last, "before": label, "peak": a,
                            "reserved": r, "peak_incl": a, "reserved_incl": r})
            self.last = label
            for i, p in enumerate(self.stack):
                p["peak_incl"], p["reserved_incl"] = max(p["peak_incl"], a), max(p["reserved_incl"], r)
                if i == len(self.stack) - 1:  # the innermost open phase owns the segment
                    p["peak"], p["reserved"] = max(p["peak"], a), max(p["reserved"], r)
            if kind == "open":
                self.stack.append({"phase": phase, "layer": layer, "peak": 0, "reserved": 0, "peak_incl": 0,
                                   "reserved_incl": 0, "t_open": round(time.time() - self.t0, 3)})
                return
            for i in range(len(self.stack) - 1, -1, -1):
                if self.stack[i]["phase"] == phase and self.stack[i]["layer"] == layer:
                    self.write(self.stack.pop(i))
                    return
        except Exception as e:  # a measurement error is recorded, never raised into the run
            self.errors.append(f"{type(e).__name__}: {e}"[:300])

    def write(self, rec: dict) -> None:
        rec.update(pid=os.getpid(), time=time.time(), t_close=round(time.time() - self.t0, 3), rss=_rss(),
                   open=[f"{p['phase']} L{p['layer']}" for p in self.stack],  # the phases still open (diagnosis)
                   pinned=pinned_stats(), arena=arena_stats(),
                   rss_hwm=_hwm() if self.cuda else None,  # the process' peak RSS (the CPU stand-in resets it)
                   attention_kernels=dict(KERNELS), step_peak=self.step_alloc, step_reserved=self.step_reserved, events=self.events,
                   errors=self.errors[-3:])
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # --- hooks --------------------------------------------------------------------------------------------
    def _learn(self, layer_module) -> None:
        idx = getattr(getattr(layer_module, "self_attn", None), "layer_idx", None)
        if idx is None:
            idx = len({v[1] for v in self.roles.values()})
        for role, name in zip(ROLES, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            m = getattr(layer_module, name, None)
            if m is not None:
                self.roles[id(m)] = (role, idx)
        self.roles[id(layer_module)] = ("layer", idx)

    def _grad_hook(self, t, kind: str, phase: str, layer: int) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            t.register_hook(lambda g: self.event(kind, phase, layer))

    def pre_hook(self, module, args) -> None:
        if self.recomputing or not torch.is_grad_enabled():
            return
        if type(module).__name__.endswith("DecoderLayer"):
            if id(module) not in self.roles:
                self._learn(module)
            self.event("open", "forward", self.roles[id(module)][1])

    def post_hook(self, module, args, output) -> None:
        if self.recomputing or not torch.is_grad_enabled():
            return
        role, layer = self.roles.get(id(module), (None, -1))
        if role is None:
            return
        out = output[0] if isinstance(output, tuple) else output
        try:
            if role == "layer":
                self.event("close", "forward", layer)
            elif role == "mlp":
                self._grad_hook(out, "open", "mlp_backward", layer)
            elif role == "mlp_in":
                self._grad_hook(out, "close", "mlp_backward", layer)
            elif role == "attn":
                self._grad_hook(out, "open", "attention_backward", layer)
            elif role == "attn_in":
                self._grad_hook(out, "close", "attention_backward", layer)
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:300])

    recomputing = 0

    def wrap_checkpoint(self, real):
        probe = self

        @functools.wraps(real)
        def checkpoint(function, *args, **kwargs):
            calls = [0]
            layer = getattr(getattr(function, "args", [None])[0] if isinstance(function, functools.partial) else
                            getattr(function, "__self__", None), "self_attn", None)
            idx = getattr(layer, "layer_idx", -1)

            def traced(*a, **k):
                calls[0] += 1
                if calls[0] == 1:  # the forward itself
                    return function(*a, **k)
                probe.event("open", "recompute", idx)
                probe.recomputing += 1
                try:
                    return function(*a, **k)
                finally:
                    probe.recomputing -= 1
                    probe.event("close", "recompute", idx)

            return real(traced, *args, **kwargs)

        return checkpoint


KERNELS: dict = {}  # "sdpa:<backend>" or "flash_attn:<function>" -> {"calls", "first": shapes and dtype}


def _count(key: str, tensors) -> None:
    k = KERNELS.setdefault(key, {"calls": 0})
    k["calls"] += 1
    if "first" not in k and len(tensors):  # bench/gpu_page.py reads q's and k's shapes from it
        k["first"] = [list(t.shape) for t in tensors[:3]] + [str(tensors[0].dtype).removeprefix("torch.")]


# flash-attn's entry points counted: the public functions (transformers calls them through the package, whose
# __init__ re-exports them from flash_attn_interface, so both modules' names are wrapped) and the private varlen ops
# the context-parallel ring imports from flash_attn_interface at each call (model_utils/ring_attention.py). The public
# functions reach their kernels through names bound at import (`_wrapped_flash_attn_*`), so no call counts twice.
FLASH_PUBLIC = ("flash_attn_func", "flash_attn_varlen_func")
FLASH_PRIVATE = ("_flash_attn_varlen_forward",)


def _counted(inner, fn: str):
    @functools.wraps(inner, updated=())  # the private op is a torch CustomOpDef: its __dict__ is not copied
    def counted(*a, **k):
        try:
            tensors = [x for x in (*a, *(k.get(n) for n in ("q", "k", "v"))) if hasattr(x, "shape")]
            _count(f"flash_attn:{fn}", tensors)
        except Exception:  # counting never breaks the call
            pass
        return inner(*a, **k)

    counted._counted = True
    return counted


def wrap_flash_attn() -> None:
    """Count flash-attn's calls at every name our code and transformers call it by (nothing where it is absent)."""
    import sys

    try:
        import flash_attn.flash_attn_interface as fai
    except ImportError:
        return
    pkg = sys.modules.get("flash_attn")
    for fn in FLASH_PUBLIC + FLASH_PRIVATE:
        inner = getattr(fai, fn, None)
        if inner is None or getattr(inner, "_counted", False):
            continue
        wrapped = _counted(inner, fn)
        setattr(fai, fn, wrapped)
        if fn in FLASH_PUBLIC and getattr(pkg, fn, None) is inner:  # `from flash_attn import flash_attn_func`
            setattr(pkg, fn, wrapped)


def wrap_sdpa() -> None:
    """Count SDPA's calls by the backend its dispatch picks (bench/gpu_kernels.sdpa_choice); flash-attn's too."""
    import torch.nn.functional as F

    from bench.gpu_kernels import sdpa_choice

    real = F.scaled_dot_product_attention

    @functools.wraps(real)
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        try:
            name = sdpa_choice(query, key, value, is_causal, attn_mask, bool(kwargs.get("enable_gqa")))
            _count(f"sdpa:{name}" + (" (masked)" if attn_mask is not None else ""), (query, key, value))
        except Exception:
            pass
        return real(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    wrap_flash_attn()


def install(path: str) -> Probe:
    """Hooks for the whole process (call before transformers is imported: it binds torch's checkpoint then)."""
    import torch.utils.checkpoint as tuc
    from torch.nn.modules import module as nn_module

    probe = Probe(path)
    wrap_sdpa()
    tuc.checkpoint = probe.wrap_checkpoint(tuc.checkpoint)
    nn_module.register_module_forward_pre_hook(probe.pre_hook)
    nn_module.register_module_forward_hook(probe.post_hook)
    # the last segment (the optimizer step, the stage's end) and the host memory after the step, at a normal exit
    atexit.register(lambda: probe.event("close", "exit", -1))
    return probe
