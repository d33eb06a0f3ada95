"""Fuzzing the checkpoint readers (``tests/fuzz_checkpoints.py`` says what is allowed): every
mutated checkpoint loads bit-identical to what its files say, or is refused with a CheckpointError.

Here, in this process: FULL checkpoints of ``shardcore.save`` and ``save_pretrained`` directories
(one file, and an index of shards), loaded into an unsharded model. ``test_checkpoint_fuzz_ranks``
does the same on FSDP2 ranks and XLA devices, FULL and SHARDED. ``SHARDCORE_FUZZ_EXAMPLES=N`` runs
N examples per family instead of the bounded CI count (``make fuzz``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("USE_TORCH_XLA", "0")

from fuzz_checkpoints import Campaign, bad, examples_from_env, safetensors_oracle, summary  # noqa: E402

import shardcore  # noqa: E402
from shardcore.backend import World  # noqa: E402

from ckpt_helpers import llama  # noqa: E402

EXAMPLES = examples_from_env(150)


class OneRank:
    def world(self) -> World:
        return World(0, 1, torch.device("cpu"))

    def broadcast_object(self, obj):
        return obj

    def all_reduce_sum(self, t):
        return t


def _trained():
    model = llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _campaign(tmp_path, pristine, model, opt):
    return Campaign(
        pristine=pristine,
        work=tmp_path,
        ranks=OneRank(),
        full_state=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
        load=lambda p: shardcore.load(model, p, opt),
        oracle=safetensors_oracle,
        aliases=shardcore.checkpoint.tied_names(model),
    )


@pytest.mark.parametrize("source", ["shardcore.save", "save_pretrained", "save_pretrained-index"])
def test_mutated_full_checkpoints_load_identically_or_are_refused(tmp_path, source):
    model, opt = _trained()
    if source == "shardcore.save":
        pristine = shardcore.save(model, tmp_path / "pristine", opt)
    else:
        pristine = tmp_path / "pristine"
        model.save_pretrained(pristine, **({"max_shard_size": "20KB"} if source.endswith("index") else {}))
        opt = None  # save_pretrained writes no optimizer state
    work = tmp_path / "work"
    work.mkdir()
    records = _campaign(work, pristine, model, opt).run(EXAMPLES, seed=1234)
    counts = summary(records)
    print(source, json.dumps(counts))
    assert not bad(records), json.dumps(bad(records)[:5], indent=1)
    # the campaign must reach both outcomes, or it proves nothing about one of them
    assert counts.get("identical", 0) > 0 and sum(v for k, v in counts.items() if k.startswith("refused")) > 0, counts


def _swallowing(load):
    def broken(path):
        try:
            load(path)
        except shardcore.CheckpointError:
            pass  # trains on with whatever arrived

    return broken


def _raw_errors(load):
    def broken(path):
        try:
            load(path)
        except shardcore.CheckpointError as e:
            raise KeyError(str(e)) from None  # a raw exception from deep inside

    return broken


def _silent_partial(model, load):
    def broken(path):
        try:
            load(path)
        except shardcore.CheckpointError as e:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)  # half a model, and an error that does not say so
            raise shardcore.CheckpointError(str(e).replace(shardcore.checkpoint.PARTLY_LOADED, "")) from None

    return broken


@pytest.mark.parametrize("broken", ["swallows errors", "raw exceptions", "silently partial"])
def test_the_campaign_catches_a_broken_loader(tmp_path, broken):
    model, opt = _trained()
    pristine = shardcore.save(model, tmp_path / "pristine", opt)
    work = tmp_path / "work"
    work.mkdir()
    campaign = _campaign(work, pristine, model, opt)
    good = campaign.load
    wrap = {"swallows errors": _swallowing, "raw exceptions": _raw_errors}.get(broken)
    campaign.load = wrap(good) if wrap else _silent_partial(model, good)
    # the campaign puts the model back with the broken loader, which must still load the pristine one
    records = campaign.run(40, seed=1234)
    kinds = {r["kind"] for r in bad(records)}
    want = {
        "swallows errors": {"BAD: loaded what safetensors/DCP cannot read", "BAD: differs from the files"},
        "raw exceptions": {"BAD: KeyError"},
        "silently partial": {"BAD: changed behind an error"},
    }[broken]
    assert kinds & want, summary(records)
