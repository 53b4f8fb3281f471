"""Offline text data: corpus files -> locally trained tokenizer -> cached token memmap -> batches.

Default corpus: the *.py sources of the running interpreter's standard library (present on
every machine, ~30 MB on CPython 3.12). Nothing is ever downloaded. The cache key is a hash of
the file names and contents plus the tokenizer settings, so a changed corpus re-tokenizes.

Layout of one cache entry, <cache_dir>/<key>/:
    tokenizer.json   HF tokenizers BPE (byte-level), absent for the bytes tokenizer
    tokens.bin       all tokens, documents separated by end-of-text, uint16 or uint32
    meta.json        dtype, token count, sha256 of tokens.bin, file list
An entry that does not match its meta.json (check_entry) is rebuilt, with a warning.
Split: the last `val_fraction` of the stream is validation (fixed, deterministic).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sysconfig
import warnings
from pathlib import Path

import numpy as np

from train.errors import TokenCacheError

EOT = "<|endoftext|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# Named corpora of the running interpreter, usable in data.paths (offline on every machine).
def _named_paths() -> dict[str, tuple[str, ...]]:
    sp = sysconfig.get_paths()
    return {"python:stdlib": (sp["stdlib"],),
            "python:site-packages": tuple(dict.fromkeys((sp["purelib"], sp["platlib"])))}


def resolve_paths(paths) -> list[Path]:
    """data.paths → folders/files: empty = the stdlib; `python:stdlib` and
    `python:site-packages` name this interpreter's sources (the latter: every installed
    package, ~100 MB of Python on the dev venv, more where PyTorch is installed)."""
    named = _named_paths()
    out: list[Path] = []
    for p in paths or ["python:stdlib"]:
        p = str(p)
        if p.startswith("python:"):
            if p not in named:
                raise ValueError(f"data path {p!r}: unknown name; known: {', '.join(named)}")
            out += map(Path, named[p])
        else:
            out.append(Path(p))
    return out


def collect_files(paths, glob: str = "*.py") -> list[Path]:
    """Files given, plus files matching `glob` under folders given; sorted, deterministic.
    Inside folders, third-party packages (site-packages) and caches are skipped."""
    files: list[Path] = []
    for p in resolve_paths(paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.rglob(glob) if f.is_file()
                            and not _SKIP_DIRS.intersection(f.relative_to(p).parts))
        else:
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if not files:
        raise ValueError(f"no files matching {glob!r} under data.paths={list(paths)}")
    return files


BPE_TRAIN_MB = 64   # the BPE vocabulary is learnt on at most this much text (every k-th file)


def _stride(files: list, sizes: list[int], cap_bytes: float) -> list:
    """Every k-th item, k = ceil(total / cap_bytes): about cap_bytes in all (sizes vary)."""
    total = sum(sizes)
    if not cap_bytes or total <= cap_bytes:
        return list(files)
    k = -(-total // int(cap_bytes))
    return list(files[::k])


def select_files(files: list[Path], max_mb: float = 0, shuffle: bool = False) -> list[Path]:
    """The corpus actually used: capped at max_mb (every k-th file), optionally reordered by
    a hash of each path (deterministic; spreads the validation tail over many files)."""
    files = _stride(files, [f.stat().st_size for f in files], max_mb * 1e6)
    if shuffle:
        files = sorted(files, key=lambda f: hashlib.sha256(str(f).encode()).hexdigest())
    return files


def _read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def _fingerprint(files: list[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in files:
        h.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def _tokenize(texts: list[str], tokenizer: str, vocab_size: int, out: Path) -> tuple[np.ndarray, int]:
    """-> (tokens, tokenizer vocab size); writes tokenizer.json for BPE."""
    if tokenizer == "bytes":
        eot = 256
        parts = [np.append(np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint32), eot)
                 for t in texts]
        return np.concatenate(parts), 257
    tok = _train_bpe(_stride(texts, [len(t) for t in texts], BPE_TRAIN_MB * 1e6), vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    parts = [np.append(np.asarray(e.ids, np.uint32), eot) for e in tok.encode_batch_fast(texts)]
    return np.concatenate(parts), tok.get_vocab_size()


@dataclasses.dataclass
class Corpus:
    train: np.ndarray  # token memmaps
    val: np.ndarray
    vocab_size: int  # tokenizer vocabulary (<= model.vocab_size)
    path: Path  # cache entry

    @property
    def tokenizer_file(self) -> Path | None:
        p = self.path / "tokenizer.json"
        return p if p.exists() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_entry(entry: Path) -> str | None:
    """Why the cache entry `entry` cannot be used as it is (meta.json unreadable, tokens.bin
    not the size or the sha256 meta.json records, the tokenizer missing), or None."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except FileNotFoundError:
        return "no meta.json"
    except (OSError, ValueError) as e:
        return f"meta.json unreadable: {e}"
    if not isinstance(meta, dict) or not {"dtype", "n_tokens", "vocab_size"} <= meta.keys():
        return "meta.json lacks dtype, n_tokens or vocab_size"
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        n_tokens = int(meta["n_tokens"])
    except (TypeError, ValueError) as e:
        return f"meta.json's dtype or n_tokens unreadable: {e}"
    tokens = entry / "tokens.bin"
    try:
        size = tokens.stat().st_size
    except OSError:
        return "no tokens.bin"
    if n_tokens <= 0 or size != n_tokens * itemsize:
        return (f"tokens.bin holds {size} bytes, but meta.json records {n_tokens} "
                f"{meta['dtype']} tokens ({n_tokens * itemsize} bytes)")
    if "sha256" in meta and _sha256(tokens) != meta["sha256"]:
        return "tokens.bin does not match the sha256 meta.json records"
    if meta.get("tokenizer", "bpe") == "bpe" and not (entry / "tokenizer.json").is_file():
        return "no tokenizer.json"
    return None


def _discard(entry: Path) -> None:
    """Remove a damaged cache entry: renamed away first (atomic; a process racing to do the
    same finds it gone), then deleted."""
    doomed = entry.with_name(f"{entry.name}.damaged{os.getpid()}")
    try:
        entry.rename(doomed)
    except FileNotFoundError:  # another process discarded it first
        return
    shutil.rmtree(doomed)


def load_corpus(data_cfg, vocab_size: int, *, verbose: bool = True) -> Corpus:
    """Build (once) and open the token cache for `data_cfg` (train.config.DataConfig).

    An entry that does not match its meta.json (truncated or altered tokens, a damaged
    meta.json: `check_entry`) is rebuilt, with a warning naming it; one that cannot be
    rebuilt raises TokenCacheError naming the path."""
    files = select_files(collect_files(data_cfg.paths, data_cfg.glob), data_cfg.max_mb,
                         data_cfg.shuffle_files)
    key = _fingerprint(files, f"{data_cfg.tokenizer}:{vocab_size}:v1")
    entry = Path(data_cfg.cache_dir) / key
    meta_file = entry / "meta.json"
    if entry.exists() and (why := check_entry(entry)) is not None:
        warnings.warn(f"token cache entry {entry} is damaged ({why}); rebuilding it",
                      stacklevel=2)
        try:
            _discard(entry)
        except OSError as e:
            raise TokenCacheError(
                f"token cache entry {entry} is damaged ({why}) and could not be removed to "
                f"rebuild it ({e}): remove it by hand, or set data.cache_dir to a writable "
                f"folder") from None
    if not meta_file.exists():
        if verbose:
            print(f"[data] tokenizing {len(files)} files ({data_cfg.tokenizer}, "
                  f"vocab {vocab_size}) into {entry} (cached for later runs)", flush=True)
        tmp = entry.with_name(f"{key}.tmp{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            tokens, vocab = _tokenize([_read(f) for f in files], data_cfg.tokenizer,
                                      vocab_size, tmp)
            dtype = np.uint16 if vocab <= 2 ** 16 else np.uint32
            tokens.astype(dtype).tofile(tmp / "tokens.bin")
            meta = dict(dtype=np.dtype(dtype).name, n_tokens=int(tokens.size),
                        vocab_size=vocab, tokenizer=data_cfg.tokenizer,
                        sha256=_sha256(tmp / "tokens.bin"), files=[str(f) for f in files])
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise TokenCacheError(f"could not write the token cache entry {entry} ({e}): "
                                  f"free space there, or set data.cache_dir to another "
                                  f"folder") from None
        try:
            tmp.rename(entry)  # atomic: concurrent builders (several processes) all agree
        except OSError:  # another process finished first; its entry is identical
            shutil.rmtree(tmp, ignore_errors=True)
        if (why := check_entry(entry)) is not None:
            raise TokenCacheError(f"token cache entry {entry} is unusable right after it "
                                  f"was built ({why}): check the disk, or set "
                                  f"data.cache_dir to another folder")
    meta = json.loads(meta_file.read_text())
    tokens = np.memmap(entry / "tokens.bin", dtype=meta["dtype"], mode="r")
    n_val = int(len(tokens) * data_cfg.val_fraction)
    return Corpus(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:],
                  meta["vocab_size"], entry)


VAL_SEED = 0   # validation windows: the same for every train.seed


def split_batches(corpus: "Corpus", batch_size: int, seq_len: int, seed: int):
    """(train, val) Batches. Training windows follow `seed`; validation windows do not
    (always VAL_SEED's), so runs with different seeds are scored on the same tokens and
    their difference is training noise, not a different sample of the validation split."""
    return (Batches(corpus.train, batch_size, seq_len, seed, stream=0),
            Batches(corpus.val, batch_size, seq_len, VAL_SEED, stream=1))


class Batches:
    """Deterministic random windows: batch i depends only on (seed, split, i).

    That makes the data position a single integer (the next batch index), which the
    checkpoint stores; resuming at position i replays exactly what an uninterrupted run sees.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 stream: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"only {len(tokens)} tokens in this split, need > seq_len+1="
                             f"{seq_len + 1}; give more data or a smaller model.seq_len")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.stream = seed, stream

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (batch_size, seq_len) int32."""
        rng = np.random.default_rng([self.seed, self.stream, i])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # (B, T+1)
        window = np.asarray(self.tokens[idx], dtype=np.int32)
        return window[:, :-1], window[:, 1:]
