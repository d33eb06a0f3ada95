"""What a zygote runs for a conformance worker (launch.py): ``_worker`` with the arguments the
runner wrote as JSON into its own temporary directory."""

import json
import sys

from shardcore_conformance.launch import _worker

if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        args = json.load(f)
    _worker(int(sys.argv[1]), *args)
