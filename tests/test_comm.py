"""The communication prediction of the conformance suite (``shardcore_conformance.comm``), rule by
rule, on hand-made plans: what FSDP-style sharding must communicate per optimizer step."""

from shardcore import parse_config
from shardcore_conformance.comm import KINDS, check, expected_fsdp


def _units(frozen_first: bool = False):
    def unit(path, rows, grads=True, reached=True, prefetched=True):
        params = [[f"{path}.w", [rows, 4], 4], [f"{path}.b", [rows], 4]]
        return {
            "path": path,
            "params": params,
            "in_backward": reached,
            "prefetched": prefetched,
            "with_grad": [p[0] for p in params] if grads else [],
        }

    return [
        unit("l0", 3, grads=not frozen_first, reached=not frozen_first),
        unit("l1", 4),
        {**unit("", 2), "path": ""},
    ]


def _step(ag, ag_bytes, rs, rs_bytes, ar=0, ar_bytes=0):
    return {
        "all_gather": {"count": ag, "bytes": ag_bytes, "group_sizes": [2]},
        "reduce_scatter": {"count": rs, "bytes": rs_bytes, "group_sizes": [2]},
        "all_reduce": {"count": ar, "bytes": ar_bytes, "group_sizes": [2]},
    }


def test_units_are_gathered_again_in_backward_but_the_root_is_not():
    e = expected_fsdp(_units(), parse_config({}), world_size=2, grad_accum=1)
    assert e["all_gather"]["count"] == 5 and e["reduce_scatter"]["count"] == 3 and e["all_reduce"]["count"] == 0
    # l0: 3 rows padded to 4 (x5 floats a row), twice; l1: 4 rows, twice; root: 2 rows, once
    assert e["all_gather"]["bytes"] == [(15 * 2 + 20 * 2 + 10) * 4, (20 * 2 + 20 * 2 + 10) * 4]
    assert e["reduce_scatter"]["bytes"] == [45 * 4, 50 * 4]
    off = expected_fsdp(_units(), parse_config({"reshard_after_forward": False}), 2, 1)
    assert off["all_gather"]["count"] == 3


def test_accumulation_reduces_once_and_gathers_every_micro_batch():
    e = expected_fsdp(_units(), parse_config({}), 2, grad_accum=3)
    assert e["all_gather"]["count"] == 15 and e["reduce_scatter"]["count"] == 3


def test_mixed_precision_dtypes_set_the_bytes():
    e = expected_fsdp(
        _units(), parse_config({"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}), 2, 1
    )
    assert e["all_gather"]["bytes"][1] == 90 * 2 and e["reduce_scatter"]["bytes"][1] == 50 * 4
    e = expected_fsdp(_units(), parse_config({"mixed_precision": "bf16"}), 2, 1)
    assert e["reduce_scatter"]["bytes"][1] == 50 * 2


def test_hsdp_all_reduces_a_shard_and_pure_replication_gathers_nothing():
    e = expected_fsdp(_units(), parse_config({"dp_replicate_size": 2}), 4, 1)
    assert e["all_reduce"]["count"] == 3 and e["all_reduce"]["bytes"][1] == e["reduce_scatter"]["bytes"][1] // 2
    r = expected_fsdp(_units(), parse_config({"dp_shard_size": 1}), 2, 1)
    assert r["all_gather"]["count"] == 0 and r["reduce_scatter"]["count"] == 0 and r["all_reduce"]["count"] == 3
    one = expected_fsdp(_units(), parse_config({}), 1, 1)  # a single device communicates nothing
    assert all(one[k]["count"] == 0 for k in one)


def test_a_frozen_first_unit_is_gathered_in_backward_only_as_a_prefetch():
    e = expected_fsdp(_units(frozen_first=True), parse_config({}), 2, 1)
    assert e["all_gather"]["count"] == 5 and e["reduce_scatter"]["count"] == 2
    units = _units(frozen_first=True)
    units[0]["prefetched"] = False
    assert expected_fsdp(units, parse_config({}), 2, 1)["all_gather"]["count"] == 4


def test_check_names_rank_step_kind_and_each_units_share():
    e = expected_fsdp(_units(), parse_config({}), 2, 1)
    good = _step(5, e["all_gather"]["bytes"][1], 3, e["reduce_scatter"]["bytes"][0])
    assert check([[good, good], [good]], e) == []
    (msg,) = check([[good], [good, _step(5, e["all_gather"]["bytes"][1], 6, 0)]], e)
    assert msg == (
        "communication differs at step 1 on rank 1: 6 reduce_scatter calls, expected 3 (per unit: l0 x1, l1 x1, <root> x1)"
    )
    (msg,) = check([[_step(5, 1, 3, e["reduce_scatter"]["bytes"][0])]], e)
    assert msg.startswith(
        "communication differs at step 0 on rank 0: all_gather moved 1 bytes, expected 320 to 360 (padding)"
    )


def test_collectives_are_read_from_torch_xla_hlo_text():
    from shardcore_conformance.xla_comm import hlo_collectives

    text = "\n".join(
        [
            "  %p.3 = f32[128]{0} parameter(0)",
            "  %all-gather.5 = f32[256]{0} all-gather(f32[128]{0} %p.3), replica_groups={{0,1}}, dimensions={0}",
            "  %all-gather.6 = bf16[2,256]{1,0} all-gather(bf16[1,256]{1,0} %q), replica_groups={}, dimensions={0}",
            "  %reduce-scatter.9 = (f32[128]{0}, f32[]) reduce-scatter(f32[256]{0} %g, f32[] %t), "
            "replica_groups={{0,1}}, dimensions={0}, to_apply=%AddComputation.7",
            "  %all-reduce.2 = (f32[4]{0}, f32[]) all-reduce(f32[4]{0} %n, f32[] %t), replica_groups={{0}}",
        ]
    )
    got = hlo_collectives(text, world_size=2)
    assert got["all_gather"] == {"count": 2, "bytes": 256 * 4 + 512 * 2, "group_sizes": [2], "groups": [[0, 1]]}
    assert got["reduce_scatter"] == {"count": 1, "bytes": 256 * 4, "group_sizes": [2], "groups": [[0, 1]]}
    assert got["all_reduce"]["count"] == 0  # a group of one rank moves nothing


def test_replica_groups_in_xla_compact_form():
    """``[G,S]<=[dims]T(perm)``: XLA's iota form, as the partitioner prints groups across a 2-D mesh."""
    from shardcore_conformance.xla_comm import hlo_collectives

    line = "  %a = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups=%s, to_apply=%add"
    rows = hlo_collectives(line.replace("%s", "[2,2]<=[4]"), world_size=4)["all_reduce"]
    columns = hlo_collectives(line.replace("%s", "[2,2]<=[2,2]T(1,0)"), world_size=4)["all_reduce"]
    every = hlo_collectives(line.replace("%s", "[1,4]<=[4]"), world_size=4)["all_reduce"]
    assert (rows["groups"], columns["groups"], every["groups"]) == ([[0, 1]], [[0, 2]], [[0, 1, 2, 3]])


def _spmd_step(**groups: list[list[int]]) -> dict:
    return {k: {"count": len(groups.get(k, [])), "bytes": 8, "groups": groups.get(k, [])} for k in KINDS}


def test_spmd_floors_need_gathers_along_fsdp_and_gradient_sums_over_the_batch():
    """The partitioner's choices are free; what the config forces is checked: parameters gathered
    along ``fsdp``, gradients summed over the shards and (HSDP) across replicas, every group an axis."""
    from shardcore_conformance.xla_comm import expected_spmd

    plain = expected_spmd(_units(), parse_config({"xla": True, "xla_fsdp_v2": True}), 2, 1)
    assert plain.check([[_spmd_step(all_gather=[[0, 1]], all_reduce=[[0, 1]])]]) == []
    (msg,) = plain.check([[_spmd_step(all_gather=[[0, 1]])]])  # every device computed the whole batch
    assert msg.startswith("communication differs at step 0: no all_reduce or reduce_scatter along fsdp or all")
    assert "sum over the 2 shards" in msg
    (msg,) = plain.check([[_spmd_step(all_reduce=[[0, 1]])]])  # parameters kept whole
    assert "no all_gather along fsdp or all" in msg

    hsdp = expected_spmd(_units(), parse_config({"xla": True, "xla_fsdp_v2": True, "dp_replicate_size": 2}), 4, 1)
    rows, columns = [[0, 1]], [[0, 2]]  # fsdp (a replica's shards), replicate (one shard's replicas)
    assert hsdp.check([[_spmd_step(all_gather=rows, reduce_scatter=rows, all_reduce=columns)]]) == []
    assert hsdp.check([[_spmd_step(all_gather=rows, all_reduce=[[0, 1, 2, 3]])]]) == []
    (msg,) = hsdp.check([[_spmd_step(all_gather=rows, all_reduce=rows)]])  # replicas never meet
    assert "no all_reduce or reduce_scatter along replicate or all" in msg and "2 replicas" in msg
    (msg,) = hsdp.check([[_spmd_step(all_gather=[[0, 3]], all_reduce=[[0, 1, 2, 3]])]])
    assert "all_gather over devices [0, 3], which is no axis of the 2 x 2 mesh" in msg
    frozen = [{**u, "with_grad": []} for u in _units()]
    frozen = expected_spmd(frozen, parse_config({"xla": True, "xla_fsdp_v2": True}), 2, 1)
    assert frozen.check([[_spmd_step(all_gather=[[0, 1]])]]) == []  # nothing to reduce


def test_xla_fsdp_gathers_each_tensor_padded_to_128_per_rank():
    from shardcore_conformance.xla_comm import expected_xla_fsdp

    xla = parse_config({"xla": True})
    e = expected_xla_fsdp(_units(), xla, world_size=2, grad_accum=1)
    # 6 tensors; l0 and l1 gathered again in backward; the root (kept gathered) once
    assert e["all_gather"]["count"] == 2 + 2 + 2 + 2 + 2 and e["reduce_scatter"]["count"] == 6
    assert e["all_gather"]["bytes"][1] == 10 * 256 * 4 and e["reduce_scatter"]["bytes"] == [45 * 4, 6 * 256 * 4]
    # no_sync: resharded units gather in each micro-batch; the root keeps its tensors across them
    assert expected_xla_fsdp(_units(), xla, 2, grad_accum=3)["all_gather"]["count"] == 3 * 8 + 2
    off = parse_config({"xla": True, "reshard_after_forward": False})
    assert expected_xla_fsdp(_units(), off, 2, grad_accum=3)["all_gather"]["count"] == 6
    # a frozen unit the backward never reaches: gathered once per micro-batch, never reduced
    frozen = expected_xla_fsdp(_units(frozen_first=True), off, 2, grad_accum=3)
    assert frozen["all_gather"]["count"] == 2 * 3 + 4 and frozen["reduce_scatter"]["count"] == 4
    bf16 = parse_config({"xla": True, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}})
    e = expected_xla_fsdp(_units(), bf16, 2, 1)  # gathered in bf16, gradients reduced in fp32
    assert e["all_gather"]["bytes"][1] == 10 * 256 * 2 and e["reduce_scatter"]["bytes"][1] == 6 * 256 * 4
    assert all(v["count"] == 0 for v in expected_xla_fsdp(_units(), xla, 1, 1).values())


def test_xla_fsdp_settings_that_change_the_pattern():
    from shardcore_conformance.xla_comm import expected_xla_fsdp

    flat = parse_config({"xla": True, "xla_fsdp_settings": {"flatten_parameters": True}})
    e = expected_xla_fsdp(_units(), flat, 2, 1)  # one flat tensor per unit
    assert e["all_gather"]["count"] == 2 + 2 + 1 and e["reduce_scatter"]["count"] == 3
    dim0 = parse_config({"xla": True, "xla_fsdp_settings": {"shard_param_on_dim_0": True}})
    assert expected_xla_fsdp(_units(), dim0, 2, 1)["all_gather"]["count"] == 10
    bucket = parse_config({"xla": True, "xla_fsdp_settings": {"reduce_scatter_bucket_size_mb": 25}})
    assert expected_xla_fsdp(_units(), bucket, 2, 1) is None  # coalesced: reported, not predicted
