"""Test-wide settings: keep CPU vLLM in-process and small; make tests/ importable."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)


# the rendezvous of a one-process group (runtime/parallel.py: init_distributed puts it in the
# environment): read once, when the group is made
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_inherited_rendezvous():
    """Groups this process made (some test modules make one when imported) leave their rendezvous
    in the environment; a command a test starts would inherit it and try to bind the port this
    process still listens on. The live groups no longer need it."""
    for key in RENDEZVOUS:
        os.environ.pop(key, None)
    yield
    for key in RENDEZVOUS:
        os.environ.pop(key, None)
