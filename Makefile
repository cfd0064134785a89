# The two set-up commands of the README. Both install what they need first.
PYTHON ?= python3

.PHONY: chat test setup
setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

chat: setup
	$(PYTHON) -m kvchat

test: setup
	$(PYTHON) -m pytest -q
