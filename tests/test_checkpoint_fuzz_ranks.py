"""The checkpoint fuzz campaign (``tests/fuzz_checkpoints.py``) on several ranks: FSDP2 on 2 gloo
ranks, XLA FSDP and SPMD on 2 CPU PJRT devices; FULL and SHARDED checkpoints of each, written by
``shardcore.save``. Each mutated checkpoint must load bit-identical to what its files say on every
rank, or be refused with a CheckpointError on every rank; a hang or crash fails at the deadline."""

from __future__ import annotations

import json

import pytest
from fuzz_checkpoints import bad, examples_from_env, summary

import harness

EXAMPLES = examples_from_env(25)
SEED = 20261203
FORMATS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["fsdp2", "xla-fsdp", "xla-spmd"])
def test_mutated_checkpoints_load_identically_or_are_refused_on_every_rank(tmp_path, backend):
    args = (backend, str(tmp_path), str(EXAMPLES), str(SEED))
    deadline = 240 + 6 * EXAMPLES
    if backend == "fsdp2":
        proc = harness.ranks(2, harness.worker("ckpt_fuzz"), *args, timeout=deadline)
        ranks = 2
    else:
        pytest.importorskip("torch_xla", reason="needs torch_xla")
        proc = harness.python(harness.worker("ckpt_fuzz"), *args, env=harness.xla_env(2), timeout=deadline, merge=True)
        ranks = 2 if backend == "xla-fsdp" else 1  # SPMD: one process drives both devices
    assert proc.returncode == 0, harness.tail(proc.stdout)
    for kind in FORMATS:
        per_rank = [json.loads((tmp_path / f"{kind}.rank{r}.json").read_text()) for r in range(ranks)]
        records = [r for rs in per_rank for r in rs]
        print(backend, kind, json.dumps(summary(per_rank[0])))
        assert not bad(records), json.dumps(bad(records)[:5], indent=1)
        assert all(len(rs) == EXAMPLES for rs in per_rank), [len(rs) for rs in per_rank]
        # every rank reached the same verdict on every checkpoint (whether a rank had begun writing
        # when it failed is its own)
        verdicts = [[r["kind"].split()[0] for r in rs] for rs in per_rank]
        assert all(v == verdicts[0] for v in verdicts), verdicts
        counts = summary(per_rank[0])
        assert counts.get("identical", 0) > 0 and sum(v for k, v in counts.items() if k.startswith("refused")) > 0
