"""Checkpoints in one process: FULL (safetensors) round trips with the optimizer, plain safetensors
files, the slice reader, init_empty_weights and the guard of a model without weights, and the dtype
from_pretrained takes without weights. Multi-process runs: test_checkpoint_multiprocess.py; atomic
saves: test_checkpoint_atomic.py; errors: test_checkpoint_errors.py.
"""

from __future__ import annotations

import pytest
import torch

import shardcore
import shardcore.checkpoint as ckpt
from shardcore_conformance.models import MLP, tiny_llama_config

from ckpt_helpers import assert_same_state, llama, state_of


def test_single_device_round_trip_with_optimizer(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    shardcore.save(model, tmp_path / "c", opt)
    torch.manual_seed(1)
    other = MLP()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    shardcore.load(other, tmp_path / "c", other_opt)
    assert_same_state(state_of(other), state_of(model))
    a, b = opt.state_dict(), other_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k])


def test_slice_reader_copies_rows_a_piece_at_a_time(tmp_path, monkeypatch):
    """Rows read in pieces (each through its own memory map) equal the slice of the whole tensor,
    for any dtype, a scalar and a tied name stored once."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(37, 5, generator=g),
        "h": torch.randn(11, 3, 2, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
    }
    save_file(tensors, str(tmp_path / "a.safetensors"))
    monkeypatch.setattr(ckpt.full, "SLICE_BYTES", 64)  # 3 rows of w per piece
    opened = []
    real_open = ckpt.full._safetensors()[1]

    def counting_open(*a, **k):
        opened.append(a[0])
        return real_open(*a, **k)

    reader = ckpt.full.SliceReader([tmp_path / "a.safetensors"], {"w_tied": "w"})
    reader._open = counting_open
    out = torch.empty(26, 5)
    reader.fill("w_tied", (slice(3, 29), slice(0, 5)), out)
    assert torch.equal(out, tensors["w"][3:29]) and len(opened) == 9  # ceil(26 / 3) pieces
    out = torch.empty(4, 3, 2)  # a float32 shard of a bfloat16 tensor: cast as load_state_dict casts
    reader.fill("h", (slice(7, 11), slice(0, 3), slice(0, 2)), out)
    assert torch.equal(out, tensors["h"][7:11].float())
    out = torch.empty(())
    reader.fill("s", (), out)
    assert float(out) == 3.5
    with pytest.raises(shardcore.CheckpointError, match="no tensor 'nope'"):
        reader.fill("nope", (slice(0, 1),), torch.empty(1))


def test_init_empty_weights_keeps_buffers_and_a_model_without_weights_waits_for_its_load(tmp_path):
    from shardcore import empty

    with shardcore.init_empty_weights():
        model = llama(seed=0)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plain = llama(seed=0)
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    assert empty.weights_state(model) == "empty" and empty.weights_state(plain) == "real"
    with torch.device("meta"):
        assert empty.weights_state(llama(seed=0)) == "partial"  # rotary inv_freq, in no checkpoint, on meta
    assert not any(p.is_meta for p in llama(seed=0).parameters())  # the context put register_parameter back

    shardcore.save(plain, tmp_path / "ok")
    empty.materialize_empty(model, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    empty.await_weights(model)
    with pytest.raises(shardcore.CheckpointError, match="uninitialized memory"):
        model(input_ids=torch.arange(8).reshape(1, 8))
    with pytest.raises(shardcore.CheckpointError, match="nothing was loaded"):
        shardcore.save(model, tmp_path / "garbage")
    assert not (tmp_path / "garbage").exists()
    shardcore.load(model, tmp_path / "ok")
    assert_same_state(state_of(model), state_of(plain))
    model(input_ids=torch.arange(8).reshape(1, 8))


def test_from_pretrained_without_weights_takes_the_dtype_transformers_would(tmp_path):
    """dtype="auto" (Transformers' default): the config's dtype, else the checkpoint's first float
    tensor's; an explicit dtype wins."""
    from safetensors.torch import save_file

    from shardcore.checkpoint.pretrained import _auto_dtype

    f = tmp_path / "w.safetensors"
    save_file({"a.steps": torch.zeros(2, dtype=torch.int64), "b.weight": torch.zeros(2, dtype=torch.bfloat16)}, str(f))
    cfg = tiny_llama_config()
    cfg.dtype = None
    assert _auto_dtype(cfg, [f], {}) == torch.bfloat16
    assert _auto_dtype(cfg, [f], {"dtype": "auto"}) == torch.bfloat16
    cfg.dtype = torch.float16
    assert _auto_dtype(cfg, [f], {}) == torch.float16
    assert _auto_dtype(cfg, [f], {"torch_dtype": torch.float32}) == torch.float32


def test_plain_safetensors_file_loads(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = MLP()
    save_file(state_of(src), str(tmp_path / "w.safetensors"))
    dst = MLP()
    shardcore.load(dst, tmp_path / "w.safetensors")
    assert_same_state(state_of(dst), state_of(src))
