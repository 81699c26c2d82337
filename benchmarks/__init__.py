"""chatd's benchmark suite: the project's figures, each a ratio or a distribution measured in one run.

Run ``python -m benchmarks --quick`` (or ``--full``); see docs/performance.md for what every figure
means. The modules, one per group of figures:

* :mod:`benchmarks.snapshots` — restore from a snapshot vs re-prefill; snapshot codec settings;
* :mod:`benchmarks.conversation` — time to first token with and without the kept cache; edit cost;
* :mod:`benchmarks.serving` — decode through the websocket vs the model directly; concurrency;
* :mod:`benchmarks.memory` — resident KV bytes vs the budget over a many-session workload;
* :mod:`benchmarks.peer` — the same model under llama.cpp's ``llama-server``, when one is given.

``CHATD_CPU_ISA`` (chatd.engine.kernels.cpu) runs every benchmark as a smaller CPU class would: its cap is passed on
to torch and oneDNN here, before any benchmark module imports torch, and the report names the features in effect.
"""

from __future__ import annotations

from chatd.engine.kernels.cpu import library_environment

library_environment()
