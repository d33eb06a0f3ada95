"""Parity of the XLA backend against one device on CPU PJRT: XLA FSDP and SPMD FSDPv2 over every
knob, HSDP conformance on 4 devices, and the broken variants the suite must catch.

CPU PJRT devices are threads of one process (CPU_NUM_DEVICES); each run starts its own process.
"""

from dataclasses import replace

import pytest

from shardcore_conformance import Case, run_suite

from xla_helpers import V2, X
from xla_helpers import assert_ok as _assert_ok

pytestmark = pytest.mark.xla  # skipped, saying so, where torch_xla is not installed (conftest.py)


# --------------------------------------------------------------- parity against one device


@pytest.mark.multiprocess
def test_spmd_fsdpv2_parity_on_2_cpu_devices():
    cases = [
        Case("xla-spmd-mlp", "mlp", V2),
        Case("xla-spmd-llama", "llama", V2),
        Case("xla-spmd-llama-gc", "llama", {**V2, "xla_fsdp_grad_ckpt": True}),
        Case("xla-spmd-llama-size", "llama", {**V2, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000}),
        Case("xla-spmd-llama-nowrap", "llama", {**V2, "auto_wrap_policy": "NO_WRAP"}),
        Case("xla-spmd-gpt2-tied", "gpt2", V2),
        Case("xla-spmd-frozen-llama", "llama", V2, frozen=("model.embed_tokens.*", "model.layers.0.*")),
        Case("xla-spmd-grad_accum-llama", "llama", V2, grad_accum=2),
        Case("xla-spmd-buffers-mlp", "mlp_buffers", V2),
        Case("xla-spmd-two-outputs", "mlp_two_outputs", V2),
        Case("xla-spmd-two-outputs-gc", "mlp_two_outputs", {**V2, "xla_fsdp_grad_ckpt": True}),
        Case("xla-spmd-sharded-checkpoint", "llama", {**V2, "state_dict_type": "SHARDED_STATE_DICT"}),
    ]
    tp = _tp_cases(2, SPMD_TP_CASES_2)  # the tp family's cases with their own programs to compile
    result = run_suite(cases + tp, "xla", world_size=2, case_timeout=300)
    _assert_ok(result)
    # read from the partitioned program, and checked against what the config forces
    assert all(v.comm_pattern == "spmd" and v.comm_checked and v.comm["all_gather"]["count"] for v in result.verdicts)
    _assert_tensor_parallel(result, tp)


#: the SPMD ``tp`` family's cases CI runs (``shardcore-conformance --backend xla`` runs all of them):
#: each model and plan once, a SHARDED resume, and the whole model in bf16; XLA:CPU compiles each program of a 2-D mesh in
#: about 8 s here
SPMD_TP_CASES_2 = "tp2-llama,tp2-qwen2,tp2-llama-plan,tp2-llama-bf16_weights,tp2-llama-sharded_state_dict"
SPMD_TP_CASES_4 = "dp2-tp2-llama,hsdp2x1-tp2-llama"


def _tp_cases(devices: int, pattern: str) -> list:
    from shardcore_conformance.cases import matrix_for, select

    cases = select(matrix_for("xla", devices), pattern)
    assert [c.name for c in cases] == pattern.split(",") and all(c.config["xla_fsdp_v2"] for c in cases)
    return cases


def _assert_tensor_parallel(result, tp: list) -> None:
    """Each tp case's weights split as its plan says (the placement check passed and saw splits),
    with the partial sums of the rowwise layers all-reduced over the tensor axis."""
    names = {c.name for c in tp}
    for v in result.verdicts:
        if v.case in names:
            split = result.sharded[v.case]["placement"]["ranks"][0]["tp_split"]
            assert split["model.layers.0.self_attn.o_proj.weight"] == 1, (v.case, split)
            assert split["model.layers.0.mlp.gate_proj.weight"] == 0, (v.case, split)
            assert {"tp_size", "tp_plan"} & set(v.observed.get("placement", ())), (v.case, v.observed)


def _xla_fsdp_cases() -> list:
    """Every XLA FSDP knob once: wrap policies, resharding, grad ckpt, each kind of setting, bf16,
    LlamaAttention units and plain units returning two outputs (the torch_xla bugs shardcore works
    around), tied weights, frozen parameters, buffers, uneven shards, accumulation."""
    return [
        Case("xla-fsdp-mlp", "mlp", X),
        Case(
            "xla-fsdp-llama-attention-units",
            "llama",
            {**X, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000},
        ),
        Case(
            "xla-fsdp-llama-attention-units-gc",
            "llama",
            {**X, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000, "xla_fsdp_grad_ckpt": True},
        ),
        Case("xla-fsdp-llama-gc-noreshard", "llama", {**X, "xla_fsdp_grad_ckpt": True, "reshard_after_forward": False}),
        Case("xla-fsdp-llama-mlp-units", "llama", {**X, "transformer_layer_cls_to_wrap": ["LlamaMLP", "Embedding"]}),
        Case(
            "xla-fsdp-llama-size-flat",
            "llama",
            {
                **X,
                "auto_wrap_policy": "SIZE_BASED_WRAP",
                "min_num_params": 2000,
                "xla_fsdp_settings": {"flatten_parameters": True},
            },
        ),
        Case("xla-fsdp-gpt2-tied", "gpt2", X),
        Case(
            "xla-fsdp-mlp-noreshard-dim0",
            "mlp",
            {**X, "reshard_after_forward": False, "xla_fsdp_settings": {"shard_param_on_dim_0": True}},
        ),
        Case("xla-fsdp-llama-nowrap", "llama", {**X, "auto_wrap_policy": "NO_WRAP"}),
        Case(
            "xla-fsdp-llama-bf16",
            "llama",
            {**X, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}},
            dtype="bf16",
            lr=1e-3,
        ),
        Case("xla-fsdp-two-outputs", "mlp_two_outputs", X),
        Case("xla-fsdp-two-outputs-noreshard", "mlp_two_outputs", {**X, "reshard_after_forward": False}),
        Case("xla-fsdp-two-outputs-gc", "mlp_two_outputs", {**X, "xla_fsdp_grad_ckpt": True}),
        Case("xla-fsdp-frozen-llama", "llama", X, frozen=("model.embed_tokens.*", "model.layers.0.*")),
        Case("xla-fsdp-buffers", "mlp_buffers", X),
        Case("xla-fsdp-uneven", "mlp_uneven", X),
        Case("xla-fsdp-grad_accum-llama", "llama", X, grad_accum=2),
        Case("xla-fsdp-sharded-checkpoint", "llama", {**X, "state_dict_type": "SHARDED_STATE_DICT"}),
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_xla_fsdp_parity_on_cpu_devices(devices):
    """XlaFullyShardedDataParallel for real on CPU device threads (xmp.spawn), every knob."""
    cases = [replace(c, global_batch=4 * devices) for c in _xla_fsdp_cases()]
    result = run_suite(cases, "xla", world_size=devices, case_timeout=300)
    _assert_ok(result)
    # each rank's collectives, read from its own traced graph, checked against the prediction
    for v in result.verdicts:
        assert v.comm_pattern == "xla_fsdp" and v.comm_checked, v.case
        ranks = result.sharded[v.case]["comm"]["ranks"]
        assert len(ranks) == devices and all(len(steps) == 5 for steps in ranks), v.case
        gathered, reduced = v.comm["all_gather"], v.comm["reduce_scatter"]
        if devices == 1:  # a group of one device moves nothing
            assert gathered["count"] == reduced["count"] == 0, v.case
        else:
            assert gathered["count"] >= reduced["count"] > 0 and gathered["bytes"] > 0, (v.case, v.comm)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case",
    [
        Case("two-outputs", "mlp_two_outputs", X),
        Case("two-outputs-gc", "mlp_two_outputs", {**X, "xla_fsdp_grad_ckpt": True}),
    ],
)
def test_unit_fixes_are_what_makes_two_output_units_train(case):
    """Without shardcore's fixes, a plain unit returning ``(out, w)`` (w an ancestor of out)
    trains with stale weights, or crashes under grad ckpt: torch_xla 2.9's bugs (unit_fix.py)."""
    result = run_suite([case], "broken_xla_backends:WithoutUnitFixes", world_size=1, case_timeout=300)
    assert not result.ok, "torch_xla no longer has the bug: drop the workaround (shardcore_xla/unit_fix.py)"
    reasons = " ".join(result.verdicts[0].reasons)
    assert ("Invoked with: [None]" in reasons) if "gc" in case.name else ("differs at step 1" in reasons), reasons


@pytest.mark.multiprocess
def test_broken_xla_variant_is_caught():
    """The suite catches a wrong XLA run: without the input sharding fix-up SPMD parity fails."""
    result = run_suite(
        [Case("xla-broken", "llama", V2)], "broken_xla_backends:NoLocalBatchScaling", world_size=2, case_timeout=300
    )
    assert not result.ok and "loss differs at step 0" in " ".join(result.verdicts[0].reasons)


# --------------------------------------------------------------- HSDP (dp_replicate_size x dp_shard_size)

#: the conformance hsdp family on 4 devices, whole (about a minute on 2 cores)
HSDP_CASES = (
    "hsdp2x2-mlp,hsdp2x2-llama,hsdp2x2-grad_accum-llama,hsdp2x2-llama-sharded_state_dict,hsdp2x2-gpt2,"
    "hsdp2x2-clip-llama,hsdp4x1-mlp,hsdp4x1-llama"
)


def _hsdp_cases(pattern: str) -> list[Case]:
    from shardcore_conformance.cases import matrix_for, select

    return select(matrix_for("xla", 4), pattern)


@pytest.mark.multiprocess
def test_spmd_hsdp_conformance_on_4_cpu_devices():
    """2 replicas x 2 shards and 4 x 1 under SPMD, each replica on its own rows, against one device."""
    cases = [c for c in _hsdp_cases("hsdp*") if c.family != "tp"]
    assert [c.name for c in cases] == HSDP_CASES.split(",") and all(c.config["xla_fsdp_v2"] for c in cases)
    tp = _tp_cases(4, SPMD_TP_CASES_4)  # and tensor parallelism under both
    result = run_suite(cases + tp, "xla", world_size=4, case_timeout=300)
    _assert_ok(result)
    _assert_tensor_parallel(result, tp)


@pytest.mark.multiprocess
def test_hsdp_replicas_training_on_the_same_rows_are_caught():
    result = run_suite(
        _hsdp_cases("hsdp2x2-mlp,hsdp4x1-mlp"),
        "broken_xla_backends:HSDPReplicasShareRows",
        world_size=4,
        case_timeout=300,
    )
    assert not result.ok and len(result.verdicts) == 2
    assert all("loss differs at step 0" in " ".join(v.reasons) for v in result.verdicts)


@pytest.mark.multiprocess
def test_spmd_that_trains_right_with_whole_parameters_fails_the_communication_check():
    """Numbers right, communication wrong: parameters annotated replicated before FSDPv2 wraps them
    (it leaves them so) train as plain data parallelism, on 2 devices and under HSDP 2 x 2. The
    partitioned program then gathers nothing along ``fsdp``."""
    plain = run_suite([Case("xla-whole-params", "llama", V2)], "broken_xla_backends:ReplicatedParameters", world_size=2)
    hsdp = run_suite(_hsdp_cases("hsdp2x2-llama"), "broken_xla_backends:ReplicatedParameters", world_size=4)
    for result in (plain, hsdp):
        (v,) = result.verdicts
        assert not v.ok and v.comm_checked and v.max_param_diff <= v.tolerance["param_atol"], v.reasons
        assert v.reasons and all(r.startswith("communication differs") for r in v.reasons), v.reasons
        assert "no all_gather along fsdp or all" in v.reasons[0], v.reasons


@pytest.mark.multiprocess
def test_spmd_that_does_not_split_the_batch_fails_the_placement_check():
    """Numbers right, devices wasted: a replicated batch (every device computes all of it) and, under
    HSDP, a batch split over the shards only (replicas compute the same rows). The communication
    does not show it (the partitioner then computes tensor-parallel style); the batch's sharding does."""
    plain = run_suite([Case("xla-replicated-batch", "llama", V2)], "broken_xla_backends:ReplicatedBatch", world_size=2)
    hsdp = run_suite(_hsdp_cases("hsdp2x2-llama"), "broken_xla_backends:HSDPBatchOverShardsOnly", world_size=4)
    for result, n in ((plain, 2), (hsdp, 4)):
        (v,) = result.verdicts
        assert not v.ok and v.max_param_diff <= v.tolerance["param_atol"], v.reasons
        assert len(v.reasons) == 1 and v.reasons[0].startswith(f"the batch is not split over the {n} devices"), (
            v.reasons
        )


# --------------------------------------------------------------- keys accepted and ignored


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend, pattern, check, key",
    [
        # the same numbers and collectives, every activation kept: only the recomputation check sees it
        (
            "IgnoresGradCkpt",
            "mlp-transformer-reshard1-v20-gc1,mlp-transformer-reshard1-v21-gc1",
            "recomputation differs in step 0 on rank 0: ",
            "xla_fsdp_grad_ckpt is set",
        ),
        # XLA FSDP and SPMD checkpoints without the optimizer's moments: resuming diverges
        ("DropsOptimizerState", "llama-resume,llama-sharded_state_dict-v21", "resuming diverged: ", "optimizer state"),
        # SPMD asked for, XLA FSDP run: the same numbers, each device fed its own rows
        ("IgnoresSpmd", "multi_output-mlp-v21", "the batch is not split over the 2 devices", "xla_fsdp_v2 is set"),
        # bf16 compute asked for, fp32 run: the all-gathers move fp32 (within bf16 tolerance, the numbers pass)
        ("IgnoresComputeDtype", "mlp-xla-bf16", "communication differs at step 0", "all_gather"),
    ],
)
def test_a_backend_that_ignores_a_key_fails_the_check_that_observes_it(backend, pattern, check, key):
    from shardcore_conformance.cases import matrix_for, select

    cases = select(matrix_for("xla", 2), pattern)
    assert [c.name for c in cases] == pattern.split(",")
    result = run_suite(cases, f"broken_xla_backends:{backend}", world_size=2, case_timeout=300)
    for v in result.verdicts:
        assert not v.ok and v.reasons[0].startswith(check) and key in v.reasons[0], (v.case, v.reasons)
        if "resuming" not in check:  # nothing else differed
            assert len(v.reasons) == 1 and v.max_param_diff <= v.tolerance["param_atol"], (v.case, v.reasons)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend, case, reason",
    [
        # every device one data-parallel group: the batch over all of them, no weight split
        ("SpmdIgnoresTensorParallel", "tp2-llama", "the batch is not split as 1 data-parallel x 2 tensor devices need"),
        # rowwise weights marked along their output dim
        (
            "SpmdSplitsRowwiseColwise",
            "tp2-llama",
            "tensor parallelism: rank 0's model.layers.0.mlp.down_proj.weight is split along dim 0 over the tp mesh "
            "dim; the plan (tp_size 2) has it split along dim 1",
        ),
        # the model's own plan split where the case's tp_plan says otherwise
        (
            "SpmdIgnoresTpPlan",
            "tp2-llama-plan",
            "tensor parallelism: rank 0's model.embed_tokens.weight is split along dim 0 over the tp mesh dim; the "
            "plan (tp_size 2) has it not split",
        ),
    ],
)
def test_spmd_that_gets_tensor_parallelism_wrong_fails_the_placement_check(backend, case, reason):
    """Numbers right, weights split wrong (or not at all): the placement check reads each weight's
    split from its shards on devices 0 and 1, neighbours on the tensor axis."""
    result = run_suite(_tp_cases(2, case), f"broken_xla_backends:{backend}", world_size=2, case_timeout=300)
    (v,) = result.verdicts
    assert not v.ok and v.max_param_diff <= v.tolerance["param_atol"], (v.reasons, v.max_param_diff)
    assert any(r.startswith(reason) for r in v.reasons), v.reasons


# --------------------------------------------------------------- LoRA (PEFT) on both XLA modes


@pytest.mark.multiprocess
def test_lora_family_on_2_cpu_devices():
    """A PEFT LoRA model in both XLA modes: trained to the single-device numbers with its base frozen,
    resumed from its adapter (FULL) and SHARDED checkpoints, and its adapter directory loaded by PEFT's
    own from_pretrained and its merged export by Transformers' to the reference's outputs."""
    from shardcore_conformance.cases import matrix_for

    cases = [c for c in matrix_for("xla", 2) if c.family == "lora"]
    assert {"lora-llama", "lora-llama-v21", "lora-gpt2", "lora-llama-sharded_state_dict-v21"} <= {c.name for c in cases}
    result = run_suite(cases, "xla", world_size=2, case_timeout=300)
    _assert_ok(result)
    for v in result.verdicts:
        ck = result.sharded[v.case]["checkpoint"]
        if "peft_probe" in ck:  # the adapter is a small part of the model
            assert 0 < ck["adapter_bytes"] < ck["merged_bytes"] / 10, (v.case, ck["adapter_bytes"], ck["merged_bytes"])
        assert result.reference[v.case]["frozen"], v.case  # the base: bit-identical after training
