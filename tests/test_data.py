"""The real-text pipeline: stdlib file split, BPE build and cache, deterministic batches."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from turbotrain.errors import ConfigError
from turbotrain.workloads import data
from turbotrain.workloads.data import (
    EOT_TOKEN,
    MASK_TOKEN,
    is_val_path,
    load_corpus,
    sample_windows,
    split_generator,
    stdlib_root,
    stdlib_source_files,
    text_batches,
)

# A tiny build: vocab 512 on ~1.5 MB of source builds in about a second, so the build path
# (train BPE, encode, write the cache atomically) runs in every test session.
TINY = dict(vocab_size=512, max_chars=1_500_000, tokenizer_chars=500_000)


@pytest.fixture(scope="session")
def corpus():
    """The default corpus from the real cache ($TURBOTRAIN_CACHE or ~/.cache/turbotrain): built
    once (~15 s) on a machine's first run, loaded in well under a second after that."""
    return load_corpus()


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-cache")
    return folder, load_corpus(**TINY, cache_dir=folder)


# ----------------------------------------------------------------------------- files and split


def test_source_files_are_sorted_stdlib_python_without_site_packages():
    files = stdlib_source_files()
    paths = [p for p, _ in files]
    assert paths == sorted(paths)
    assert all(p.endswith(".py") for p in paths)
    assert not any("site-packages" in p.split("/") for p in paths)
    assert "os.py" in paths  # a file every CPython stdlib has


def test_split_is_disjoint_covers_everything_and_is_about_five_percent():
    files = stdlib_source_files()
    train, val = data._split_files(files)
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(p for p, _ in files)
    assert 0.02 < len(val) / len(files) < 0.10
    assert data._split_files(files) == (train, val)


def test_tiny_split_always_has_a_val_file():
    files = stdlib_source_files(max_chars=30_000)
    train, val = data._split_files(files)
    assert len(val) >= 1 and set(train).isdisjoint(val) and len(train) + len(val) == len(files)


def test_cap_keeps_total_size_under_max_chars_and_is_deterministic():
    capped = stdlib_source_files(max_chars=400_000)
    assert sum(size for _, size in capped) <= 400_000
    assert capped == stdlib_source_files(max_chars=400_000)
    assert len(capped) < len(stdlib_source_files())


def test_val_membership_and_batches_do_not_depend_on_the_process():
    """The split and the batches use SHA-256 seeds, so a fresh process with another
    PYTHONHASHSEED must agree with this one."""
    script = (
        "import json, hashlib; from turbotrain.workloads.data import *\n"
        "c = load_corpus(); x, y = next(text_batches(c.train, 4, 16, seed=3))\n"
        "val = [p for p, _ in stdlib_source_files() if is_val_path(p)]\n"
        "print(json.dumps({'val': val, 'x': x.tolist()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "12345"},
    )
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    c = load_corpus()
    assert theirs["val"] == [p for p, _ in stdlib_source_files() if is_val_path(p)]
    assert theirs["x"] == next(text_batches(c.train, 4, 16, seed=3))[0].tolist()


# ----------------------------------------------------------------------------- tokenizer and cache


def test_tiny_build_writes_a_complete_cache_atomically(tiny_build):
    folder, tiny = tiny_build
    (sub,) = [p for p in folder.iterdir() if p.is_dir()]
    names = sorted(p.name for p in sub.iterdir())
    assert names == ["meta.json", "tokenizer.json", "train.npy", "val.npy"]  # no temp files left
    assert np.load(sub / "train.npy").dtype == np.uint16
    meta = json.loads((sub / "meta.json").read_text())
    assert meta["tokens"] == {"train": tiny.train.numel(), "val": tiny.val.numel()}
    assert tiny.vocab_size == tiny.tokenizer.get_vocab_size() == TINY["vocab_size"]


def test_tiny_build_is_deterministic_and_reloads_from_cache(tiny_build, tmp_path):
    folder, tiny = tiny_build
    rebuilt = load_corpus(**TINY, cache_dir=tmp_path)  # a second, independent build
    assert torch.equal(rebuilt.train, tiny.train) and torch.equal(rebuilt.val, tiny.val)
    assert rebuilt.tokenizer.to_str() == tiny.tokenizer.to_str()
    data._LOADED.clear()  # force a read of the files, not the in-process memo
    reloaded = load_corpus(**TINY, cache_dir=folder)
    assert reloaded is not tiny and torch.equal(reloaded.train, tiny.train)


def test_changed_settings_get_a_new_cache_key():
    files = stdlib_source_files(max_chars=TINY["max_chars"])
    key = data._cache_key(data.CorpusSpec(**TINY), files)
    assert key != data._cache_key(data.CorpusSpec(**{**TINY, "vocab_size": 1024}), files)
    assert key != data._cache_key(data.CorpusSpec(**TINY), files[:-1])  # a changed stdlib


def test_tokenizer_round_trips_stdlib_source_exactly(corpus):
    root = stdlib_root()
    paths = [p for p, size in stdlib_source_files() if size > 0]  # empty __init__.py files exist
    non_ascii = next(p for p in paths if not (root / p).read_bytes().isascii())
    for rel in [*paths[:: max(1, len(paths) // 15)], non_ascii]:
        text = data._read_source(root, rel)
        ids = corpus.encode(text)
        assert corpus.decode(ids) == text, rel
        assert len(ids) < len(text)  # BPE actually merges


def test_special_token_text_stays_text(corpus):
    ids = corpus.encode(f"x = '{EOT_TOKEN}{MASK_TOKEN}'")
    assert corpus.eot_id not in ids and corpus.mask_id not in ids
    assert corpus.decode(ids) == f"x = '{EOT_TOKEN}{MASK_TOKEN}'"


def test_corpus_streams_are_files_separated_by_eot(corpus):
    for split in ("train", "val"):
        tokens = corpus.split(split)
        assert tokens.dtype == torch.long and tokens.ndim == 1
        assert int(tokens.min()) >= 0 and int(tokens.max()) < corpus.vocab_size
        assert int((tokens == corpus.eot_id).sum()) == corpus.info["files"][split]
        assert tokens[-1] == corpus.eot_id
    assert corpus.train.numel() > 10 * corpus.val.numel()


def test_bad_corpus_settings_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        load_corpus(vocab_size=100, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="max_chars"):
        load_corpus(max_chars=0, cache_dir=tmp_path)


# ----------------------------------------------------------------------------- batches


def test_targets_are_inputs_shifted_by_one(corpus):
    x, y = next(text_batches(corpus.train, batch_size=4, seq_len=32, seed=0))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # ...and each row really is a contiguous window of the corpus.
    row = torch.cat([x[0], y[0, -1:]])
    starts = (corpus.train[: corpus.train.numel() - 32] == row[0]).nonzero().flatten()
    assert any(torch.equal(corpus.train[s : s + 33], row) for s in starts.tolist())


def test_same_seed_same_batches_different_seed_or_split_differs(corpus):
    def first(seed, split, n=3):
        stream = text_batches(corpus.split(split), 4, 32, seed=seed, split=split)
        return [next(stream) for _ in range(n)]

    a, b = first(0, "train"), first(0, "train")
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], first(1, "train")[0][0])
    assert not torch.equal(a[0][0], a[1][0])  # the stream moves on
    assert not torch.equal(first(0, "val")[0][0], first(0, "train", n=1)[0][0])


def test_split_generator_differs_by_split_and_rejects_bad_input():
    draw = lambda seed, split: torch.randint(0, 2**30, (4,), generator=split_generator(seed, split))
    assert torch.equal(draw(0, "train"), draw(0, "train"))
    assert not torch.equal(draw(0, "train"), draw(0, "val"))
    with pytest.raises(ConfigError, match="'train', 'val'"):
        split_generator(0, "test")
    with pytest.raises(ConfigError, match="seed"):
        split_generator(1.5, "train")


def test_window_longer_than_stream_raises():
    with pytest.raises(ConfigError, match="fewer than a window"):
        sample_windows(torch.arange(10), 2, 11, split_generator(0, "train"))
