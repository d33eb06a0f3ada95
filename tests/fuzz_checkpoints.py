"""Fuzzing checkpoint readers: mutate a real checkpoint, load it, and classify what happened.

The only outcomes allowed are
- ``identical``: the load succeeded and the model holds exactly what an independent reader finds in
  the (mutated) files: safetensors' own ``load_file`` for safetensors files, DCP's own reader for a
  DCP directory. safetensors and DCP carry no checksum, so a flipped byte inside tensor data loads
  as that byte; what a reader must never do is load something the files do not say;
- ``refused``: a :class:`~shardcore.errors.CheckpointError` on every rank, with the model as it was
  before, or with an error that says it may hold part of the checkpoint.

Anything else is a finding: another exception type, ranks that disagree, a load that differs from
the files, a model changed behind an error that says nothing of it. A hang or a crash of the
process is caught by the harness's deadline around the worker.

Rank 0 draws the mutations (hypothesis, seeded, no shrinking: the body never raises, it records)
and sends each mutated directory to the other ranks, which load it in step with rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from fuzz_mutations import OUTSIDE, Mutation, mutations
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st

from shardcore.checkpoint import PARTLY_LOADED
from shardcore.errors import CheckpointError

# ------------------------------------------------------------------------------------ oracles


def _within(root: Path, name: str) -> Path:
    """The specification, written apart from shardcore's own check: a file that resolves outside
    the checkpoint directory is not part of the checkpoint."""
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):
        raise FileNotFoundError(f"{name} is outside {root}")
    return path


def safetensors_oracle(root: Path) -> dict[str, torch.Tensor]:
    """What safetensors itself reads from the weights of ``root`` (one file or the index's shards)."""
    from safetensors.torch import load_file

    if (root / "model.safetensors").exists():
        return load_file(str(_within(root, "model.safetensors")))
    wm = json.loads(_within(root, "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(wm.values())):
        out.update(load_file(str(_within(root, name))))
    return out


def dcp_oracle(root: Path, shapes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DCP's own ``FileSystemReader`` and default planner read into full tensors of ``shapes``
    (the model's keys the checkpoint holds, as ``model.<name>``), in this process alone."""
    import torch.distributed.checkpoint as dcp

    from shardcore import safe_dcp

    _within(root, ".metadata")
    stored = safe_dcp.reader(str(root)).read_metadata().state_dict_metadata
    state = {f"model.{k}": torch.empty_like(v) for k, v in shapes.items() if f"model.{k}" in stored}
    for info in safe_dcp.reader(str(root)).read_metadata().storage_data.values():
        _within(root, info.relative_path)
    dcp.load(state, storage_reader=safe_dcp.reader(str(root)), no_dist=True)
    return {k[len("model.") :]: v for k, v in state.items()}


def xla_shards_oracle(root: Path) -> dict[str, torch.Tensor]:
    """XLA FSDP's per-rank shards put together, from the format's description (shards.json: the
    world size and, per first name, the (name, shape) pieces of each flat, padded shard)."""
    import math

    from safetensors.torch import load_file

    index = json.loads(_within(root, "shards.json").read_text())
    world = index["world_size"]
    ranks = [load_file(str(_within(root, f"rank-{r:05d}-of-{world:05d}.safetensors"))) for r in range(world)]
    out: dict[str, torch.Tensor] = {}
    for first, pieces in index["pieces"].items():
        flat, at = torch.cat([r[f"model.{first}"] for r in ranks]), 0
        for name, shape in pieces:
            out[name] = flat[at : at + math.prod(shape)].view(shape)
            at += math.prod(shape)
    if (root / "buffers.safetensors").exists():
        out.update(load_file(str(_within(root, "buffers.safetensors"))))
    return out


# ------------------------------------------------------------------------------------ the campaign


@dataclass
class Campaign:
    """Load mutated copies of ``pristine`` into ``model`` on every rank.

    ``full_state()`` is the model's whole state on rank 0 (a collective); ``load(path)`` loads; the
    ``ranks`` object has ``world()``, ``broadcast_object`` and ``all_reduce_sum`` (a backend);
    ``oracle(path)`` gives what an independent reader finds in ``path`` (run on rank 0);
    ``aliases`` are tied names (name not stored -> name stored)."""

    pristine: Path
    work: Path
    ranks: Any
    full_state: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[Path], None]
    oracle: Callable[[Path], dict[str, torch.Tensor]]
    aliases: dict[str, str] = field(default_factory=dict)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    _drawn: int = 0

    @property
    def rank(self) -> int:
        return self.ranks.world().rank

    def run(self, examples: int, seed: int) -> list[dict[str, Any]]:
        """Rank 0 draws ``examples`` mutations; every rank loads each. Returns this rank's records."""
        if self.rank == 0:
            files = sorted(str(p.relative_to(self.pristine)) for p in self.pristine.rglob("*") if p.is_file())
            _outside(self.pristine, self.work / OUTSIDE)

            @settings(
                max_examples=examples,
                database=None,
                deadline=None,
                derandomize=False,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(mutations(files), st.integers(0, 2**31))
            def body(muts: list[Mutation], tag: int) -> None:
                self._drawn += 1
                path = self.work / f"m{self._drawn}-{tag}"
                shutil.copytree(self.pristine, path, symlinks=True)
                for m in muts:
                    try:
                        m.apply(path)
                    except (OSError, ValueError, KeyError, IndexError, TypeError):
                        pass  # a mutation that does not fit this file leaves it as it was
                self.ranks.broadcast_object(str(path))
                self._attempt(path, "; ".join(map(str, muts)))
                shutil.rmtree(path, ignore_errors=True)

            seeded(seed)(body)()  # reproducible: the same seed draws the same checkpoints
            self.ranks.broadcast_object(None)
        else:
            while (path := self.ranks.broadcast_object(None)) is not None:
                self._attempt(Path(path), "")
        return self.outcomes

    def _attempt(self, path: Path, what: str) -> None:
        before = self.full_state()
        oracle: Any = None
        if self.rank == 0:
            try:
                oracle = self.oracle(path)
            except (Exception, BaseException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                oracle = e
        error: BaseException | None = None
        try:
            self.load(path)
        except (Exception, BaseException) as e:  # noqa: BLE001 - classified below, whatever its type
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = e
        failed = int(
            float(
                self.ranks.all_reduce_sum(torch.tensor(0.0 if error is None else 1.0, device=self.ranks.world().device))
            )
        )
        after = self.full_state()
        record: dict[str, Any] = {"mutation": what, "rank": self.rank}
        world = self.ranks.world().size
        if 0 < failed < world:
            record["kind"] = "BAD: ranks disagree"
            record["detail"] = f"{failed} of {world} ranks failed; here: {type(error).__name__ if error else 'loaded'}"
        elif error is not None and not isinstance(error, CheckpointError):
            record["kind"] = f"BAD: {type(error).__name__}"
            record["detail"] = str(error)[:300]
        elif error is not None:
            partly = PARTLY_LOADED in str(error)
            record["kind"] = "refused (said partly loaded)" if partly else "refused"
            record["detail"] = str(error).splitlines()[0][:200]
            if self.rank == 0 and not partly and not _same(after, before):
                record["kind"] = "BAD: changed behind an error"
        elif self.rank == 0:
            if isinstance(oracle, BaseException):
                record["kind"] = "BAD: loaded what safetensors/DCP cannot read"
                record["detail"] = f"{type(oracle).__name__}: {str(oracle)[:200]}"
            else:
                diff = _diff(after, oracle, self.aliases)
                record["kind"] = "identical" if diff is None else "BAD: differs from the files"
                if diff is not None:
                    record["detail"] = diff
        else:
            record["kind"] = "identical"
        # after a refused or odd load every rank puts the model back to the pristine checkpoint (rank
        # 0 decides, so that every rank enters the same collectives)
        if self.ranks.broadcast_object(record["kind"] != "identical" or failed > 0):
            self.load(self.pristine)
        self.outcomes.append(record)


def _outside(root: Path, dest: Path) -> None:
    """A valid safetensors file beside the work directories (a copy of one of ``root``'s, or a
    small one), for index entries to be pointed at: loading it would be an escape."""
    from safetensors.torch import save_file

    found = sorted(root.rglob("*.safetensors"))
    if found:
        shutil.copy(found[0], dest)
    else:
        save_file({"x": torch.ones(2)}, str(dest))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _diff(got: dict[str, torch.Tensor], files: dict[str, torch.Tensor], aliases: dict[str, str]) -> str | None:
    for k, v in got.items():
        stored = files.get(k, files.get(aliases.get(k, ""), None))
        if stored is None:
            return f"{k} is not in the files"
        if tuple(stored.shape) != tuple(v.shape):
            return f"{k}: files {tuple(stored.shape)}, model {tuple(v.shape)}"
        if not torch.equal(stored.to(v.dtype), v):
            return f"{k} differs from the files by {float((stored.to(v.dtype).float() - v.float()).abs().max()):.3g}"
    return None


def summary(records: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return dict(sorted(out.items()))


def bad(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"].startswith("BAD")]


def examples_from_env(default: int) -> int:
    """``SHARDCORE_FUZZ_EXAMPLES`` overrides the bounded CI count (the longer run behind a flag)."""
    return int(os.environ.get("SHARDCORE_FUZZ_EXAMPLES", default))
