"""RequestStateStore and the rule that stateful decoders need a DecoderBatchProcessor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec.core.batch_processor import DecoderBatchProcessor
from specdec.core.pipeline_model import RuntimeConfig, registered_pipeline_model
from specdec.core.registry import Role, register
from specdec.core.state_store import RequestStateStore, StateSpec
from specdec.models.llama import LlamaDecoder


def test_allocate_release_gather_scatter() -> None:
    store = RequestStateStore(
        [StateSpec("accepted", torch.long), StateSpec("draft", torch.long, ("gamma",), fill=-1)],
        max_batch_size=3,
        dims={"gamma": 4},
    )
    assert store.tensors["draft"].shape == (3, 4)  # [max_batch_size, gamma]
    a, b = store.allocate("a"), store.allocate("b")
    assert (a, b) == (0, 1) and store.num_free == 1
    slots = torch.tensor([b, a])
    store.scatter("accepted", slots, torch.tensor([7, 5]))
    assert store.gather("accepted", torch.tensor([a, b])).tolist() == [5, 7]
    store.release(a)
    c = store.allocate("c")  # a's slot is reused and reset to the fill value
    assert c == a and store.tensors["accepted"][c].item() == 0
    assert store.tensors["draft"][c].tolist() == [-1, -1, -1, -1]
    assert store.bounded_dims() == {"max_batch_size": 3, "gamma": 4}
    store.allocate("d")
    with pytest.raises(RuntimeError, match="'e'"):
        store.allocate("e")  # full: names the request it cannot admit
    with pytest.raises(KeyError):
        store.release(7)


def test_unbound_dim_is_named() -> None:
    with pytest.raises(ValueError, match="'gamma'"):
        RequestStateStore([StateSpec("draft", torch.long, ("gamma",))], max_batch_size=2)


@register(Role.DECODER, "StatefulLlamaForTest")
class StatefulLlama(LlamaDecoder):
    """A Llama that carries its last hidden state between steps (as EAGLE will)."""

    @classmethod
    def state_store(cls, config, *, max_batch_size, devices):
        return [StateSpec("last_hidden", torch.float32, (config.hidden_size,))]


class PlainProcessor:
    """Not a DecoderBatchProcessor: cannot feed a state store."""

    def __init__(self, config, runtime) -> None:
        self.config, self.runtime = config, runtime


@pytest.fixture
def stateful_checkpoint(hf_checkpoint, tmp_path: Path) -> Path:
    path, _ = hf_checkpoint("llama")
    dst = tmp_path / "stateful"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["StatefulLlamaForTest"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_stateful_decoder_gets_its_store_through_a_decoder_batch_processor(stateful_checkpoint: Path) -> None:
    pm = registered_pipeline_model(stateful_checkpoint, RuntimeConfig(max_batch_size=4, max_seq_len=32))
    assert isinstance(pm.module, StatefulLlama)
    assert isinstance(pm.processor, DecoderBatchProcessor)
    assert pm.processor.state_store is pm.state_store
    assert pm.state_store.tensors["last_hidden"].shape == (4, pm.config.hidden_size)
    kv = pm.caches[0].params
    assert pm.processor.max_dims(["max_batch_size", "batch_size"], kv) == {"max_batch_size": 4, "batch_size": 4}


def test_stateful_decoder_with_another_processor_fails_at_build_time(stateful_checkpoint: Path) -> None:
    with pytest.raises(TypeError, match="StatefulLlama.*DecoderBatchProcessor.*PlainProcessor"):
        registered_pipeline_model(
            stateful_checkpoint, RuntimeConfig(max_batch_size=2, max_seq_len=32), processor_cls=PlainProcessor
        )


def test_stateless_decoder_accepts_any_processor(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama")
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=2, max_seq_len=32), processor_cls=DecoderBatchProcessor)
    assert pm.state_store is None
