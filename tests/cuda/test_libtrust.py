"""agent/cuda/libtrust.py against real files: which libcuda files the agent follows (issue 11). Root
creates them and hands some to uid 4242, as a hostile user's files would be."""

from __future__ import annotations

import os
import re

import pytest

from mcp_hostagent.cuda import libtrust

USER = 4242


def _ident(path: str) -> tuple[tuple[int, int], int]:
    st = os.stat(path)
    return (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino


@pytest.fixture
def tree(tmp_path):
    """tmp_path/lib/libcuda.so.1, root's, 0755 directories and a 0644 file."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the files must be root's, and chown()ed to another user")
    d = tmp_path / "lib"
    d.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    lib = d / "libcuda.so.1"
    lib.write_bytes(b"\x7fELF")
    os.chmod(lib, 0o644)
    return lib


def check(path) -> None:
    dev, ino = _ident(str(path))
    libtrust.check_path("/", str(path), dev, ino)


def test_a_root_owned_file_in_root_owned_directories_is_trusted(tree):
    check(tree)


@pytest.mark.parametrize("what, change, why", [
    ("file owned by a user", lambda lib: os.chown(lib, USER, USER), f"owned by uid {USER}, not root"),
    ("directory owned by a user", lambda lib: os.chown(lib.parent, USER, USER), f"directory owned by uid {USER}"),
    ("file others can write", lambda lib: os.chmod(lib, 0o646), "writable by group or others (mode 0646)"),
    ("file a non-root group can write", lambda lib: (os.chown(lib, 0, USER), os.chmod(lib, 0o664)),
     "writable by group or others"),
    ("directory others can write", lambda lib: os.chmod(lib.parent, 0o777), "directory writable by others"),
])
def test_refused(tree, what, change, why):
    change(tree)
    with pytest.raises(libtrust.Untrusted, match=re.escape(why)):
        check(tree)


def test_through_a_process_root(tree):
    """A container's libcuda is reached through /proc/PID/root, a magic link to its root directory."""
    dev, ino = _ident(str(tree))
    libtrust.check_path(f"/proc/{os.getpid()}/root", str(tree), dev, ino)
    os.chown(tree, USER, USER)
    with pytest.raises(libtrust.Untrusted, match=f"owned by uid {USER}"):
        libtrust.check_path(f"/proc/{os.getpid()}/root", str(tree), dev, ino)


def test_a_sticky_world_writable_directory_is_allowed(tree):
    os.chmod(tree.parent, 0o1777)  # /tmp: no other user can rename or unlink root's entry
    check(tree)


def test_a_root_group_writable_file_is_allowed(tree):
    os.chmod(tree, 0o664)  # group 0: only root is in it
    check(tree)


def test_a_symlink_on_the_way_is_refused(tree, tmp_path):
    link = tmp_path / "link"
    os.symlink(tree.parent, link)
    dev, ino = _ident(str(tree))
    with pytest.raises(libtrust.Untrusted, match="a symbolic link"):
        libtrust.check_path("/", str(link / tree.name), dev, ino)


def test_a_replaced_file_is_refused(tree):
    dev, ino = _ident(str(tree))
    os.rename(tree, tree.with_name("old"))
    tree.write_bytes(b"\x7fELF")
    with pytest.raises(libtrust.Untrusted, match="replaced since"):
        libtrust.check_path("/", str(tree), dev, ino)


@pytest.mark.parametrize("path", ["relative/libcuda.so", "/a/../libcuda.so", "/a/./libcuda.so", "/"])
def test_paths_that_are_not_canonical_are_refused(path):
    with pytest.raises(libtrust.Untrusted):
        libtrust.check_path("/", path, (0, 0), 1)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(libtrust.Untrusted, match="No such file"):
        libtrust.check_path("/", str(tmp_path / "nope" / "libcuda.so"), (0, 0), 1)


def test_map_files_path_checks_the_file_alone(tree):
    dev, ino = _ident(str(tree))
    libtrust.check_open_file(str(tree), "shown (deleted)", dev, ino)
    os.chown(tree, USER, USER)
    with pytest.raises(libtrust.Untrusted, match=f"shown \\(deleted\\): owned by uid {USER}"):
        libtrust.check_open_file(str(tree), "shown (deleted)", dev, ino)
