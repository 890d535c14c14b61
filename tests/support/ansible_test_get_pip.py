"""ansible-test's pip bootstrap without its download, for a machine that reaches only package indexes.

ansible-test creates each sanity test's virtual environment without pip, then runs get-pip.py, which
it downloads from ci-files.testing.ansible.com unless ~/.ansible/test/cache/get_pip_<VERSION>.py is
there (ansible_test/_util/target/setup/requirements.py, bootstrap(): "The bootstrap script can be
manually downloaded and saved to"). This file is saved there instead. It does what get-pip.py does,
with the pip wheel Python itself ships (ensurepip) instead of the one inside get-pip.py: put that pip
on sys.path and run `pip install --upgrade --force-reinstall` with ansible-test's arguments (the pinned
pip==VERSION, fetched from the package index pip is configured with).
"""

import ensurepip
import glob
import os
import runpy
import sys

# get-pip.py's own options, which pip does not take: ansible-test passes them to install pip alone
GET_PIP_OPTIONS = ("--no-setuptools", "--no-wheel")

# ensurepip's own wheels, or where a distribution keeps them (WHEEL_PKG_DIR: Debian's python3-venv)
places = [os.path.join(os.path.dirname(ensurepip.__file__), "_bundled")]
places += [place for place in [getattr(ensurepip, "_WHEEL_PKG_DIR", None)] if place]
wheels = sorted(wheel for place in places for wheel in glob.glob(os.path.join(place, "pip-*.whl")))
if not wheels:
    sys.exit(f"no pip wheel in {' or '.join(places)}: this Python has no ensurepip wheels")
arguments = [arg for arg in sys.argv[1:] if arg not in GET_PIP_OPTIONS]
sys.path.insert(0, wheels[-1])
sys.argv = ["pip", "install", "--upgrade", "--force-reinstall", *arguments]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
