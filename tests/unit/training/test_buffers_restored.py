"""A resume at another world size restores the model's persistent buffers (training/buffers.py): DeepSpeed's universal
load restores parameters only, so a router's `e_score_correction_bias` (GLM-4.5-Air, DeepSeek-V3, ...) kept its
initial zeros from the first resumed step on. Here through Checkpointer.load with a stand-in engine that returns what
DeepSpeed 0.19.8's load_checkpoint returns (the model-states file it read, `buffer_names` in the client state) and,
like it on the universal path, restores no buffer itself."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.unit.training.test_checkpoint import MODEL_FILE, FakeConfig, FakeEngine, LoadEngine, fake_converter
from training.buffers import restore_buffers
from training.checkpoint import MANIFEST, Checkpointer

BIAS = "gate.e_score_correction_bias"
SAVED = torch.tensor([0.5, -0.5, 0.25, -0.25])


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 8))
        self.register_buffer("e_score_correction_bias", torch.zeros(4))  # persistent, as transformers' glm4_moe
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Router()


def _states(bias=SAVED) -> dict:
    """A ZeRO-3 model-states file as DeepSpeed writes it: parameters as empty placeholders, buffers whole."""
    return {"module": {"gate.weight": torch.empty(0), BIAS: bias.clone()}, "buffer_names": [BIAS],
            "param_shapes": [{"gate.weight": torch.Size([4, 8])}], "ds_version": "0.19.8"}


class StatesEngine(FakeEngine):
    def save_checkpoint(self, root, tag, save_latest):
        torch.save(_states(), os.path.join(root, tag, MODEL_FILE))


class UniversalEngine(LoadEngine):
    """DeepSpeed's engine on the universal path: reads the model-states file, restores no buffer."""

    def __init__(self):
        super().__init__()
        self.module = Model()

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states):
        path = os.path.join(load_dir, tag, MODEL_FILE)
        self.loaded.append((self._config.load_universal_checkpoint, b""))
        return path, {"buffer_names": torch.load(path, weights_only=False)["buffer_names"]}


def test_a_universal_load_restores_the_persistent_buffers(tmp_path, monkeypatch):
    calls = fake_converter(monkeypatch)
    ck = Checkpointer(str(tmp_path / "run"), keep=3)
    source = ck.save(StatesEngine(), 4, {"step": 4}, {"sampler": {}}, FakeConfig())
    manifest = json.loads(open(os.path.join(source, MANIFEST)).read())
    manifest["world"] = 2  # written by 2 ranks, resumed by 1: a universal load
    with open(os.path.join(source, MANIFEST), "w") as fh:
        json.dump(manifest, fh)
    engine = UniversalEngine()
    ck.load(engine, source)
    assert len(calls) == 1 and engine.loaded[0][0] is True
    assert torch.equal(engine.module.gate.e_score_correction_bias, SAVED)  # zeros before the fix
    assert torch.equal(engine.module.gate.inv_freq, torch.ones(2))  # not persistent: not in the file, untouched


def test_nothing_is_read_without_buffers(tmp_path):
    """A model without persistent buffers (Llama): no file read, no collective."""
    assert restore_buffers(UniversalEngine(), str(tmp_path / "absent.pt"), []) == 0


@pytest.mark.parametrize("states, said", [
    ({"module": {"gate.other": torch.zeros(4)}, "buffer_names": ["gate.other"]}, "is not a buffer of this model"),
    (_states(torch.zeros(5)), "has shape (4,) in this model"),
    ({"module": {}, "buffer_names": [BIAS]}, "does not hold it"),
], ids=["missing_in_model", "other_shape", "missing_in_file"])
def test_a_buffer_that_does_not_fit_is_refused_in_one_line(tmp_path, states, said):
    path = str(tmp_path / MODEL_FILE)
    torch.save(states, path)
    engine = UniversalEngine()
    with pytest.raises(ValueError) as e:
        restore_buffers(engine, path, states["buffer_names"])
    assert said in str(e.value) and "\n" not in str(e.value)
    assert torch.equal(engine.module.gate.e_score_correction_bias, torch.zeros(4))
