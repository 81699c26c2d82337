"""``python -m benchmarks [--quick|--full] [--out DIR] [--device cpu|cuda]``."""

from __future__ import annotations

from benchmarks.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
