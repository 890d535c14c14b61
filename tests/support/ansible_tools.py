"""ansible-lint and ansible-test as the collection's tests run them, and the priming of ansible-test's
sanity venvs, which `make test` does while the other setup steps run (it is setup, not a check).

    python -m tests.support.ansible_tools prime    -> builds every sanity test's venv, runs no test

ansible-test runs each sanity test in a venv of its own pinned checkers, built from the package index
the first time and reused while the pins stay the same (keyed by their hash under TOOL_HOME). Building
them is most of a cold `ansible-test sanity`; `ansible-test sanity --prime-venvs` builds them alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fleet.bed import ansible_venv

REPO = Path(__file__).resolve().parent.parent.parent
COLLECTION = REPO / "ansible_collections" / "vllm" / "ctxmgr"
ANSIBLE_TEST = ansible_venv() / "bin" / "ansible-test"
# ansible-test's pip bootstrap, saved where ansible-test looks before it downloads one (see the file)
GET_PIP = REPO / "tests" / "support" / "ansible_test_get_pip.py"
# HOME for ansible-lint and ansible-test: their caches and ansible-test's per-test venvs stay in the
# checkout (kept between runs: a venv is reused while ansible-test's pinned requirements are the same)
TOOL_HOME = REPO / ".cache" / "ansible-tools-home"
SANITY = ["sanity", "--local", "--python", "3.11", "--color", "no"]


def tool_env(venv: Path) -> dict[str, str]:
    """The environment the Ansible tools run in: a private HOME and TMPDIR under .cache, the venv's
    tools first on the PATH; pip's own configuration (index, certificates) kept from the real HOME."""
    real_config = os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config"))
    tmp = TOOL_HOME / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(TOOL_HOME), "TMPDIR": str(tmp), "XDG_CONFIG_HOME": real_config,
            "ANSIBLE_COLLECTIONS_PATH": str(REPO), "NO_COLOR": "1", "ANSIBLE_NOCOLOR": "1",
            "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}  # fmt: skip


def collection_copy(root: Path) -> Path:
    """The collection where ansible-test needs it: in a tree ansible_collections/NAMESPACE/NAME, which
    the checkout has, but ansible-test writes tests/output inside it; a copy keeps the checkout clean.
    The copy is its own git repository: ansible-test lists a collection's files with git when it lies
    in a repository, and in the checkout's, where .cache is ignored, it would find none to test."""
    copy = root / "ansible_collections" / "vllm" / "ctxmgr"
    shutil.copytree(COLLECTION, copy, ignore=shutil.ignore_patterns("output", "__pycache__", "*.pyc"))
    subprocess.run(["git", "init", "-q", str(copy)], check=True, timeout=60)
    return copy


def save_pip_bootstrap(venv: Path) -> None:
    """ansible-test creates each sanity test's venv without pip and runs get-pip.py in it, downloaded
    from ci-files.testing.ansible.com, which CI cannot reach (it reaches package indexes only), unless
    ~/.ansible/test/cache/get_pip_<PIP VERSION>.py exists. Ours is saved there, under that version."""
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import types; from ansible_test._internal.python_requirements import get_venv_packages; "
         "print(get_venv_packages(types.SimpleNamespace(version='3.11'))['pip'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    cache = TOOL_HOME / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(GET_PIP, cache / f"get_pip_{version.replace('.', '_')}.py")


def sanity(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`ansible-test sanity` over a copy of the collection under `root`."""
    venv = ANSIBLE_TEST.parent.parent
    save_pip_bootstrap(venv)
    copy = collection_copy(root)
    return subprocess.run(
        [str(ANSIBLE_TEST), *SANITY, *extra],
        capture_output=True, text=True, env=tool_env(venv), cwd=copy, timeout=1800,
    )  # fmt: skip


def prime() -> int:
    """Build the sanity venvs (setup of the fleet tier); a missing ansible-core venv is the tests' to
    report, so it is not an error here."""
    if not ANSIBLE_TEST.exists():
        print(f"ansible-test sanity venvs: no {ANSIBLE_TEST}; nothing primed (make fleet-deps)")
        return 0
    root = REPO / ".cache" / "ansible-prime"
    shutil.rmtree(root, ignore_errors=True)
    done = sanity(root, "--prime-venvs")
    shutil.rmtree(root, ignore_errors=True)
    if done.returncode != 0:
        print((done.stdout + done.stderr)[-4000:], file=sys.stderr)
        return done.returncode
    print("ansible-test sanity venvs primed under", TOOL_HOME)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["prime"]:
        sys.exit(__doc__)
    sys.exit(prime())
