"""The environment a `tritonserver` and its Python-backend stubs get (tools/triton_env.py):
torch's threads in the engine's stub are every core the launcher may use unless it says."""
from __future__ import annotations

import os

from triton_env import server_env, usable_cores


def test_the_stubs_get_every_usable_core_unless_told_otherwise():
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1
    assert server_env({"PATH": "/usr/bin"})["OMP_NUM_THREADS"] == str(usable_cores())
    assert server_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
