"""What the XLA test files share: the two base configs, running a worker on CPU PJRT devices, and
the parity assertion."""

from __future__ import annotations

import json

import harness

X = {"xla": True}
V2 = {"xla": True, "xla_fsdp_v2": True}


def worker_json(name: str, devices: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """Run ``workers/<name>.py args`` on ``devices`` CPU devices; the JSON line it printed last."""
    out = harness.python(harness.worker(name), *args, env=env or harness.xla_env(devices), timeout=timeout)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_ok(result):
    assert result.ok, "\n".join(f"{v.case}: {v.reasons}" for v in result.failures())
    for v in result.verdicts:
        losses = result.sharded[v.case]["losses"]
        assert losses[0] != losses[-1], v.case  # it trained
