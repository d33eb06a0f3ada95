"""Prints which backend packages ``import shardcore`` and ``parse_config`` loaded: none, since the
core finds backends only through entry points, when one is asked for."""

import sys

import shardcore

shardcore.parse_config({})
print(sorted(m for m in sys.modules if m.startswith("shardcore_")))
