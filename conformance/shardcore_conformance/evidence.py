"""The evidence table: for every key the backend supports, the checks that observed its effect in this
run, or why none could.

A check observes a key in a case when the case sets the key and the check's verdict depends on what
the key does there (``Verdict.observed``, filled by :mod:`.compare`). A key no check observed is not
certified by the run, and the headline names it: a backend could accept it and ignore it and still
pass.
"""

from __future__ import annotations

from typing import Any

_ON_CPU = {
    "cpu_offload": "the run's device is the CPU, where offloaded parameters and gradients stay where they are",
    "use_cpu": "the run's device is the CPU already",
}
_ONE_DEVICE = {
    "reshard_after_forward": "one rank: its parameters are whole, so nothing is freed or gathered again",
    "xla_fsdp_settings": "one device: no all-gather carries the compute dtype (see conformance/README.md, "
    "compute dtype under XLA FSDP)",
    "cpu_ram_efficient_loading": "one rank: its weights are rank 0's",
    "xla_fsdp_v2": "one device: SPMD and XLA FSDP run the same unsharded program",
    "dp_replicate_size": "one rank: no replicas",
    "dp_shard_size": "one rank: no shards",
}
#: keys whose effect leaves nothing that the suite's cases can see, and why
_NO_EFFECT_HERE = {
    "torch_compile_backend": "which compiler dynamo hands its graphs to: inductor and aot_eager give the same "
    "numbers, collectives and graph counts, and no check records which compiler ran",
    "torch_compile_mode": "the case sets mode 'default', which is torch.compile's default: nothing differs",
    "torch_compile_fullgraph": "fullgraph only turns a graph break into an error, and these models compile "
    "without graph breaks",
    "torch_compile_dynamic": "dynamic: false only forbids symbolic shapes, which the cases' fixed shapes never "
    "call for",
    "torch_compile_regional": "whole-model and per-unit compilation give the same numbers and collectives, and "
    "no check compares which modules were compiled",
}


def evidence(result: Any) -> dict[str, dict[str, Any]]:
    """``{key: {"observed_by": [check, ...], "unobservable": None | why, "cases": n}}`` for every key
    of ``result.supported_keys``."""
    from shardcore import parse_config

    device = result.device_type or "?"
    devices = result.placement().get("devices") or result.world_size
    observed: dict[str, set[str]] = {}
    setting: dict[str, int] = {}
    for c, v in zip(result.cases, result.verdicts):
        for k in parse_config(c.config).non_default_keys():
            setting[k] = setting.get(k, 0) + 1
        for check, keys in v.observed.items():
            for k in keys:
                observed.setdefault(k, set()).add(check)
    out: dict[str, dict[str, Any]] = {}
    for k in sorted(result.supported_keys):
        checks = sorted(observed.get(k, ()))
        why = None
        if not checks:
            if not setting.get(k):
                why = "no case of this run sets it"
            elif device == "cpu" and k in _ON_CPU:
                why = f"{_ON_CPU[k]} (observed by placement on an accelerator)"
            elif devices == 1 and k in _ONE_DEVICE:
                why = _ONE_DEVICE[k]
            else:
                why = _NO_EFFECT_HERE.get(k, "set, but no check observed its effect")
        out[k] = {"observed_by": checks, "unobservable": why, "cases": setting.get(k, 0)}
    return out


def unobserved(table: dict[str, dict[str, Any]]) -> list[str]:
    """Keys that cases of the run set and no check observed (a key no case set was not tried at all:
    ``uncovered_keys``)."""
    return [k for k, e in table.items() if e["unobservable"] is not None and e["cases"]]


def headline_suffix(table: dict[str, dict[str, Any]], device: str | None) -> str:
    """``; cpu_offload, use_cpu not observable on cpu`` (empty when every key set was observed)."""
    keys = unobserved(table)
    return f"; {', '.join(keys)} not observable on {device or '?'}" if keys else ""


def markdown(table: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| key | observed by | not observable |", "|---|---|---|"]
    for k, e in table.items():
        lines.append(f"| `{k}` | {', '.join(e['observed_by']) or '-'} | {e['unobservable'] or ''} |")
    return lines
