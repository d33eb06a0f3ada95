"""XLA checkpoints on CPU PJRT: FULL checkpoints shared with FSDP2 and single-device PyTorch both
ways, SHARDED checkpoints resuming at other device counts, sliced loading, cpu_ram_efficient_loading,
a SHARDED checkpoint of one XLA mode refused by the other, and a CheckpointManager's job killed at 32
points and resumed exactly.

Each XLA run is its own process (tests/workers/xla_*.py); the FSDP2 and plain PyTorch sides run here.
"""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardcore
from shardcore_conformance.models import build_model

import harness
from ckpt_helpers import kill_chain, load_pt, newest_step
from xla_helpers import worker_json

pytestmark = pytest.mark.xla  # skipped, saying so, where torch_xla is not installed (conftest.py)


def _xla(name: str, devices: int, *args: str) -> None:
    out = harness.python(harness.worker(name), *args, env=harness.xla_env(devices), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """``get(mode, devices)``: one XLA process per pair saves FULL (3 steps) and loads FSDP2's FULL
    checkpoint (AdamW, 1 step), made here; the directory, and FSDP2's full state."""
    runs = {}

    def get(mode: str, devices: int):
        if (mode, devices) not in runs:
            d = tmp_path_factory.mktemp(f"full-{mode}-{devices}")
            model = shardcore.shard(build_model("llama", 3), {})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model(input_ids=torch.arange(16).view(2, 8), labels=torch.arange(16).view(2, 8)).loss.backward()
            opt.step()
            shardcore.save(model, d / "fsdp2")
            expected = shardcore.handle(model).backend.full_state_dict(model)
            _xla("xla_full_checkpoint", devices, mode, str(d), str(d / "fsdp2"))
            runs[mode, devices] = d, expected
        return runs[mode, devices]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["spmd", "fsdp"])
def test_full_checkpoint_from_xla_loads_into_fsdp2_and_single_device(full_runs, mode):
    d, _ = full_runs(mode, 2)
    expected = load_file(str(d / "expected.safetensors"))
    plain = build_model("llama", 5)
    shardcore.load(plain, d / "ckpt")
    for k, v in expected.items():
        assert torch.equal(plain.state_dict()[k], v), k
    fsdp = shardcore.shard(build_model("llama", 6), {})
    shardcore.load(fsdp, d / "ckpt")
    got = shardcore.handle(fsdp).backend.full_state_dict(fsdp)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, devices", [("spmd", 2), ("fsdp", 2)])
def test_full_checkpoint_from_fsdp2_loads_into_xla(full_runs, mode, devices):
    d, expected = full_runs(mode, devices)
    got = load_file(str(d / "got.safetensors"))
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def resume_chain(tmp_path_factory):
    """``get(mode)``: SHARDED_STATE_DICT saved on 2 devices, loaded and saved again on 4, then on 1
    (one XLA process each); the directory of each device count's run."""
    runs = {}

    def get(mode: str) -> Path:
        if mode not in runs:
            root, previous = tmp_path_factory.mktemp(f"resume-{mode}"), "-"
            for devices in (2, 4, 1):
                out = root / f"{devices}dev"
                out.mkdir()
                _xla("xla_resume", devices, mode, "SHARDED_STATE_DICT", previous, str(out))
                previous = str(out / "ckpt")
            runs[mode] = root
        return runs[mode]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd", "spmd-tp"])
def test_sharded_checkpoint_resumes_at_other_device_counts(resume_chain, mode):
    """Each load gives back exactly the parameters and AdamW state the previous run saved. SPMD with
    tensor parallelism (``spmd-tp``): tp 2 on 2 devices, dp 2 x tp 2 on 4, then one device."""
    root = resume_chain(mode)
    for previous, devices in ((2, 4), (4, 1)):
        saved = load_file(str(root / f"{previous}dev" / "saved.safetensors"))
        loaded = load_file(str(root / f"{devices}dev" / "loaded.safetensors"))
        assert set(saved) == set(loaded) and any(k.startswith("optimizer.") for k in saved)
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), (devices, k)
    for devices in (2, 4, 1):
        manifest = json.loads((root / f"{devices}dev" / "ckpt" / "shardcore.json").read_text())
        assert manifest["state_dict_type"] == "SHARDED_STATE_DICT"
    files = {p.name for p in (root / "4dev" / "ckpt").iterdir()}
    if mode == "fsdp":  # each rank's shards, no pickle anywhere
        assert {f"rank-{r:05d}-of-00004.safetensors" for r in range(4)} | {"shards.json"} <= files
    else:
        assert ".metadata" in files


@pytest.mark.multiprocess
def test_sharded_checkpoint_of_one_xla_mode_is_refused_by_the_other(resume_chain, tmp_path):
    """The 1-device SHARDED checkpoint of each mode (from the resume chain) in the other mode."""
    for mode, other in (("fsdp", "spmd"), ("spmd", "fsdp")):
        again = tmp_path / f"{mode}-into-{other}"
        again.mkdir()
        run = harness.python(
            harness.worker("xla_resume"),
            other,
            "SHARDED_STATE_DICT",
            str(resume_chain(mode) / "1dev" / "ckpt"),
            str(again),
            env=harness.xla_env(1),
            timeout=300,
        )
        assert run.returncode != 0 and "shardcore.errors.CheckpointError" in run.stderr, run.stderr[-3000:]
        assert "FULL_STATE_DICT" in run.stderr.splitlines()[-1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, devices", [("spmd", 2), ("fsdp", 2)])
def test_sliced_loading_matches_the_rank0_path_and_reads_each_element_once(tmp_path, mode, devices):
    """shardcore.load of a FULL checkpoint with AdamW state reads it in slices (SlicedLoading): the
    parameters and optimizer state equal, bit for bit, what the rank-0 path gives; no whole file is
    read; under XLA FSDP each device thread reads only its own range, so over the devices every
    element of the files is read once (the step counters once per device)."""
    got = worker_json("xla_sliced", devices, mode, str(tmp_path))
    assert got["differs"] == 0 and got["optimizer_entries"] > 0, got
    every_element = got["weight_elements"] + got["state_elements"]
    if mode == "spmd":  # one process drives both devices: it reads everything, once
        assert got["reads"] == [every_element + got["state_scalars"]], got
    else:
        assert sum(got["reads"]) == every_element + devices * got["state_scalars"], got
        assert max(got["reads"]) < 0.6 * every_element, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, devices", [("fsdp", 2), ("spmd", 2)])
def test_cpu_ram_efficient_loading_reads_on_rank0_only(tmp_path, mode, devices):
    """shardcore.from_pretrained with cpu_ram_efficient_loading: under XLA FSDP only device 0 reads
    the files, the other device threads build the model on the meta device and receive every weight
    and buffer from it; SPMD's one process reads them once."""
    build_model("llama", 9).save_pretrained(tmp_path / "hf")
    res = worker_json("xla_efficient", devices, mode, str(tmp_path / "hf"))
    assert res["reads"] == [0], res
    assert res["keys"] > 0 and res["param_diff"] == 0.0, res
    assert res["buffers"] == (devices if mode == "fsdp" else 1) * 2 and res["buffer_diff_sum"] == 0.0, res


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd"])
def test_checkpoint_manager_resumes_exactly_on_two_devices(tmp_path, mode):
    """A CheckpointManager on XLA FSDP and SPMD: 3 steps (step 2 saved, step 3 lost), a new model
    restored, trained to 6: bit for bit 6 uninterrupted steps, for FULL saved synchronously and
    SHARDED asynchronously (which XLA writes before save returns: it has no AsyncShardedCheckpoints)."""
    got = worker_json("xla_manager", 2, mode, str(tmp_path))
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        assert got[kind] == {"restored": 2, "max_diff": 0.0, "steps": [4, 6]}, (kind, got)
        marker = json.loads((tmp_path / kind / "step-6" / "shardcore-step.json").read_text())
        assert marker["world_size"] == (2 if mode == "fsdp" else 1) and marker["backend"] == "xla"


#: every point where a kill can land in the job (each step trains; steps 2, 4, 6 save; retention
#: deletes first at the third save)
_XLA_POINTS = sorted(
    [f"train:{s}" for s in range(6)]
    + [f"{p}:{s}" for p in ("staging", "rank_state", "model_commit", "marker", "rename") for s in (2, 4, 6)]
    + ["retention:6"]
)
#: (mode, format, saves) -> one job's kill points (workers/xla_manager_kill.py; ckpt_manager.PHASES).
#: Every rank is a thread of one process, so each kill takes the whole job down. 32 in all: chosen
#: by hand (every phase) for FULL, a seeded draw (the same on every machine and run) for SHARDED.
#: XLA's SHARDED "async" saves are written before save() returns (no AsyncShardedCheckpoints).
XLA_CHAINS = {
    ("fsdp", "FULL_STATE_DICT", "async"): [
        "train:1", "staging:2", "model_commit:2", "rank_state:4", "marker:4", "train:5", "rename:6", "retention:6",
    ],
    ("fsdp", "SHARDED_STATE_DICT", "sync"): random.Random(7).sample(_XLA_POINTS, 8),
    ("spmd", "FULL_STATE_DICT", "sync"): [
        "staging:2", "rename:2", "train:3", "model_commit:4", "rename:4", "staging:6", "marker:6", "retention:6",
    ],
    ("spmd", "SHARDED_STATE_DICT", "async"): random.Random(11).sample(_XLA_POINTS, 8),
}  # fmt: skip


@pytest.fixture(scope="module")
def xla_uninterrupted(tmp_path_factory):
    """Per mode, the job run through without a kill (FULL, synchronous saves), once."""
    runs = {}

    def get(mode: str):
        if mode not in runs:
            d = tmp_path_factory.mktemp(f"uninterrupted-{mode}")
            out = _xla_job(d, mode, "FULL_STATE_DICT", "sync")
            assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
            runs[mode] = load_pt(d / "result.pt")
            assert runs[mode]["resumed"] == 0
        return runs[mode]

    return get


def _xla_job(d, mode, kind, saves, *point):
    out = harness.python(
        harness.worker("xla_manager_kill"),
        mode,
        str(d),
        kind,
        saves,
        *point,
        env=harness.xla_env(2),
        timeout=300,
        merge=True,
    )
    if point:  # the kill, and nothing else, ended it: a restore that failed would exit with 1
        assert out.returncode == -9, f"{point}: exit {out.returncode}\n{out.stdout[-3000:]}"
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, kind, saves", list(XLA_CHAINS), ids=["-".join(c).lower() for c in XLA_CHAINS])
def test_an_xla_job_killed_again_and_again_resumes_each_time_from_the_newest_complete_step(
    tmp_path, xla_uninterrupted, mode, kind, saves
):
    """XLA FSDP (2 device threads) and SPMD (2 devices) under a CheckpointManager, SIGKILLed at each
    point of the chain in turn and restarted: each restart resumes from the newest step whose save
    completed, and the last ends bit for bit where the uninterrupted job ends."""
    points = [f"{p}:all" for p in XLA_CHAINS[mode, kind, saves]]
    got = kill_chain(
        lambda d, *point: _xla_job(d, mode, kind, saves, *point), tmp_path, points, saves, 2 if mode == "fsdp" else 1
    )
    want = xla_uninterrupted(mode)
    assert got["lr"] == want["lr"] and got["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{k} differs after the kills ({mode}, {kind}, {saves})"
    assert [s for s, _ in shardcore.CheckpointManager(tmp_path / "ckpt").checkpoints()] == [4, 6]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd"])
def test_an_xla_job_sent_sigterm_saves_the_next_step_and_stops(tmp_path, xla_uninterrupted, mode):
    """Preemption on XLA: a SIGTERM in step 2 (no save due until 4); every rank (device threads of
    XLA FSDP, whose managers share the handler the main thread installed) saves step 3 and the job
    exits 0; the restarted job resumes from step 3 and ends bit for bit."""
    stopped = harness.python(
        harness.worker("xla_manager_kill"),
        *(mode, str(tmp_path), "FULL_STATE_DICT", "async", "sigterm:2:all"),
        env=harness.xla_env(2),
        timeout=300,
        merge=True,
    )
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert load_pt(tmp_path / "preempted.pt") == {"step": 3}
    assert newest_step(tmp_path) == 3 and not (tmp_path / "result.pt").exists()
    resumed = _xla_job(tmp_path, mode, "FULL_STATE_DICT", "async")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got, want = load_pt(tmp_path / "result.pt"), xla_uninterrupted(mode)
    assert got["resumed"] == 3 and got["lr"] == want["lr"]
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{k} differs after the preemption ({mode})"
