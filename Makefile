# `sudo make run` / `sudo make test`: every target but clean first runs scripts/setup.sh (idempotent;
# needs root), which makes .venv with bcc from Debian's python3-bpfcc.
REPO := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
VENV := $(REPO)/.venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup run test bench deb clean

setup:
	bash $(REPO)/scripts/setup.sh

run: setup
	cd $(REPO) && $(VENV)/bin/mcp-agent run $(ARGS)

test: setup
	cd $(REPO) && $(VENV)/bin/python -m pytest -v -ra $(PYTEST_ARGS)

bench: setup
	cd $(REPO) && $(VENV)/bin/python bench/run_all.py

# build/mcp-hostagent_<version>_<arch>.deb: installs with no network (packaging/build-deb.sh)
deb: setup
	bash $(REPO)/packaging/build-deb.sh --out $(REPO)/build

clean:
	rm -rf $(VENV)
