# The two set-up commands of the README. Both install what they need first.
PYTHON ?= python3

.PHONY: chat test setup
setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

chat: setup
	$(PYTHON) -m kvchat

# the suite on one worker per core, at most 4 (pytest-xdist); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= auto

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup
