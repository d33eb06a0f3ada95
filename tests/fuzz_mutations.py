"""The mutations of the checkpoint fuzz campaign (``fuzz_checkpoints.py``): each is one change to
one file of a real checkpoint (truncate, flip bytes, garbage, safetensors header length, dtype,
shape, offsets and keys, JSON values, index entries pointing elsewhere, DCP metadata paths,
offsets, lengths and sizes), drawn by hypothesis and applied to a copy of the directory."""

from __future__ import annotations

import json
import pickle
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

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
