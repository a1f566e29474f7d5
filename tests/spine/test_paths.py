"""The writability checks of CALIB_HOME and rl.dir, and the tracking-store check, on real files in tmp_path."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from calib.cli import check_tracking_store
from calib.errors import UserError
from calib.paths import check_home, check_writable_dir


def test_a_missing_directory_below_a_writable_one_passes(tmp_path):
    check_writable_dir(tmp_path / "a" / "b" / "c", "rl.dir=x")
    check_writable_dir(tmp_path, "rl.dir=x")
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_a_file_anywhere_on_the_path_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "sub" / "deeper"):
        with pytest.raises(UserError, match=rf"rl.dir=x is not usable: {tmp_path / 'f'} is a file, not a directory"):
            check_writable_dir(path, "rl.dir=x")


def test_a_fifo_is_no_directory(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match=rf"{tmp_path / 'fifo'} is not a directory"):
        check_writable_dir(tmp_path / "fifo" / "x", "rl.dir=x")


def test_a_dangling_symlink_counts_as_missing_and_a_linked_file_as_a_file(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    (tmp_path / "to_file").symlink_to(tmp_path / "f")
    with pytest.raises(UserError, match="is a file"):
        check_writable_dir(tmp_path / "to_file" / "x", "rl.dir=x")
    check_writable_dir(tmp_path / "dangling", "rl.dir=x")  # mkdir will say what is wrong with it, if anything


def test_a_read_only_directory_is_refused(tmp_path):
    """A folder without write permission; as root (which passes permission bits) a procfs folder."""
    if os.geteuid() == 0:
        if not Path("/proc/self").is_dir():
            pytest.skip("root passes permission bits and there is no procfs to refuse a write")
        with pytest.raises(UserError, match="is not writable: cannot create files in /proc/self"):
            check_writable_dir(Path("/proc/self/new"), "rl.dir=x")
        return
    (tmp_path / "ro").mkdir(mode=0o500)
    try:
        with pytest.raises(UserError, match=rf"is not writable: cannot create files in {tmp_path / 'ro'}"):
            check_writable_dir(tmp_path / "ro" / "new", "rl.dir=x")
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_check_home_names_calib_home(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("CALIB_HOME", str(tmp_path / "f"))
    with pytest.raises(UserError, match=rf"CALIB_HOME={tmp_path / 'f'} is not usable: .* \(point CALIB_HOME at"):
        check_home()
    monkeypatch.setenv("CALIB_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "artifacts").write_text("x")  # the store's folder is a file
    with pytest.raises(UserError, match="artifacts is a file"):
        check_home()


def test_tracking_store_check(tmp_path):
    db = tmp_path / "mlflow.db"
    check_tracking_store(f"sqlite:///{db}")  # missing: a fresh store is created
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    check_tracking_store(f"sqlite:///{db}")
    check_tracking_store("http://mlflow:5000")  # servers are not probed
    (tmp_path / "garbage.db").write_bytes(b"\x00\xff" * 4096)
    with pytest.raises(UserError, match="not a usable SQLite database"):
        check_tracking_store(f"sqlite:///{tmp_path / 'garbage.db'}")
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(UserError, match="is not a file"):
        check_tracking_store(f"sqlite:///{tmp_path / 'dir.db'}")
