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
import pickle
import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st

from shardcore.checkpoint import PARTLY_LOADED
from shardcore.errors import CheckpointError

OUTSIDE = "outside.safetensors"  # a valid safetensors file beside the checkpoint, never inside it

# ------------------------------------------------------------------------------------ mutations

SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "X9", ""]


def _header(data: bytes) -> tuple[int, dict[str, Any]] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return n, json.loads(data[8 : 8 + n])
    except ValueError:
        return None


def _with_header(data: bytes, n: int, header: Any, raw: str | None = None) -> bytes:
    text = (raw if raw is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _json_paths(obj: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    out = [prefix]
    if depth >= 4:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _json_paths(v, (*prefix, k), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            out += _json_paths(v, (*prefix, i), depth + 1)
    return out


def _set_path(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@dataclass
class Mutation:
    """One change to one file of a checkpoint; ``apply`` performs it on a copy."""

    op: str
    file: str
    draw: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        detail = ", ".join(f"{k}={v!r}"[:60] for k, v in self.draw.items())
        return f"{self.op}({self.file}{', ' if detail else ''}{detail})"

    def apply(self, root: Path) -> None:
        f = root / self.file
        data = f.read_bytes() if f.is_file() else b""
        d = self.draw
        rnd = random.Random(d.get("seed", 0))
        if self.op == "delete":
            f.unlink()
        elif self.op == "truncate":
            f.write_bytes(data[: int(len(data) * d["keep"])])
        elif self.op == "flip":
            b = bytearray(data)
            span = len(b) if d["where"] == "anywhere" else min(len(b), 8 + (_header(data) or (56, None))[0])
            for _ in range(d["count"]):
                if span:
                    b[rnd.randrange(span)] ^= rnd.randrange(1, 256)
            f.write_bytes(bytes(b))
        elif self.op == "garbage":
            f.write_bytes(rnd.randbytes(d["size"]))
        elif self.op == "header_length":
            n = (_header(data) or (0, None))[0]
            f.write_bytes(struct.pack("<Q", max(0, min(2**64 - 1, n + d["delta"]))) + data[8:])
        elif self.op == "header":
            parsed = _header(data)
            if parsed is None:
                return
            n, header = parsed
            keys = [k for k in header if k != "__metadata__"]
            if not keys:
                return
            key = keys[d["key"] % len(keys)]
            entry, raw = header[key], None
            if d["change"] == "dtype":
                entry["dtype"] = d["dtype"]
            elif d["change"] == "shape":
                entry["shape"] = d["shape"]
            elif d["change"] == "offsets":
                entry["data_offsets"] = d["offsets"]
            elif d["change"] == "drop":
                del header[key]
            elif d["change"] == "rename":
                header[key + d["suffix"]] = header.pop(key)
            elif d["change"] == "duplicate":  # the same key twice in the JSON text
                other = keys[(d["key"] + 1) % len(keys)]
                body = json.dumps(header)
                raw = body[:-1] + f", {json.dumps(key)}: {json.dumps(header[other])}}}"
            f.write_bytes(_with_header(data, n, header, raw))
        elif self.op == "json":
            try:
                obj = json.loads(data)
            except ValueError:
                return
            paths = _json_paths(obj)
            path = paths[d["path"] % len(paths)]
            _set_path(obj, path, d["value"], d["delete"] and bool(path))
            f.write_text(json.dumps(obj))
        elif self.op == "index_entry":
            obj = json.loads(data)
            wm = obj.get("weight_map", {})
            if not wm:
                return
            key = sorted(wm)[d["key"] % len(wm)]
            shards = sorted(set(wm.values()))
            target = {
                "missing": "model-99999-of-99999.safetensors",
                "other": shards[(shards.index(wm[key]) + 1) % len(shards)],
                "dotdot": f"../{OUTSIDE}",
                "absolute": str((root.parent / OUTSIDE).resolve()),
                "symlink": "link.safetensors",
                "directory": ".",
            }[d["to"]]
            if d["to"] == "symlink":
                (root / target).symlink_to(root.parent / OUTSIDE)
            if d["all"]:
                old = wm[key]
                wm = {k: (target if v == old else v) for k, v in wm.items()}
            else:
                wm[key] = target
            obj["weight_map"] = wm
            f.write_text(json.dumps(obj))
        elif self.op == "dcp_metadata":
            md = pickle.loads(data)  # our own pristine file, written by DCP a moment ago
            items = sorted(md.storage_data, key=str)
            if not items:
                return
            info = md.storage_data[items[d["item"] % len(items)]]
            change = d["change"]
            if change == "path":
                info.relative_path = d["path"]
            elif change == "offset":
                info.offset = d["number"]
            elif change == "length":
                info.length = d["number"]
            elif change == "drop":
                del md.storage_data[items[d["item"] % len(items)]]
            elif change == "size":
                key = sorted(md.state_dict_metadata)[d["item"] % len(md.state_dict_metadata)]
                sm = md.state_dict_metadata[key]
                if hasattr(sm, "size"):
                    sm.size = torch.Size([max(0, s + d["number"] % 3 - 1) for s in sm.size])
            f.write_bytes(pickle.dumps(md))
        else:  # pragma: no cover - a new op without its code
            raise AssertionError(self.op)


def mutations(files: list[str]) -> st.SearchStrategy[list[Mutation]]:
    """One or two mutations of the checkpoint whose files (relative names) are ``files``."""
    safetensors = [f for f in files if f.endswith(".safetensors")]
    jsons = [f for f in files if f.endswith(".json")]
    indexes = [f for f in jsons if f.endswith(".index.json")]
    metadata = [f for f in files if f.endswith(".metadata")]
    seed = st.integers(0, 2**32 - 1)
    choices = [
        st.builds(Mutation, st.just("delete"), st.sampled_from(files)),
        st.builds(
            Mutation, st.just("truncate"), st.sampled_from(files), st.fixed_dictionaries({"keep": st.floats(0, 0.999)})
        ),
        st.builds(
            Mutation,
            st.just("flip"),
            st.sampled_from(files),
            st.fixed_dictionaries(
                {"where": st.sampled_from(["header", "anywhere"]), "count": st.integers(1, 4), "seed": seed}
            ),
        ),
        st.builds(
            Mutation,
            st.just("garbage"),
            st.sampled_from(files),
            st.fixed_dictionaries({"size": st.integers(0, 300), "seed": seed}),
        ),
    ]
    if safetensors:
        choices += [
            st.builds(
                Mutation,
                st.just("header_length"),
                st.sampled_from(safetensors),
                st.fixed_dictionaries({"delta": st.sampled_from([-64, -8, -1, 1, 8, 64, 2**40, 2**62])}),
            ),
            st.builds(
                Mutation,
                st.just("header"),
                st.sampled_from(safetensors),
                st.fixed_dictionaries(
                    {
                        "key": st.integers(0, 1000),
                        "change": st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "duplicate"]),
                        "dtype": st.sampled_from(SAFETENSORS_DTYPES),
                        "shape": st.lists(st.integers(-1, 70), max_size=3),
                        "offsets": st.lists(st.integers(-8, 10**6), min_size=0, max_size=3),
                        "suffix": st.sampled_from(["x", ".weight", "_orig_mod."]),
                    }
                ),
            ),
        ]
    if jsons:
        choices.append(
            st.builds(
                Mutation,
                st.just("json"),
                st.sampled_from(jsons),
                st.fixed_dictionaries({"path": st.integers(0, 1000), "value": JSON_VALUES, "delete": st.booleans()}),
            )
        )
    if indexes:
        choices.append(
            st.builds(
                Mutation,
                st.just("index_entry"),
                st.sampled_from(indexes),
                st.fixed_dictionaries(
                    {
                        "key": st.integers(0, 1000),
                        "to": st.sampled_from(["missing", "other", "dotdot", "absolute", "symlink", "directory"]),
                        "all": st.booleans(),
                    }
                ),
            )
        )
    if metadata:
        choices.append(
            st.builds(
                Mutation,
                st.just("dcp_metadata"),
                st.sampled_from(metadata),
                st.fixed_dictionaries(
                    {
                        "item": st.integers(0, 1000),
                        "change": st.sampled_from(["path", "offset", "length", "drop", "size"]),
                        "path": st.sampled_from(["../x.distcp", "/etc/hostname", "missing.distcp", ".metadata"]),
                        "number": st.integers(-(2**20), 2**40),
                    }
                ),
            )
        )
    return st.lists(st.one_of(choices), min_size=1, max_size=2)


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
