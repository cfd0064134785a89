# The two set-up commands of the README. Both install what they need first.
PYTHON ?= python3

.PHONY: chat test setup
setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

chat: setup
	$(PYTHON) -m kvchat

# the suite on one worker per core plus one, at most 4 (pytest-xdist; TEST_WORKERS=0: in this
# process): part of each worker's time is spent waiting on subprocesses, files and threads, and
# the extra worker fills it (on 2 cores the parallel part took 589 s with 3 workers, 685 s with
# 2); then the tests that time a wall-clock wait or run processes of their own, without the
# others (tests/conftest.py: SERIAL), in two lanes: those whose work runs in processes of their
# own (kvchat in tmux, a vLLM server) at a lower priority beside the rest (scripts/serial_lanes.py:
# 245 s beside 200 s, where one after the other took 420 s)
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(); print(min(4, (n or 1) + 1))")

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup -m "not serial"
	$(PYTHON) scripts/serial_lanes.py
