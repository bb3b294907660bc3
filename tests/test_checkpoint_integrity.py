"""Checkpoints you can trust: verified loads, atomic writes, clear errors (issue #12).

Bit flips are made in the saved file itself. torch's checkpoint is an uncompressed zip archive, so
each tensor's raw bytes appear verbatim in it; the tensors below hold distinct patterns, so each
one's offset is found by searching for its bytes.
"""

import errno
import os
import struct
import subprocess
import zipfile

import pytest
import torch

from turbotrain import CheckpointError, Config
from turbotrain.checkpoint import (
    FORMAT_VERSION, CheckpointWarning, atomic_save, load_checkpoint, rng_state, set_rng_state, validate_structure,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def engine_like_state() -> dict:
    """The parts an Engine checkpoint has, with tensors whose byte patterns occur once in the file."""
    torch.manual_seed(1234)
    return {
        "format": "turbotrain",
        "version": FORMAT_VERSION,
        "model": {
            "encoder.weight": torch.arange(256, dtype=torch.float32).reshape(16, 16) + 1000.0,
            "encoder.bias": torch.arange(16, dtype=torch.float32) - 5000.0,
            "head.weight": torch.linspace(-3.0, 3.0, 64, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(256.0).reshape(16, 16) * 1e-3 + 0.125}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "scheduler": None,
        "precision": {"mode": "fp16-mixed"},
        "comm": None,
        "engine": {"steps": 4, "micro": 0, "skipped": 0},
        "config": Config(precision="fp16-mixed", accumulate=4).to_dict(),
        "rng": torch.get_rng_state(),
    }


def tensor_at(state, part, name):
    value = state[part]
    for key in name.split(".") if part == "optimizer" else [name]:
        value = value[int(key) if key.isdigit() else key]
    return value


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def only_offset(data: bytes, needle: bytes) -> int:
    assert data.count(needle) == 1, "the pattern must occur once in the file"
    return data.find(needle)


def flip_bit(path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def saved(tmp_path, state=None):
    state = engine_like_state() if state is None else state
    path = atomic_save(state, tmp_path / "ck.pt")
    return path, state


def temps(directory):
    return sorted(p.name for p in directory.glob(".*.tmp"))


# -- verified loads --------------------------------------------------------------------------------
def test_round_trip_returns_exactly_what_was_saved(tmp_path):
    path, state = saved(tmp_path)
    assert "integrity" not in state  # the caller's dict is left alone
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    raw = torch.load(path, weights_only=True)
    assert raw["integrity"]["algorithm"] == "sha256" and set(raw["integrity"]["parts"]) == set(state)
    assert set(raw["integrity"]["tensors"]["model"]) == set(state["model"])


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize(
    "part, tensor, named",
    [
        ("model", "encoder.weight", "encoder.weight"),
        ("model", "encoder.bias", "encoder.bias"),
        ("model", "head.weight", "head.weight"),
        ("optimizer", "state.0.exp_avg", "state.0.exp_avg"),
        ("rng", None, None),
    ],
)
def test_one_bit_flip_in_tensor_bytes_names_the_part_and_tensor(tmp_path, part, tensor, named, position):
    path, state = saved(tmp_path)
    t = state[part] if tensor is None else tensor_at(state, part, tensor)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    start = only_offset(path.read_bytes(), raw)
    offset = {"first": 0, "middle": len(raw) // 2, "last": len(raw) - 1}[position]
    flip_bit(path, start + offset, bit=5)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    expected = f"part {part!r} changed" + (f" (tensor {named!r})" if named else "")
    assert expected in message and "SHA-256" in message
    assert "\n" not in message


def test_one_bit_flip_in_the_config_names_the_config(tmp_path):
    path, _ = saved(tmp_path)
    # device 'auto' -> 'autn': the pickle stays readable, only the config's value differs
    flip_bit(path, only_offset(path.read_bytes(), b"auto") + 3, bit=0)
    with pytest.raises(CheckpointError, match=r"damaged: part 'config' changed since"):
        load_checkpoint(path)


def test_one_bit_flip_in_the_integrity_record_is_reported_as_such(tmp_path):
    path, _ = saved(tmp_path)
    digest = torch.load(path, weights_only=True)["integrity"]["parts"]["engine"]
    flip_bit(path, only_offset(path.read_bytes(), digest.encode()) + 10, bit=0)
    with pytest.raises(CheckpointError, match="integrity record does not match its own digest"):
        load_checkpoint(path)


def local_data_offset(data: bytes, entry: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start: after its 30-byte local header, file name and extra field."""
    name_len, extra_len = struct.unpack_from("<HH", data, entry.header_offset + 26)
    return entry.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize(
    "where, fragment",
    [
        ("pickle opcode", r"zip entry '[^']*data\.pkl' fails its CRC check"),
        ("end of central directory", "not an intact zip archive"),
    ],
)
def test_flip_that_breaks_torch_load_is_a_checkpoint_error_naming_the_damage(tmp_path, where, fragment):
    path, _ = saved(tmp_path)
    data = path.read_bytes()
    if where == "pickle opcode":
        with zipfile.ZipFile(path) as z:
            entry = next(e for e in z.infolist() if e.filename.endswith("data.pkl"))
        offset = local_data_offset(data, entry)  # the PROTO opcode 0x80 becomes an invalid one
    else:
        offset = data.rfind(b"PK\x05\x06")
    flip_bit(path, offset, bit=0)
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint") as info:
        load_checkpoint(path)
    assert info.match(fragment)


def test_a_bit_flip_anywhere_is_either_reported_or_harmless(tmp_path):
    # Every 61st byte, cycling through the bits: a load either raises CheckpointError or returns
    # exactly what was saved (flips in zip padding or unread header fields change no content).
    path, state = saved(tmp_path)
    original = path.read_bytes()
    reported = 0
    for i, offset in enumerate(range(0, len(original), 61)):
        path.write_bytes(original)
        flip_bit(path, offset, bit=i % 8)
        try:
            loaded = load_checkpoint(path)
        except CheckpointError:
            reported += 1
            continue
        assert_same(state, loaded)
    assert reported > len(original) // 61 // 2  # most bytes carry content


def test_format_1_checkpoint_without_hashes_loads_with_a_warning(tmp_path):
    state = engine_like_state()
    state["version"] = 1
    torch.save(state, tmp_path / "old.pt")
    with pytest.warns(CheckpointWarning, match="without content hashes"):
        loaded = load_checkpoint(tmp_path / "old.pt")
    assert_same(state, loaded)


def test_current_format_without_hashes_is_refused(tmp_path):
    torch.save(engine_like_state(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="no integrity record"):
        load_checkpoint(tmp_path / "bare.pt")


# -- structure ------------------------------------------------------------------------------------------
def test_missing_parts_are_named(tmp_path):
    path = atomic_save({"format": "turbotrain", "version": FORMAT_VERSION, "model": {}}, tmp_path / "ck.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert "'optimizer', 'engine', 'config'" in str(info.value) and "'model'" not in str(info.value)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"format": "other"}, "not a turbotrain Engine checkpoint"),
        ({"version": None}, "format version None"),
        ({"version": "2"}, "format version '2'"),
        ({"version": FORMAT_VERSION + 1}, "newer turbotrain"),
        ({"model": [torch.zeros(1)]}, "'model' is a list"),
        ({"engine": 4}, "'engine' is a int"),
    ],
)
def test_validate_structure_names_what_is_wrong(change, fragment):
    state = {**engine_like_state(), **change}
    with pytest.raises(CheckpointError, match=fragment):
        validate_structure(state)


def test_validate_structure_takes_the_required_parts():
    state = {"format": "turbotrain", "version": FORMAT_VERSION, "model": {}}
    validate_structure(state, required=("model",))
    with pytest.raises(CheckpointError, match="lacks 'scheduler'"):
        validate_structure(state, required=("model", "scheduler"))
    with pytest.raises(CheckpointError, match="lacks 'version'"):
        validate_structure({"format": "turbotrain", "model": {}}, required=("model",))


# -- atomic writes -------------------------------------------------------------------------------------
def test_temporary_files_of_an_interrupted_save_are_removed_by_the_next_save(tmp_path):
    stale = tmp_path / ".ck.pt.deadbeef.tmp"
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / ".other.pt.deadbeef.tmp"  # another target's temporary file is not ours to remove
    other.write_bytes(b"x")
    saved(tmp_path)
    assert temps(tmp_path) == [other.name]


@pytest.mark.skipif(fcntl is None, reason="file locks are POSIX only")
def test_a_temporary_file_another_save_is_still_writing_is_kept(tmp_path):
    live = tmp_path / ".ck.pt.0123abcd.tmp"
    with open(live, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # what a save in progress holds
        saved(tmp_path)
        assert live.exists()
    saved(tmp_path)  # the lock is gone: now it is abandoned
    assert not live.exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_checkpoint_files_get_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path, _ = saved(tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


def fake_torch_save_that_fills_the_disk(obj, f):
    f.write(b"x" * 4096)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fake_torch_save_like_torch_reports_it(obj, f):
    # torch's zip writer turns the OSError of the file's write() into RuntimeError("unexpected pos")
    try:
        fake_torch_save_that_fills_the_disk(obj, f)
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def failing(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize(
    "target, replacement, strerror",
    [
        ((torch, "save"), fake_torch_save_that_fills_the_disk, "No space left on device"),
        ((torch, "save"), fake_torch_save_like_torch_reports_it, "No space left on device"),
        ((os, "fsync"), failing(errno.ENOSPC), "No space left on device"),
        ((os, "replace"), failing(errno.EDQUOT), os.strerror(errno.EDQUOT)),
    ],
    ids=["write", "torch-write", "fsync", "rename"],
)
def test_a_full_disk_keeps_the_previous_checkpoint_and_leaves_no_temp(tmp_path, monkeypatch, target, replacement,
                                                                       strerror):
    path, previous = saved(tmp_path)
    bigger = engine_like_state()
    bigger["model"]["extra"] = torch.zeros(1 << 16)
    monkeypatch.setattr(*target, replacement)
    with pytest.raises(CheckpointError) as info:
        atomic_save(bigger, path)
    monkeypatch.undo()
    assert strerror in str(info.value) and "is unchanged" in str(info.value)
    assert_same(previous, load_checkpoint(path))
    assert temps(tmp_path) == []


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 1 MiB tmpfs, where mounting one is permitted (root in a privileged container)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True, timeout=30)


def test_a_really_full_file_system_keeps_the_previous_checkpoint(tiny_filesystem):
    path, previous = saved(tiny_filesystem)
    bigger = engine_like_state()
    bigger["model"]["extra"] = torch.zeros(1 << 19)  # 2 MiB on a 1 MiB file system
    with pytest.raises(CheckpointError, match=r"No space left on device \(ENOSPC\)"):
        atomic_save(bigger, path)
    assert_same(previous, load_checkpoint(path))
    assert temps(tiny_filesystem) == []


# -- random number generators ---------------------------------------------------------------------------
def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    cuda_was_initialised = torch.cuda.is_initialized()
    torch.manual_seed(7)
    state = {**engine_like_state(), "rng": rng_state()}
    assert torch.cuda.is_initialized() == cuda_was_initialised  # reading the state does not start CUDA
    expected = torch.rand(8)
    path, _ = saved(tmp_path, state)
    torch.manual_seed(99)
    set_rng_state(load_checkpoint(path)["rng"])
    assert torch.equal(torch.rand(8), expected)
    if not cuda_was_initialised:
        assert state["rng"]["cuda"] is None


def test_set_rng_state_accepts_the_format_1_bare_tensor_and_refuses_junk():
    cpu = torch.get_rng_state()
    expected = torch.rand(4)
    set_rng_state(cpu)
    assert torch.equal(torch.rand(4), expected)
    set_rng_state(None)
    for junk in ({"cpu": cpu, "gpu": None}, {"cpu": torch.zeros(3)}, "seed", {"cpu": cpu, "cuda": cpu}):
        with pytest.raises(CheckpointError, match="RNG state"):
            set_rng_state(junk)
