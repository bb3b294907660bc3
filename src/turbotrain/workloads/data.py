"""Real text for the text workloads: the Python standard library's own source, BPE-tokenized.

Every machine with Python has this corpus, so benchmarks train on real text with no download. The
build is deterministic: files are sorted, the train/val split is a SHA-256 of each relative path
(not Python's salted ``hash()``), and the byte-level BPE is trained on a fixed subset of the train
files. The tokenizer and the token arrays are cached under ``~/.cache/turbotrain`` (or
``$TURBOTRAIN_CACHE``) in a folder keyed by the Python version, the file list and the settings,
so a different stdlib builds its own cache instead of reusing a stale one.

>>> corpus = load_corpus()
>>> x, y = next(text_batches(corpus.train, batch_size=8, seq_len=256, seed=0, split="train"))
>>> bool((x[:, 1:] == y[:, :-1]).all())
True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from ..errors import ConfigError, check_positive
from ..utils import atomic_write, require

if TYPE_CHECKING:  # numpy comes with the text extra; imported where the arrays are built
    import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    # building and loading the corpus
    "Corpus",
    "CorpusSpec",
    "load_corpus",
    "cache_root",
    "stdlib_root",
    "stdlib_source_files",
    "is_val_path",
    # deterministic sampling
    "split_generator",
    "sample_windows",
    "text_batches",
    "corpus_batches",
    "synthetic_batches",
    "seeded_build",
    # constants
    "EOT_TOKEN",
    "MASK_TOKEN",
    "CACHE_ENV",
    "SPLITS",
]

CACHE_ENV = "TURBOTRAIN_CACHE"
EOT_TOKEN = "<|endoftext|>"
"""Separates files in the token stream, so a window that crosses files sees a boundary."""
MASK_TOKEN = "<|mask|>"
"""The masked-LM input token (bert); in the shared vocabulary so one tokenizer serves all."""
SPLITS = ("train", "val")
VAL_PERCENT = 5
#: Bump when the cache layout or the build recipe changes, so old caches are not reused.
FORMAT_VERSION = 1
#: Not Python source written by CPython developers: third-party packages vary per machine.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusSpec:
    """What a corpus build depends on besides the stdlib files; every field is in the cache key."""

    vocab_size: int = 8192
    """BPE vocabulary size including the special tokens; 8192 keeps the head small (fast on CPU)
    while giving ~3.6 characters per token on Python source. Must fit in uint16."""
    max_chars: int = 48_000_000
    """Cap on the corpus (bytes of source). CPython 3.11's stdlib is ~32 MB, so the default keeps
    all of it while bounding the build (~15 s on 2 cores) on a larger one."""
    tokenizer_chars: int = 16_000_000
    """Bytes of train text the BPE is trained on; more barely changes merges but costs time."""

    def __post_init__(self):
        for name in ("vocab_size", "max_chars", "tokenizer_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} is not valid; it must be an integer > 0")
        if not 256 + len((EOT_TOKEN, MASK_TOKEN)) < self.vocab_size <= 65536:
            # Below 258 the byte alphabet plus specials does not fit; above 65536 uint16 overflows.
            raise ConfigError(f"vocab_size={self.vocab_size} is not valid; choose 259..65536")


@dataclass(frozen=True)
class Corpus:
    """Tokenized train/val streams (1-D torch.long) and the tokenizer that made them."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: object
    """A ``tokenizers.Tokenizer`` (byte-level BPE; decoding round-trips the source exactly)."""
    vocab_size: int
    info: dict = field(default_factory=dict)
    """Sizes and provenance: files per split, characters, tokens, cache key, stdlib path."""

    @property
    def eot_id(self) -> int:
        return self.tokenizer.token_to_id(EOT_TOKEN)

    @property
    def mask_id(self) -> int:
        return self.tokenizer.token_to_id(MASK_TOKEN)

    def split(self, name: str) -> torch.Tensor:
        """The token stream of ``'train'`` or ``'val'``."""
        _check_split(name)
        return self.train if name == "train" else self.val

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


# ----------------------------------------------------------------------------- file selection


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _path_hash(relpath: str) -> int:
    """A stable 64-bit hash of a relative path (the same in every process and Python version)."""
    return int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")


def is_val_path(relpath: str) -> bool:
    """Whether a file belongs to the validation split: ~VAL_PERCENT of paths, by SHA-256."""
    return _path_hash(relpath) % 100 < VAL_PERCENT


def stdlib_source_files(root: Path | None = None, max_chars: int | None = None) -> list[tuple[str, int]]:
    """(relative posix path, size in bytes) of the stdlib's ``.py`` files, sorted by path.

    Under a ``max_chars`` cap the kept files are the first ones in hash order, a deterministic
    sample spread over the whole library rather than its alphabetical head.
    """
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                full = Path(dirpath, name)
                found.append((full.relative_to(root).as_posix(), full.stat().st_size))
    if max_chars is not None:
        kept, total = [], 0
        for rel, size in sorted(found, key=lambda item: (_path_hash(item[0]), item[0])):
            if total + size > max_chars and kept:
                continue  # skip files that overflow the cap; smaller later ones may still fit
            kept.append((rel, size))
            total += size
        found = kept
    return sorted(found)


def _split_files(files: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
    paths = [rel for rel, _ in files]
    val = [p for p in paths if is_val_path(p)]
    if not val and len(paths) > 1:
        # A tiny capped corpus may hash no file into val; move the lowest-hash file so the split
        # is never empty (still deterministic and disjoint).
        val = [min(paths, key=lambda p: (_path_hash(p), p))]
    val_set = set(val)
    return [p for p in paths if p not in val_set], val


def _read_source(root: Path, relpath: str) -> str:
    # A few stdlib files are latin-1 or deliberately invalid (tests of the decoder); replacing
    # bad bytes keeps the text deterministic without per-file encoding sniffing.
    return (root / relpath).read_bytes().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """``$TURBOTRAIN_CACHE`` if set, else ``~/.cache/turbotrain``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "turbotrain"


def _cache_key(spec: CorpusSpec, files: list[tuple[str, int]]) -> str:
    import tokenizers

    h = hashlib.sha256()
    h.update(json.dumps(
        {
            "format": FORMAT_VERSION,
            "python": sys.version,
            "implementation": sys.implementation.name,
            # BPE training details can change between tokenizers releases.
            "tokenizers": tokenizers.__version__,
            "spec": asdict(spec),
        },
        sort_keys=True,
    ).encode())
    for rel, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- build


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every byte sequence is encodable and decoding restores the text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Source text that happens to contain "<|endoftext|>" must stay text, not become the token.
    tokenizer.encode_special_tokens = True
    return tokenizer


def _encode_files(tokenizer, root: Path, paths: list[str], eot_id: int) -> tuple[np.ndarray, int]:
    """One uint16 stream: each file's tokens followed by EOT. Returns (tokens, characters)."""
    import numpy as np

    pieces, chars = [], 0
    chunk = 128  # files per encode_batch call: parallel, yet bounded memory for the Encodings
    for start in range(0, len(paths), chunk):
        texts = [_read_source(root, p) for p in paths[start:start + chunk]]
        chars += sum(len(t) for t in texts)
        for enc in tokenizer.encode_batch(texts):
            pieces.append(np.asarray(enc.ids, dtype=np.uint16))
            pieces.append(np.asarray([eot_id], dtype=np.uint16))
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)), chars


def _build(spec: CorpusSpec, root: Path, files, folder: Path, key: str) -> None:
    import numpy as np

    train_paths, val_paths = _split_files(files)
    sizes = dict(files)
    subset, total = [], 0
    for p in sorted(train_paths, key=lambda p: (_path_hash(p), p)):
        if total >= spec.tokenizer_chars:
            break
        subset.append(_read_source(root, p))
        total += sizes[p]
    tokenizer = _train_tokenizer(subset, spec.vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    train, train_chars = _encode_files(tokenizer, root, train_paths, eot_id)
    val, val_chars = _encode_files(tokenizer, root, val_paths, eot_id)

    # atomic writes: readers (and concurrent builders) never see a half-written file
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "tokenizer.json", tokenizer.to_str())
    atomic_write(folder / "train.npy", lambda f: np.save(f, train))
    atomic_write(folder / "val.npy", lambda f: np.save(f, val))
    info = {
        "key": key,
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "vocab_size": tokenizer.get_vocab_size(),
        "files": {"train": len(train_paths), "val": len(val_paths)},
        "chars": {"train": train_chars, "val": val_chars},
        "tokens": {"train": int(train.size), "val": int(val.size)},
        "tokenizer_chars": total,
        "spec": asdict(spec),
    }
    # Written last: its presence marks a complete cache folder.
    atomic_write(folder / "meta.json", json.dumps(info, indent=1))


_LOADED: dict[tuple[str, str], Corpus] = {}


def load_corpus(
    vocab_size: int = 8192,
    *,
    max_chars: int = CorpusSpec.max_chars,
    tokenizer_chars: int = CorpusSpec.tokenizer_chars,
    cache_dir: str | os.PathLike | None = None,
    stdlib: str | os.PathLike | None = None,
) -> Corpus:
    """The tokenized stdlib corpus, built on first use (~15 s on 2 cores) and cached after.

    ``cache_dir`` overrides ``$TURBOTRAIN_CACHE``; ``stdlib`` overrides the source folder (tests).
    Needs the ``text`` extra (tokenizers, numpy).
    """
    for module in ("tokenizers", "numpy"):
        require(module, "text", "the text workloads (gpt, llama, bert)")
    spec = CorpusSpec(vocab_size=vocab_size, max_chars=max_chars, tokenizer_chars=tokenizer_chars)
    root = Path(stdlib) if stdlib is not None else stdlib_root()
    files = stdlib_source_files(root, spec.max_chars)
    if len(files) < 2:
        raise ConfigError(
            f"found {len(files)} .py file(s) under {root} within max_chars={spec.max_chars}; "
            "a train/val corpus needs at least 2: raise max_chars or point stdlib at a source tree"
        )
    key = _cache_key(spec, files)
    folder = (Path(cache_dir) if cache_dir is not None else cache_root()) / f"stdlib-{key}"
    memo_key = (str(folder.resolve()), key)
    if memo_key in _LOADED:
        return _LOADED[memo_key]
    if not (folder / "meta.json").exists():
        logger.info("building the tokenized stdlib corpus in %s (once; ~15 s on 2 cores)", folder)
        _build(spec, root, files, folder, key)
    corpus = _read_cache(folder)
    _LOADED[memo_key] = corpus
    return corpus


def _read_cache(folder: Path) -> Corpus:
    import numpy as np
    from tokenizers import Tokenizer

    info = json.loads((folder / "meta.json").read_text())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.encode_special_tokens = True  # not stored in the json by every tokenizers version
    arrays = {}
    for split in SPLITS:
        arr = np.load(folder / f"{split}.npy")
        if arr.dtype != np.uint16 or arr.ndim != 1 or arr.size != info["tokens"][split]:
            raise ConfigError(
                f"corrupt corpus cache {folder / (split + '.npy')}: delete {folder} to rebuild it"
            )
        arrays[split] = torch.from_numpy(arr.astype(np.int64))
    return Corpus(arrays["train"], arrays["val"], tokenizer, info["vocab_size"], info)


# ----------------------------------------------------------------------------- sampling


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not valid; choose one of: 'train', 'val'")


def split_generator(seed: int, split: str) -> torch.Generator:
    """A CPU generator seeded from (seed, split) by SHA-256, so train and val streams differ and
    the same pair gives the same stream in every process."""
    _check_split(split)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r} is not valid; it must be an integer")
    digest = hashlib.sha256(f"turbotrain:{seed}:{split}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") >> 1)  # manual_seed wants < 2**63
    return generator


def sample_windows(tokens: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``length`` consecutive tokens, shape (batch_size, length)."""
    check_positive("batch_size", batch_size)
    check_positive("length", length)
    n = tokens.numel()
    if n < length:
        raise ConfigError(
            f"the token stream has {n} tokens, fewer than a window of {length}: "
            "use a shorter sequence length or a larger corpus"
        )
    starts = torch.randint(0, n - length + 1, (batch_size,), generator=generator)
    return tokens[starts[:, None] + torch.arange(length)]


def text_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, split: str = "train", device="cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless next-token batches: windows of seq_len+1, inputs = w[:, :-1], targets = w[:, 1:].

    Bad arguments raise here, not at the first ``next()``.
    """
    generator = split_generator(seed, split)
    check_positive("seq_len", seq_len)
    return _next_token_stream(tokens, batch_size, seq_len, generator, device)


def _next_token_stream(tokens, batch_size, seq_len, generator, device):
    while True:
        window = sample_windows(tokens, batch_size, seq_len + 1, generator)
        yield window[:, :-1].to(device), window[:, 1:].to(device)


def _masked_stream(tokens, batch_size, seq_len, generator, device, masked, corpus):
    while True:
        window = sample_windows(tokens, batch_size, seq_len, generator)
        inputs, targets = masked(window, corpus, generator)
        yield inputs.to(device), targets.to(device)


def corpus_batches(vocab_size: int, batch_size: int, seq_len: int, *, masked=None):
    """A ``Workload.batches`` callable over the stdlib corpus; the corpus loads on first call.

    ``masked``, if given, is ``masked(window, corpus, generator) -> (inputs, targets)`` and turns
    windows of ``seq_len`` into masked-LM batches; otherwise batches are next-token pairs.
    """

    def batches(split: str = "train", seed: int = 0, device="cpu"):
        generator = split_generator(seed, split)
        corpus = load_corpus(vocab_size)
        tokens = corpus.split(split)
        if masked is None:
            return _next_token_stream(tokens, batch_size, seq_len, generator, device)
        return _masked_stream(tokens, batch_size, seq_len, generator, device, masked, corpus)

    return batches


def synthetic_batches(stream):
    """A ``Workload.batches`` callable from ``stream(generator, device) -> iterator`` for data
    drawn from a generator rather than read from the corpus (resnet, mlp)."""

    def batches(split: str = "train", seed: int = 0, device="cpu"):
        return stream(split_generator(seed, split), device)

    return batches


def seeded_build(build, init_seed: int):
    """Wrap a model constructor so its weights depend only on ``init_seed``, not on whatever the
    caller's global RNG state is; the caller's RNG is left untouched."""

    def build_model():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            return build()

    return build_model
