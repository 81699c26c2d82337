"""What tests share: model folders and the server process (from chatd.dev) and a from-scratch reference
decoder (from benchmarks.quality), the same ones the benchmarks use."""

from __future__ import annotations

from benchmarks.quality import reference_greedy
from chatd.dev import CACHE_DIR, ROOT, ServerProcess, free_port, packaged_model_dir, tiny_model_dir

__all__ = ["CACHE_DIR", "ROOT", "ServerProcess", "free_port", "packaged_model_dir", "reference_greedy",
           "tiny_model_dir"]
