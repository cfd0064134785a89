# The two set-up commands of the README. Both install what they need first.
PYTHON ?= python3

.PHONY: chat test setup
setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

chat: setup
	$(PYTHON) -m kvchat

# the suite on one worker per core, at most 4 (pytest-xdist; TEST_WORKERS=0: in this process), then
# the tests that time a wall-clock wait or run processes of their own, alone (tests/conftest.py: SERIAL)
TEST_WORKERS ?= auto

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup -m "not serial"
	$(PYTHON) -m pytest -q -m serial
