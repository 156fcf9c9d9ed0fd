"""Test-wide settings: keep CPU vLLM in-process and small; make tests/ importable."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)
