"""turbotrain.utils: the small helpers every package shares."""

from __future__ import annotations

import doctest
import math
import os
import threading

import pytest
import torch

from turbotrain import utils
from turbotrain.errors import ConfigError, HardwareError
from turbotrain.utils import atomic_write, check_output_dir, check_output_file, require, sqnr_db, sync_device


def test_docstring_examples_run():
    assert doctest.testmod(utils).failed == 0


def test_atomic_write_text_bytes_and_writer(tmp_path):
    atomic_write(tmp_path / "a.txt", "héllo")
    atomic_write(tmp_path / "b.bin", b"\x00\x01")
    atomic_write(tmp_path / "c.bin", lambda f: f.write(b"via writer"))
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "c.bin").read_bytes() == b"via writer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.bin"]  # no temp left over


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")

    def fails(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fails)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_atomic_write_takes_the_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640  # mkstemp alone would give 0600


def test_concurrent_writers_of_one_path_do_not_collide(tmp_path):
    # a fixed temp name (path + ".tmp") let two writers interleave into one file, or have one's
    # os.replace find the other's temp file gone
    path, errors = tmp_path / "peaks.json", []

    def write(i):
        try:
            for _ in range(20):
                atomic_write(path, str(i) * 1000)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    text = path.read_text()
    assert len(text) == 1000 and len(set(text)) == 1


def test_check_output_dir(tmp_path):
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"  # creatable
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_output_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match="which is a file"):
        check_output_dir(tmp_path / "file" / "sub")
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_file(tmp_path)
    assert check_output_file(tmp_path / "new" / "rows.json").name == "rows.json"


def test_sqnr_db():
    ref = torch.tensor([3.0, 4.0])
    assert sqnr_db(ref, ref.clone()) == math.inf
    assert sqnr_db(ref, ref + torch.tensor([0.3, 0.4])) == pytest.approx(20.0)  # noise 1/10 of the signal
    assert sqnr_db(torch.zeros(2), torch.ones(2)) == -math.inf


def test_the_diagnose_audit_uses_the_shared_sqnr():
    from turbotrain.diagnose import sqnr_db as diagnose_sqnr

    assert diagnose_sqnr is sqnr_db


def test_sync_device_on_cpu_is_a_no_op():
    sync_device("cpu")
    sync_device(torch.device("cpu"))


def test_require_names_the_extra():
    with pytest.raises(HardwareError, match=r"pip install 'turbotrain\[bench\]'"):
        require("no_such_module_xyz", "bench", "the charts")
