"""Live tensor bytes, exactly, on CPU: the counterpart of torch.cuda.memory_allocated / max_memory_allocated for the
planner's per-phase figures (issue 43), without a GPU.

`LiveBytes` is a TorchDispatchMode that sees every aten op below autograd (forward, backward, recompute: the
autograd engine runs a CPU backward on the calling thread with the mode active) and tracks each NEW storage an op
returns (an output that aliases one of the op's inputs, a view or an in-place result, is not new) until that storage
dies (weakref.finalize on the storage object, which torch keeps as long as the storage lives). `current` is the sum of
the live tracked storages' bytes, `peak` its maximum since the last `reset_peak()`: what a CUDA caching allocator
reports as allocated, less its 512 B rounding, for the tensors created while the mode is on. Not seen: a kernel's
internal scratch that never leaves the op (FlashAttention's dq accumulator inside one CUDA call, say) and tensors
created before the mode (the model's weights: the baseline).

`phase_peaks(model, run)` runs `run()` (one forward + backward) under the mode with bench/gpu_probe.py's phase hooks
(each decoder layer's forward, a checkpointed layer's recompute, MLP backward, attention backward, and the segments
between them, such as the logits and loss), the probe's segment counter reading this tracker instead of the GPU's: the
same records bench.gpu_compare.compare reads from a GPU run, in bytes above what was live before `run()`.
Cost: a Python call per aten op (a tiny 2-layer model's step: a few thousand ops, seconds).

    from bench.live_bytes import LiveBytes, phase_peaks
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> int:
        """The peak since the previous reset; the next one starts at the bytes live now."""
        peak, self.peak = self.peak, self.current
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            key, n = s.data_ptr(), s.nbytes()
            if n == 0 or key in ins or key in self.live:
                continue
            self.live[key] = n
            self.current += n
            weakref.finalize(s, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


def phase_peaks(model, run) -> list[dict]:
    """Per-phase peaks of `run()` (bytes above those live before it), as bench/gpu_probe.py's records: `phase`
    (forward, recompute, mlp_backward, attention_backward, between), `layer`, `peak` (the segments where no inner
    phase was open), `peak_incl`. `model`'s checkpointed layers (transformers' `_gradient_checkpointing_func`) are
    wrapped for the run's duration, as the probe wraps torch's checkpoint in a train.py rank."""
    from torch.nn.modules import module as nn_module

    from bench import gpu_probe

    records: list[dict] = []
    mode = LiveBytes()

    class _Probe(gpu_probe.Probe):
        def _segment(self):
            p = mode.reset_peak()
            return p, p

        def write(self, rec):
            records.append(dict(rec))

    probe = _Probe("")
    probe.cuda = False
    wrapped = [(m, m._gradient_checkpointing_func) for m in model.modules()
               if getattr(m, "_gradient_checkpointing_func", None) is not None]
    for m, real in wrapped:
        m._gradient_checkpointing_func = probe.wrap_checkpoint(real)
    handles = [nn_module.register_module_forward_pre_hook(probe.pre_hook),
               nn_module.register_module_forward_hook(probe.post_hook)]
    try:
        with mode:
            run()
            probe.event("close", "exit", -1)
    finally:
        for m, real in wrapped:
            m._gradient_checkpointing_func = real
        for h in handles:
            h.remove()
    if probe.errors:
        raise RuntimeError(f"phase hooks failed: {probe.errors}")
    return [{k: r[k] for k in ("phase", "layer", "peak", "peak_incl", "reserved", "reserved_incl")}
            | ({"after": r["after"]} if "after" in r else {}) for r in records]
