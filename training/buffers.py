"""A model's persistent buffers after a load through DeepSpeed's universal checkpoint (another world size).

DeepSpeed 0.19.8's `_load_checkpoint` skips `load_module_state_dict` on the universal path (runtime/engine.py ~4662),
the only place a module's buffers come back: the universal path restores parameters (zero/*) only. A resumed model is
built from its config (model_utils/build.py, `pretrained=False`), so every persistent buffer kept its initial value:
the router's `e_score_correction_bias` of GLM-4.5/4.6-Air, DeepSeek-V3, MiniMax-M2, dots1, Kimi-K2 (zeros), dense
Gemma-4's `layer_scalar` (ones). Routing changed from the first resumed step and the export wrote the zeros. A load
of the same world size restores them itself (DeepSpeed's strict `load_state_dict`).

The values are in the model-states file DeepSpeed just read (`ds_to_universal` copies rank 0's into the
conversion): its `module` state dict holds each persistent buffer whole (ZeRO-3 partitions parameters only; there
they are empty placeholders) and `buffer_names` lists them. Every rank holds its own whole copy of each buffer, so
every rank sets all of them.

Cost: a model without persistent buffers (Llama-3-8B: its rotary `inv_freq` is not persistent) reads nothing and
makes no collective, at any world size. Otherwise rank 0 reads the model-states file once more (~100 KB at 8B: empty
placeholders, the buffers, the parameter shapes; DeepSpeed read it on every rank just before, so its node's page cache
serves it) and broadcasts the buffers on the host gloo group (base/comm.run_on_main): DeepSeek-V3's 58 routers x 256
fp32 = 59 KB, to 511 other ranks on a 512-rank job well under a second, once per load at another world size.
"""

from __future__ import annotations

import torch

from base import comm
from base.log import print0


def read_buffers(model_states: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the `module` state dict in DeepSpeed's model-states file `model_states`, on the CPU."""
    module = torch.load(model_states, map_location="cpu", weights_only=False)["module"]
    missing = [n for n in names if n not in module]
    if missing:
        raise ValueError(f"checkpoint file {model_states} lists buffer {missing[0]} in buffer_names but does not hold "
                         "it: the checkpoint is damaged; resume from another checkpoint or at the world size that "
                         "saved it")
    return {n: module[n].detach().clone() for n in names}


def restore_buffers(engine, model_states: str, names: list[str]) -> int:
    """After a universal load: set every persistent buffer named in the checkpoint (`names`: its `buffer_names`,
    returned by DeepSpeed's load_checkpoint as client state) to its saved value from `model_states` (the file DeepSpeed
    loaded), on every rank. A buffer the model lacks, or of another shape, is refused in one line. Returns how many
    were set. Collective when `names` is not empty (the same on every rank: one file)."""
    if not names:
        return 0
    saved = comm.run_on_main(lambda: read_buffers(model_states, list(names)))
    module = engine.module
    for name, value in saved.items():
        try:
            buf = module.get_buffer(name)
        except AttributeError:
            buf = None
        if buf is None or tuple(buf.shape) != tuple(value.shape):
            here = "is not a buffer of this model" if buf is None else f"has shape {tuple(buf.shape)} in this model"
            raise ValueError(f"checkpoint {model_states}: buffer {name} (shape {tuple(value.shape)}) {here}: resume "
                             "with the model (and transformers version) that saved it")
        with torch.no_grad():
            buf.copy_(value)
    print0(f"restored {len(saved)} persistent buffer(s) of the model from {model_states} (a universal load restores "
           "parameters only)")
    return len(saved)
