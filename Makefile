# The two commands of the README: `make demo` and `make test`.
# Both create .venv on first use (Python 3.11), install the project with its extras,
# and refresh it when pyproject.toml changes.  `make test` also installs, from Debian's
# packages, the programs its tests run for real (mosquitto, RabbitMQ, arecord) when they are missing.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Debian packages the tests run for real: the MQTT broker, the ALSA capture tool, and the
# browser the console's test drives (Playwright on Debian's chromium; never `playwright install`),
# and systemd-analyze, which verifies the units `fleet init` writes (the systemd package, ~15 MB).
# rabbitmq-server (3.10, with Erlang ~60 MB): the end-to-end suite runs on its MQTT plugin too, one
# node and a two-node cluster (a broker cluster's semantics: retained messages per node).
# mosquitto also brings mosquitto_passwd (a test checks our password hashes against it).
# Not here, on purpose: qemu-user-static, debootstrap, systemd-container (only `make pi-check` and
# `make services-check` run them; their tests render reports from given figures and run none).
TEST_DEBS := mosquitto mosquitto-clients alsa-utils chromium systemd rabbitmq-server

.PHONY: demo test test-deps lint explore bench clean
.PHONY: pi-check services-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The local CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# `make demo CONSOLE=1` leaves the live fleet console up (its URL is printed) until Ctrl-C.
demo: $(STAMP)
	$(BIN)/cloud-aggregator demo $(if $(CONSOLE),--console)

# mosquitto, rabbitmq-server, arecord and chromium from Debian when missing (as root; otherwise one line
# saying what to install).  The tests start their own brokers on free loopback ports, so the install
# starts no service: a policy-rc.d that says 101 ("not now", Debian's switch; only where none is
# there already) keeps the packages' postinst from starting a system mosquitto or RabbitMQ node,
# and under systemd the rabbitmq-server unit just installed is disabled (no node at the next boot).
test-deps:
	@missing=""; \
	{ command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ]; } || missing="$$missing mosquitto mosquitto-clients"; \
	command -v arecord >/dev/null || missing="$$missing alsa-utils"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing="$$missing rabbitmq-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make test needs:$$missing -- run: sudo apt-get install -y$$missing" >&2; exit 1; fi; \
	  echo "installing from Debian:$$missing"; \
	  guard=""; \
	  if [ ! -e /usr/sbin/policy-rc.d ]; then guard=1; printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; rc=$$?; \
	  if [ -n "$$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	  case "$$missing" in *rabbitmq-server*) \
	    [ -d /run/systemd/system ] && systemctl disable --now rabbitmq-server >/dev/null 2>&1 || true;; \
	  esac; \
	  exit $$rc; \
	fi

# The suite, deterministic: hypothesis runs derandomized (profile "ci"); tests that need
# mosquitto fail instead of skipping.  Two processes (pytest-xdist): most of its time is spent
# waiting on brokers and device processes, so two share 2 cores well (36 -> 21 min on a busy box).
# Every test starts its own broker on a free port and works in its own tmp_path.
test: $(STAMP) test-deps
	CI=1 HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 2 --durations=15

# Property tests with 30x their CI budgets and fresh random examples (not run by CI).
explore: $(STAMP)
	HYPOTHESIS_PROFILE=explore IOFT_HYPOTHESIS_SCALE=30 $(BIN)/python -m pytest -q -m "not slow" -p no:randomly \
	  $$(grep -rl "hypothesis" tests --include="test_*.py")

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m benchmarks.architecture --check
	# The documentation site (docs/): a broken link or a page left out of the nav fails.
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# $(call debs,PROGRAM:PACKAGE ...): install from Debian each package whose program is missing
# (the hand-run checks below; `make test` needs none of these).
debs = @missing=""; for pair in $(1); do command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair\#\#*:}"; done; \
  if [ -n "$$missing" ]; then echo "installing from Debian:$$missing"; \
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi

# The device side on Debian bookworm arm64 (Raspberry Pi OS's base) under qemu-user-static, as root;
# not part of `make test`.  Builds /var/tmp/ioft-pi-root once; writes deploy/results/pi_check.md.
# PI_CHECK_ARGS="--skip-tests" for a quicker pass (the tests take most of the time under qemu).
pi-check: $(STAMP)
	$(call debs,qemu-aarch64-static:qemu-user-static debootstrap:debootstrap update-binfmts:binfmt-support)
	$(BIN)/python -m deploy.pi_check $(PI_CHECK_ARGS)

# The systemd units and the README's install steps under a real systemd (a Debian bookworm root
# booted by systemd-nspawn, as root; needs debootstrap and systemd-container); not part of `make test`.
services-check: $(STAMP)
	$(call debs,debootstrap:debootstrap systemd-nspawn:systemd-container)
	$(BIN)/python -m deploy.services_check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
