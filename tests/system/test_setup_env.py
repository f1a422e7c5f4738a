"""The venv made by scripts/setup.sh sees Debian's bcc module and nothing else of dist-packages."""

import importlib.util
import os
import sys

import pytest

DIST = "/usr/lib/python3/dist-packages"
BCC_ONLY = os.path.join(sys.prefix, "bcc-only")

pytestmark = [
    pytest.mark.skipif(sys.prefix == sys.base_prefix,
                       reason="not running inside a venv (use `sudo make test`, which uses .venv from scripts/setup.sh)"),
    pytest.mark.skipif(sys.prefix != sys.base_prefix and not os.path.isdir(BCC_ONLY),
                       reason=f"this venv was not made by scripts/setup.sh (no {BCC_ONLY})"),
]


def test_bcc_comes_from_debian_through_bcc_only_link():
    import bcc

    pkg_dir = os.path.dirname(bcc.__file__)
    assert pkg_dir == os.path.join(BCC_ONLY, "bcc"), f"bcc imported from {bcc.__file__}"
    assert os.path.islink(pkg_dir)
    assert os.path.realpath(pkg_dir) == os.path.realpath(os.path.join(DIST, "bcc"))


def test_venv_does_not_see_system_site_packages():
    real_dist = os.path.realpath(DIST)
    assert not [p for p in sys.path if p and os.path.realpath(p) == real_dist], sys.path
    with pytest.raises(ImportError):
        import apt  # noqa: F401  (python3-apt lives in Debian's dist-packages)
    # Nothing else from dist-packages is reachable either (bcc only through the link above).
    for name in sorted(os.listdir(DIST)):
        mod = name.split(".", 1)[0]
        if mod == "bcc" or not mod.isidentifier():
            continue
        spec = importlib.util.find_spec(mod)
        origin = getattr(spec, "origin", None) or ""
        assert not os.path.realpath(origin).startswith(real_dist + os.sep), f"{mod} imports from {origin}"
