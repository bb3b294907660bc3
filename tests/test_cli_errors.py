"""Bad command-line input (issue #12): one line on stderr, exit 2, and no work started.

Each case runs ``turbotrain.cli.main`` in this process with the work it would start replaced by a
tripwire, so "before any work" is checked, not assumed; capfd also sees what a child process
would print.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from turbotrain.cli import main


class WorkStarted(Exception):
    """A command got past its checks."""


def _tripwire(*args, **kwargs):
    raise WorkStarted(args)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command measures, benchmarks or starts a process."""
    import turbotrain.bench.runner as runner
    import turbotrain.cli.comm as cli_comm

    monkeypatch.setattr(runner, "environment_report", _tripwire)
    monkeypatch.setattr(runner, "load_workload", _tripwire)
    monkeypatch.setattr(cli_comm.subprocess, "call", _tripwire)
    monkeypatch.setattr(subprocess, "Popen", _tripwire)


def _one_error_line(capfd, command: str) -> str:
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert out == "", out
    assert len(lines) == 1, err
    assert lines[0].startswith(f"turbotrain {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "results"
    path.write_text("not a folder")
    return path


def test_bench_out_is_a_file(a_file, no_work, capfd):
    assert main(["bench", "--quick", "--out", str(a_file)]) == 2
    assert "is a file, not a directory" in _one_error_line(capfd, "bench")


def test_bench_out_inside_a_file(a_file, no_work, capfd):
    assert main(["bench", "--quick", "--out", str(a_file / "sub" / "dir")]) == 2
    line = _one_error_line(capfd, "bench")
    assert f"inside {a_file}, which is a file" in line


def test_dp_bench_out_is_a_file(a_file, no_work, capfd):
    assert main(["bench", "--nproc", "2", "--quick", "--out", str(a_file)]) == 2
    assert "is a file, not a directory" in _one_error_line(capfd, "bench")


def test_bench_nproc_zero_is_refused_not_ignored(tmp_path, no_work, capfd):
    # `if args.nproc:` used to take 0 for "not given" and run the single-process ladder instead
    assert main(["bench", "--nproc", "0", "--out", str(tmp_path)]) == 2
    assert "at least 2 ranks" in _one_error_line(capfd, "bench")


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0"], "--nproc 0 must be >= 1"),
    (["--nproc", "-2"], "--nproc -2 must be >= 1"),
    (["--min-bytes", "1Q"], "--min-bytes '1Q' is not a size"),
    (["--max-bytes", "lots"], "--max-bytes 'lots' is not a size"),
    (["--min-bytes", "0"], "less than one byte"),
    (["--min-bytes", "64M", "--max-bytes", "1M"], "--max-bytes=1048576 is not valid"),
    (["--ops", "all_reduce,alltoall"], "'alltoall' is not valid"),
    (["--factor", "1"], "--factor=1 is not valid"),
])
def test_comm_bench_bad_settings(argv, message, no_work, capfd):
    assert main(["comm-bench", *argv]) == 2
    assert message in _one_error_line(capfd, "comm-bench")


def test_comm_bench_out_is_a_directory(tmp_path, no_work, capfd):
    assert main(["comm-bench", "--nproc", "2", "--out", str(tmp_path)]) == 2
    assert "is a directory" in _one_error_line(capfd, "comm-bench")


@pytest.mark.parametrize("size, nbytes", [("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("512", 512),
                                          ("4KiB", 4096), ("1.5k", 1536), ("2MB", 2 << 20)])
def test_comm_bench_sizes(size, nbytes):
    from turbotrain.bench.comm_bench import parse_size

    assert parse_size(size) == nbytes


def test_launch_missing_script(tmp_path, no_work, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nproc", "1", "missing.py"]) == 2
    assert "script 'missing.py' does not exist" in _one_error_line(capfd, "launch")


def test_launch_module_is_not_looked_up_as_a_file(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nproc", "1", "--dry-run", "-m", "some.module"]) == 0
    assert capfd.readouterr().out.rstrip().endswith("-m some.module")


def test_launch_multi_node_needs_master_addr(tmp_path, no_work, capfd):
    script = tmp_path / "job.py"
    script.write_text("")
    assert main(["launch", "--nproc", "1", "--nnodes", "2", str(script)]) == 2
    assert "--master-addr" in _one_error_line(capfd, "launch")


def test_launch_prints_a_shell_quoted_command(tmp_path, capfd):
    script = tmp_path / "my job.py"
    script.write_text("")
    args = ["two words", "it's", "$HOME", "--lr=3e-4"]
    assert main(["launch", "--nproc", "2", "--dry-run", str(script), *args]) == 0
    printed = capfd.readouterr().out.splitlines()[-1].removeprefix("turbotrain launch: ")
    cmd = shlex.split(printed)
    assert cmd[:3] == [sys.executable, "-m", "turbotrain.comm.launch"]
    assert cmd[-5:] == [str(script), *args]  # pasting it into a shell runs exactly this


def test_launch_multi_node_passes_master_addr_to_torchrun(tmp_path, capfd):
    script = tmp_path / "job.py"
    script.write_text("")
    assert main(["launch", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--dry-run", str(script)]) == 0
    cmd = shlex.split(capfd.readouterr().out.splitlines()[-1].removeprefix("turbotrain launch: "))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--master-addr=10.0.0.1" in cmd and "--node-rank=1" in cmd and "--nnodes=2" in cmd


@pytest.mark.parametrize("argv, verbosity", [(["bench"], 0), (["-q", "bench"], -1), (["bench", "-v"], 1),
                                             (["-v", "comm-bench"], 1), (["diagnose", "nan", "-q", "--workload", "x"], -1)])
def test_verbosity_flags_before_or_after_the_command(argv, verbosity):
    from turbotrain.cli import build_parser

    assert build_parser().parse_args(argv).verbosity == verbosity


def test_library_logging_reaches_stderr_once_at_the_chosen_level(capsys):
    import logging

    from turbotrain.cli import configure_logging

    package = logging.getLogger("turbotrain")
    handlers, level = list(package.handlers), package.level
    log = logging.getLogger("turbotrain.some.module")
    try:
        configure_logging(0)
        configure_logging(0)  # main() twice in one process: still one handler
        log.info("shown")
        log.debug("hidden")
        configure_logging(-1)
        log.info("quiet now")
        log.warning("still shown")
        assert capsys.readouterr().err.splitlines() == ["turbotrain: shown", "turbotrain: still shown"]
    finally:
        package.handlers[:] = handlers
        package.setLevel(level)  # setLevel, not assignment: it also clears the children's cached levels


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.parametrize("name, value, fix", [
    ("OMP_WAIT_POLICY", "ACTIVE", "env -u OMP_WAIT_POLICY turbotrain"),
    ("GOMP_SPINCOUNT", "infinite", "env -u GOMP_SPINCOUNT turbotrain"),
    ("KMP_BLOCKTIME", "200", "env KMP_BLOCKTIME=1 turbotrain"),
])
def test_a_spinning_openmp_setting_is_refused_before_any_work(command, name, value, fix, tmp_path, no_work, capfd,
                                                             monkeypatch):
    # with OMP_WAIT_POLICY=active the quick gpt ladder measured 2.48 s a step instead of 0.025 s:
    # every waiting worker's threads spun on the timed row's cores
    import turbotrain.bench.worker as worker

    monkeypatch.setattr(worker, "load_workload", _tripwire)
    monkeypatch.setenv(name, value)
    assert main([command, "--quick", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capfd, command)
    assert f"{name}={value} keeps idle OpenMP threads spinning" in line and fix in line, line
    assert not (tmp_path / "out").exists()


def test_intel_openmps_default_blocktime_is_refused_too(tmp_path, no_work, capfd, monkeypatch):
    # libiomp5 / libomp spin 200 ms after each parallel region unless KMP_BLOCKTIME says otherwise
    from turbotrain import hardware

    monkeypatch.setattr(hardware, "openmp_runtime", lambda: "intel")
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capfd, "bench")
    assert "KMP_BLOCKTIME=unset (intel OpenMP's default, 200 ms)" in line and "env KMP_BLOCKTIME=1 turbotrain" in line
    monkeypatch.setenv("KMP_BLOCKTIME", "1")
    hardware.check_idle_threads_sleep()  # the fix it names


@pytest.mark.parametrize("family, message", [("dbrx", "DbrxForCausalLM cannot be built at this shape"),
                                             ("funnel", "transformers refused the family's config at this shape")])
def test_an_hf_family_that_cannot_be_built_at_the_shape_is_one_line(family, message, tmp_path, capfd, monkeypatch):
    """A family whose default config does not scale to the ladder's shape: the family's own error, in
    one line, before any measurement or worker (it was a traceback from inside transformers)."""
    pytest.importorskip("transformers")
    import turbotrain.bench.runner as runner

    monkeypatch.setattr(runner, "environment_report", _tripwire)
    monkeypatch.setattr(subprocess, "Popen", _tripwire)
    assert main(["bench", "--quick", "--workload", f"hf:{family}", "--out", str(tmp_path / "o")]) == 2
    assert message in _one_error_line(capfd, "bench")
