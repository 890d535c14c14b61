"""The collection as Ansible's own tools read it (issue 17 item 10): module docs that ansible-doc renders
without a warning or a "null", the license the package has, the install role's argument specs.

The full `ansible-test sanity --test validate-modules` needs a venv from the internet; these are the
findings it and ansible-doc made, checked with the same parsers (YAML, ansible-test's author rule)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fleet.bed import ansible_venv
from tests.support.require import require

REPO = Path(__file__).resolve().parent.parent
COLLECTION = REPO / "ansible_collections" / "vllm" / "ctxmgr"
MODULES = sorted((COLLECTION / "plugins" / "modules").glob("*.py"))
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


def test_the_install_role_documents_every_default_in_its_argument_specs() -> None:
    role = COLLECTION / "roles" / "install"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
    assert {name: option["default"] for name, option in spec["options"].items()} == defaults
    assert (role / "README.md").is_file()


@pytest.mark.parametrize("plugin", ["vllm.ctxmgr.ctxmgr", "vllm.ctxmgr.haproxy_server"])
def test_ansible_doc_renders_the_modules_without_a_warning_or_a_null(plugin: str) -> None:
    require(None if ANSIBLE_DOC.exists() else f"no {ANSIBLE_DOC} (make fleet-deps)", "ansible-doc")
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([str(ANSIBLE_DOC), plugin], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stderr
    assert "in plain words: null" not in done.stdout  # RETURN.reason, once parsed as a key


ANSIBLE_LINT = Path(os.environ.get("CTXMGR_ANSIBLE_LINT", ansible_venv() / "bin" / "ansible-lint"))


def test_the_install_role_passes_ansible_lints_production_profile() -> None:
    require(None if ANSIBLE_LINT.exists() else f"no {ANSIBLE_LINT} (make fleet-deps)", "ansible-lint")
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO), "NO_COLOR": "1",
           "PATH": f"{ANSIBLE_LINT.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}  # fmt: skip
    done = subprocess.run(
        [str(ANSIBLE_LINT), "--nocolor", "--offline", "--profile", "production", "roles/install",
         "playbooks/install.yml"],
        capture_output=True, text=True, env=env, cwd=COLLECTION, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Profile 'production' was required, and it passed" in done.stdout + done.stderr
