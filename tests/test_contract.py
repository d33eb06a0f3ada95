"""The backend contract: required members and declared capabilities, checked when a backend is
loaded; callers ask isinstance instead of probing attributes; no package reaches into another's
private names."""

import ast
import re
from pathlib import Path

import pytest
from torch import nn

import shardcore
from shardcore import BackendUnavailableError, CheckpointError, ShardConfigError
from shardcore.backend import for_config
from shardcore.capabilities import (
    CAPABILITIES,
    ConfigResolved,
    ConfigValidation,
    GradClipping,
    ShardedCheckpoints,
    StepEnd,
    check_backend,
    declared,
)

from backends_for_tests import PlainBackend

ROOT = Path(__file__).resolve().parent.parent
IN_TREE = [
    "fsdp2",
    "broken_backends:SumGradsBackend",
    "broken_backends:WrongSliceBackend",
    "broken_backends:LocalNormClippingBackend",
    "backends_for_tests:PlainBackend",
    "backends_for_tests:OnlyWrapBackend",
    "backends_for_tests:UnavailableBackend",
]
XLA = ["xla", "broken_xla_backends:WithoutUnitFixes", "broken_xla_backends:NoLocalBatchScaling"]


def _with_xla():
    try:
        import shardcore_xla  # noqa: F401  (imports no torch_xla until a method runs)
    except ImportError:
        return []
    return XLA


def _implementations(backend):
    """A backend, or for a name resolved by the config (only XLA's: by xla_fsdp_v2) each implementation."""
    if not isinstance(backend, ConfigResolved):
        return [backend]
    return [for_config(backend, shardcore.parse_config({"xla": True, "xla_fsdp_v2": v2})) for v2 in (False, True)]


@pytest.mark.parametrize("name", IN_TREE + _with_xla())
def test_every_in_tree_backend_is_an_instance_of_exactly_what_it_declares(name):
    backend = shardcore.get_backend(name)
    assert [c for c in CAPABILITIES if isinstance(backend, c)] == declared(backend)
    for impl in _implementations(backend):
        assert isinstance(impl, shardcore.Backend)
        assert [c for c in CAPABILITIES if isinstance(impl, c)] == declared(impl)


def test_declared_capabilities_of_the_shipped_backends():
    names = lambda b: {c.__name__ for c in declared(shardcore.get_backend(b))}  # noqa: E731
    assert names("fsdp2") == {
        "ShardedCheckpoints",
        "AsyncShardedCheckpoints",
        "AsyncFullCheckpoints",
        "GradClipping",
        "GradSyncControl",
        "ConfigValidation",
        "ModelValidation",
        "GlobalGradSquares",
        "SlicedLoading",
        "TensorParallel",
    }
    assert names("backends_for_tests:PlainBackend") == set()
    if _with_xla():
        assert names("xla") == {"ConfigResolved", "ConfigValidation", "Launcher", "DeviceLaunch"}
        fsdp, spmd = _implementations(shardcore.get_backend("xla"))
        assert type(fsdp).__name__ == "XlaFsdpBackend" and type(spmd).__name__ == "SpmdBackend"
        assert {c.__name__ for c in declared(spmd)} == {c.__name__ for c in declared(fsdp)} | {"TensorParallel"}
        assert {c.__name__ for c in declared(fsdp)} == {
            "ShardedCheckpoints",
            "StepEnd",
            "GradClipping",
            "GradSyncControl",
            "Launcher",
            "DeviceLaunch",
            "ConfigValidation",
            "ModelValidation",
            "CompileCounter",
            "RenamesParameters",
            "SlicedLoading",
        }
        # XLA reads FULL checkpoints in slices but shards only models with weights
        assert not fsdp.shards_without_weights(shardcore.parse_config({"xla": True}))
    assert shardcore.get_backend("fsdp2").shards_without_weights(shardcore.parse_config({}))


class _DeclaresWithoutDefining(PlainBackend, StepEnd):
    name = "declares-step-end"


class _DefinesWithoutDeclaring(PlainBackend):
    name = "defines-clip"

    def clip_grad_norm_(self, model, max_norm, norm_type):
        raise AssertionError("never called")


class _Incomplete:
    name = "incomplete"
    install_hint = "-"
    supported_keys = frozenset()

    def is_available(self):
        return True, ""


class _ShardedKeyWithoutCapability(PlainBackend):
    name = "sharded-key"
    supported_keys = frozenset({"state_dict_type"})


class _TpKeyWithoutCapability(PlainBackend):
    name = "tp-key"
    supported_keys = frozenset({"tp_size"})


@pytest.mark.parametrize(
    "cls,words",
    [
        (_DeclaresWithoutDefining, ["declares StepEnd but does not define step_end"]),
        (_DefinesWithoutDeclaring, ["defines clip_grad_norm_ of GradClipping without declaring it"]),
        (_Incomplete, ["lacks the required Backend member(s) apply, world, barrier", "load_full_optimizer_state_dict"]),
        (_ShardedKeyWithoutCapability, ["state_dict_type", "does not declare ShardedCheckpoints"]),
        (_TpKeyWithoutCapability, ["supported_keys include tp_size but it does not declare TensorParallel"]),
    ],
)
def test_a_backend_that_breaks_the_contract_is_refused_when_loaded(cls, words):
    for load in (lambda: shardcore.get_backend(f"{__name__}:{cls.__name__}"), lambda: shardcore.get_backend(cls())):
        with pytest.raises(BackendUnavailableError) as e:
            load()
        assert "breaks the backend contract" in str(e.value)
        for w in words:
            assert w in str(e.value)
    with pytest.raises(BackendUnavailableError):
        shardcore.shard(nn.Linear(2, 2), {}, backend=cls())


class _Resolver(ConfigResolved):
    """A name whose implementation depends on the config: PlainBackend, or (wrongly) itself for SIZE_BASED_WRAP."""

    name = "resolver"
    install_hint = "-"
    supported_keys = frozenset({"auto_wrap_policy"})

    def is_available(self):
        return True, ""

    def resolve(self, config):
        return self if config.auto_wrap_policy == "SIZE_BASED_WRAP" else PlainBackend()


class _ResolverThatSteps(_Resolver, StepEnd):
    def step_end(self):
        raise AssertionError("never called")


def test_a_name_resolved_by_the_config_shards_with_the_implementation_it_resolves_to():
    model = shardcore.shard(nn.Linear(2, 2), {"auto_wrap_policy": "NO_WRAP"}, backend=_Resolver())
    assert type(shardcore.handle(model).backend) is PlainBackend
    with pytest.raises(BackendUnavailableError, match="must return an implementation"):
        shardcore.shard(
            nn.Linear(2, 2), {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1}, backend=_Resolver()
        )
    with pytest.raises(BackendUnavailableError, match="declares ConfigResolved and StepEnd"):
        shardcore.get_backend(_ResolverThatSteps())


class _Refuses(PlainBackend, ConfigValidation):
    name = "refuses"
    supported_keys = frozenset({"auto_wrap_policy", "min_num_params"})
    applied = 0

    def validate(self, config):
        if config.auto_wrap_policy == "NO_WRAP":
            raise ShardConfigError("auto_wrap_policy", "NO_WRAP is refused by this backend. Use another policy.")

    def apply(self, model, plan, config):
        type(self).applied += 1
        return model


def test_shard_runs_the_backends_validation_before_apply():
    with pytest.raises(ShardConfigError, match="refused by this backend") as e:
        shardcore.shard(nn.Linear(2, 2), {"auto_wrap_policy": "NO_WRAP"}, backend=_Refuses())
    assert e.value.key == "auto_wrap_policy" and _Refuses.applied == 0
    shardcore.shard(nn.Linear(2, 2), {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1}, backend=_Refuses())
    assert _Refuses.applied == 1


def test_sharded_checkpoints_need_the_capability(tmp_path):
    model = shardcore.shard(nn.Linear(4, 4), {"auto_wrap_policy": "NO_WRAP"}, backend=PlainBackend())
    assert not isinstance(shardcore.handle(model).backend, ShardedCheckpoints)
    with pytest.raises(CheckpointError, match="does not implement SHARDED_STATE_DICT.*ShardedCheckpoints"):
        shardcore.save(model, tmp_path / "ckpt", state_dict_type="SHARDED_STATE_DICT")
    assert not (tmp_path / "ckpt").exists()
    shardcore.save(model, tmp_path / "full")  # FULL needs only the required methods
    shardcore.load(model, tmp_path / "full")


def test_check_backend_accepts_the_vendor_example():
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "vendor_backend"))
    try:
        from shardcore_replicate_example import ReplicateBackend
    finally:
        sys.path.pop(0)
    check_backend(ReplicateBackend(), "replicate-example")
    assert {c.__name__ for c in declared(ReplicateBackend())} == {"GradClipping", "GlobalGradSquares"}
    assert isinstance(ReplicateBackend(), GradClipping)


def _python_files():
    for top in ("shardcore", "backends", "conformance", "examples"):
        yield from (p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


def _package(path: Path) -> str:
    """The top-level import package a source file belongs to (shardcore, shardcore_xla, ...)."""
    parts = path.relative_to(ROOT).parts
    for i, part in enumerate(parts):
        if part.startswith("shardcore"):
            return part.removesuffix(".py")
    return parts[0]


def test_no_module_imports_another_packages_private_names():
    """Public helpers instead of private imports: ``from other_package... import _name`` and
    ``other_package.module._name`` are refused (a package's own modules may share its privates)."""
    found = []
    for path in _python_files():
        pkg = _package(path)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                if top.startswith("shardcore") and top != pkg:
                    found += [
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_")
                    ]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                chain = ast.unparse(node.value)
                top = chain.split(".")[0]
                if re.fullmatch(r"shardcore[a-z_]*", top) and top != pkg:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {chain}.{node.attr}")
    assert not found, found
