"""The README's Python examples run, so they cannot rot."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert python_blocks()


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for block in python_blocks():
        exec(compile(block.replace("/tmp/turbotrain-ckpt.pt", str(tmp_path / "ckpt.pt")), "README", "exec"), {})
