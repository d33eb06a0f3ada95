"""The ``xla`` name resolves to XLA FSDP or SPMD by ``xla_fsdp_v2``; an implementation refuses the
other mode's config, and a process that used one mode refuses the other (SPMD is global to a process).
In this process, no device."""

import pytest

import shardcore
from shardcore import ShardConfigError, parse_config
from shardcore.backend import for_config, resolve_backend

from xla_helpers import V2, X

pytestmark = pytest.mark.xla  # skipped, saying so, where torch_xla is not installed (conftest.py)


def test_the_xla_name_resolves_by_xla_fsdp_v2():
    from shardcore_xla import SpmdBackend, XlaFsdpBackend

    xla = shardcore.get_backend("xla")
    assert type(for_config(xla, parse_config(X))) is XlaFsdpBackend
    assert type(for_config(xla, parse_config(V2))) is SpmdBackend
    assert resolve_backend(parse_config(V2)) is for_config(xla, parse_config(V2))  # one per resolver
    assert {type(xla.resolve(parse_config(c))).__name__ for c in (X, V2)} == {"XlaFsdpBackend", "SpmdBackend"}


@pytest.mark.parametrize("cfg,impl", [(V2, "XlaFsdpBackend"), (X, "SpmdBackend")])
def test_an_implementation_refuses_the_other_modes_config(cfg, impl):
    import shardcore_xla

    with pytest.raises(ShardConfigError) as e:
        getattr(shardcore_xla, impl)().validate(parse_config(cfg))
    assert e.value.key == "xla_fsdp_v2" and "backend='xla'" in str(e.value)


@pytest.mark.parametrize("used,cfg", [(False, V2), (True, X)])
def test_a_process_that_used_one_mode_refuses_the_other(monkeypatch, used, cfg):
    from shardcore_xla import settings

    monkeypatch.setattr(settings, "_process_mode", None)
    xla = shardcore.get_backend("xla")
    xla.validate(parse_config(cfg))
    settings.claim_mode(used)
    with pytest.raises(ShardConfigError) as e:
        xla.validate(parse_config(cfg))
    assert e.value.key == "xla_fsdp_v2" and "SPMD mode is global to a process" in str(e.value)
    assert f"already sharded a model with xla_fsdp_v2={used}" in str(e.value)
    xla.validate(parse_config({**cfg, "xla_fsdp_v2": used}))  # the mode it used is still fine
