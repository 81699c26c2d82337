# The two commands the README gives. Both do their own set-up (scripts/setup.sh is idempotent).
.PHONY: run test setup lint bench peer

run:
	@scripts/setup.sh
	.venv/bin/chatd serve $(ARGS)

test:
	@scripts/setup.sh --test
	.venv/bin/python -m pytest $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check chatd tests benchmarks
	.venv/bin/mypy

bench:
	@scripts/setup.sh
	.venv/bin/python -m benchmarks $(ARGS)

# llama.cpp's llama-server for the benchmarks' peer section, built once outside the checkout.
peer:
	@scripts/build-peer.sh
