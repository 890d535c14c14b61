"""The collection as Ansible's own tools read it (issue 17 item 10): module docs that ansible-doc renders
without a warning or a "null", the license the package has, the install role's argument specs, and
the whole collection passing `ansible-test sanity` and ansible-lint's production profile.

The first tests check the findings ansible-test and ansible-doc once made with the same parsers
(YAML, ansible-test's author rule), so they hold where ansible-core is not installed."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fleet.bed import ansible_venv
from tests.support import ansible_tools
from tests.support.ansible_tools import ANSIBLE_TEST, tool_env
from tests.support.paths import REPO
from tests.support.require import require

COLLECTION = REPO / "ansible_collections" / "vllm" / "ctxmgr"
MODULES = sorted((COLLECTION / "plugins" / "modules").glob("*.py"))
# the tests that run ansible-core's own tools use the fleet tier's venvs (make fleet-deps): that tier's
FLEET_TOOLS = pytest.mark.fleet
ANSIBLE_DOC = ansible_venv() / "bin" / "ansible-doc"  # the newest ansible-core the collection claims
# ansible-test's validate-modules schema.author_line
AUTHOR_LINE = re.compile(r"^\w.*(\(@([\w-]+)\)|!UNKNOWN)(?![\w.])")


def module_blocks(path: Path) -> dict[str, Any]:
    """DOCUMENTATION / RETURN of a module, read as ansible-doc reads them: YAML strings at top level."""
    blocks = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("DOCUMENTATION", "RETURN", "EXAMPLES"):
                blocks[name] = yaml.safe_load(ast.literal_eval(node.value))
    return blocks


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_module_docs_have_what_validate_modules_requires(path: Path) -> None:
    docs = module_blocks(path)["DOCUMENTATION"]
    authors = docs["author"] if isinstance(docs["author"], list) else [docs["author"]]
    assert all(AUTHOR_LINE.search(a) for a in authors), authors
    for name, attribute in docs["attributes"].items():
        assert attribute.get("description"), f"attributes.{name} has no description"
    for name, entry in module_blocks(path)["RETURN"].items():
        assert set(entry) <= {"description", "type", "returned", "sample", "contains", "elements"}, name
        assert entry["description"] is not None, name


def test_the_reason_return_value_is_one_sentence_not_a_key_named_in_plain_words() -> None:
    returned = module_blocks(COLLECTION / "plugins" / "modules" / "ctxmgr.py")["RETURN"]
    assert returned["reason"]["description"] == "why, in plain words"


def test_no_module_assigns_a_tuple_at_top_level() -> None:
    """ansible-doc warns 'failed to assign id for <ast.Tuple>' on every run for `A, B = 1, 2`."""
    for path in MODULES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                assert not any(isinstance(t, ast.Tuple) for t in node.targets), f"{path.name}:{node.lineno}"


def test_the_collection_has_the_packages_license() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject
    galaxy = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    assert galaxy["license"] == ["Apache-2.0"]
    assert (COLLECTION / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert f"## {galaxy['version']}" in (COLLECTION / "CHANGELOG.md").read_text()
    for meta in COLLECTION.glob("roles/*/meta/main.yml"):
        assert yaml.safe_load(meta.read_text())["galaxy_info"]["license"] == "Apache-2.0", meta
    for source in COLLECTION.rglob("*.py"):
        assert "General Public License" not in source.read_text(), source


# rolling_context's load-balancer commands hold `{{ lb_server }}`, defined only when lb.yml runs: as
# options they would be templated by the validation ansible-core runs before the role, and fail there
UNVALIDATED = {
    "rolling_context": {
        f"rolling_context_lb_{step}_cmd" for step in ("drain", "wait_idle", "undrain", "wait_up")
    }
}


@pytest.mark.parametrize("name", ["install", "rolling_context"])
def test_each_role_documents_every_default_in_its_argument_specs(name: str) -> None:
    role = COLLECTION / "roles" / name
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
    unvalidated = UNVALIDATED.get(name, set())
    documented = {option: spec["options"][option].get("default") for option in spec["options"]}
    assert documented == {k: v for k, v in defaults.items() if k not in unvalidated}
    assert all(option.get("description") for option in spec["options"].values())
    description = " ".join(spec["description"])
    assert all(variable in description for variable in unvalidated)  # named in the role's description
    readme = (role / "README.md").read_text()
    assert all(f"`{variable}`" in readme for variable in defaults), "a variable the README does not name"


ARGS_ONLY_PLAY = """
- hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - role: vllm.ctxmgr.rolling_context
"""


@FLEET_TOOLS
@pytest.mark.parametrize("version", ["2.15", "2.19"])
@pytest.mark.parametrize(
    ("extra_vars", "error"),
    [
        ({"rolling_context_max_model_len": 4096, "rolling_context_lb": "command",
          "rolling_context_lb_drain_cmd": "echo drain {{ lb_server }}"}, None),
        ({}, "rolling_context_max_model_len"),
        ({"rolling_context_max_model_len": 4096, "rolling_context_lb": "nginx"}, "haproxy, command, none"),
        ({"rolling_context_max_model_len": 4096, "rolling_context_edit": "inplace"}, "in-place, dropin"),
    ],
    ids=["valid-command-lb", "no-context", "unknown-lb", "unknown-edit"],
)  # fmt: skip
def test_ansible_core_checks_the_rolling_context_arguments_before_the_role_runs(
    workdir: Path, version: str, extra_vars: dict[str, Any], error: str | None
) -> None:
    """The validation ansible-core runs from meta/argument_specs.yml (the only task tagged `always`, so
    `--tags` of no task runs it alone): it accepts a command load balancer whose commands hold
    `{{ lb_server }}`, and refuses what the role's own assert refuses, naming the variable."""
    playbook_bin = ansible_venv(version) / "bin" / "ansible-playbook"
    require(None if playbook_bin.exists() else f"no {playbook_bin} (make fleet-deps)", "ansible-playbook")
    play = workdir / "play.yml"
    play.write_text(ARGS_ONLY_PLAY)
    variables = workdir / "vars.json"
    variables.write_text(json.dumps(extra_vars))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}  # fmt: skip
    done = subprocess.run(
        [str(playbook_bin), "-i", "localhost,", str(play), "--tags", "no-such-tag", "-e", f"@{variables}"],
        capture_output=True, text=True, env=env, cwd=workdir, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert "Validating arguments against arg spec 'main'" in output, output[-3000:]
    if error is None:
        assert done.returncode == 0, output[-3000:]
        assert "ok=1" in output, output[-3000:]
    else:
        assert done.returncode != 0, output[-3000:]
        assert "Validation of arguments failed" in output and error in output, output[-3000:]


@FLEET_TOOLS
@pytest.mark.parametrize("plugin", ["vllm.ctxmgr.ctxmgr", "vllm.ctxmgr.haproxy_server"])
def test_ansible_doc_renders_the_modules_without_a_warning_or_a_null(plugin: str) -> None:
    require(None if ANSIBLE_DOC.exists() else f"no {ANSIBLE_DOC} (make fleet-deps)", "ansible-doc")
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([str(ANSIBLE_DOC), plugin], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stderr
    assert "in plain words: null" not in done.stdout  # RETURN.reason, once parsed as a key


ANSIBLE_LINT = Path(os.environ.get("CTXMGR_ANSIBLE_LINT", ansible_venv() / "bin" / "ansible-lint"))


@FLEET_TOOLS
def test_the_collection_passes_ansible_lints_production_profile() -> None:
    require(None if ANSIBLE_LINT.exists() else f"no {ANSIBLE_LINT} (make fleet-deps)", "ansible-lint")
    done = subprocess.run(
        [str(ANSIBLE_LINT), "--nocolor", "--offline", "--profile", "production"],
        capture_output=True, text=True, env=tool_env(ANSIBLE_LINT.parent.parent), cwd=COLLECTION, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Profile 'production' was required, and it passed" in done.stdout + done.stderr
    assert "0 failure(s), 0 warning(s)" in done.stdout + done.stderr  # warnings are findings too


@FLEET_TOOLS
def test_the_collection_passes_ansible_test_sanity(workdir: Path) -> None:
    """Every sanity test ansible-test has (validate-modules, pep8, yamllint, pylint, import, compile,
    ansible-doc, ...) on the controller's Python 3.11, each in the venv ansible-test makes for it with
    its own pinned checkers from the package index (built in `make test`'s setup: `python -m
    tests.support.ansible_tools prime`); tests/sanity/ignore-X.Y.txt holds the exceptions."""
    require(None if ANSIBLE_TEST.exists() else f"no {ANSIBLE_TEST} (make fleet-deps)", "ansible-test")
    done = ansible_tools.sanity(workdir)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for test in ("validate-modules", "pep8", "yamllint", "pylint", "import"):
        assert f'Running sanity test "{test}"' in output, output[-3000:]
    assert "ERROR" not in output, output[-6000:]
