"""Real calibration and evaluation text, offline: text this machine already has and that this project did not write.

Sources, all found on a stock Linux machine with Python installed:

- **code**: the Python standard library's own `.py` sources (tests, GUI and 2to3 packages left out);
- **prose**: the license texts in `/usr/share/common-licenses`, the `copyright` and `README` files under
  `/usr/share/doc` (deduplicated by content), the Debian Python policy, and the docstrings of the standard library
  (module, class and function docstrings of at least 200 characters).

A *manifest* pins the text: every file's path, sha256, kind and split (calibration or held out, chosen by a hash of
the path so that it does not depend on the order files were found). `load_documents` refuses files whose content
no longer matches, so a fit records exactly which text it saw. Calibration sequences are cut from three streams
(code, prose, and prose in chat form, rendered with the tokenizer's chat template) in a fixed interleaving, so
sequence `i` is the same on every run and a collection job can stop after any chunk and resume. Long conversations
(`conversation_sequences`: many turns of calibration text in the chat template) are the other form a map can be
calibrated on, for serving at length.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging

from ..atomic import write_text_atomically

logger = logging.get_logger(__name__)

MANIFEST_VERSION = 1
HELDOUT_EVERY = 5  # one file in five (by path hash) is held out for evaluation
STREAMS = ("code", "prose", "chat")
_SKIP_STDLIB = (
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "site-packages",
    "ensurepip",
    "encodings",
)
_MIN_DOCSTRING = 200


@dataclass(frozen=True)
class Document:
    """One source file of the corpus.

    Args:
        path (`str`): absolute path.
        kind (`str`): `"code"` (a Python source, whose docstrings also feed the prose stream) or `"prose"`.
        split (`str`): `"calibration"` or `"heldout"`.
        sha256 (`str`): sha256 of the file's bytes.
    """

    path: str
    kind: str
    split: str
    sha256: str


def _split_of(path: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "big") % HELDOUT_EVERY
    return "heldout" if bucket == 0 else "calibration"


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_text(path: str | Path) -> str:
    """A file's text (`.gz` decompressed), decoded as UTF-8 with undecodable bytes replaced."""
    data = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def docstrings(source: str) -> list[str]:
    """The module, class and function docstrings of a Python source with at least 200 characters, in order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_DOCSTRING:
                found.append(doc)
    return found


def discover(stdlib: str | Path | None = None, doc_root: str | Path = "/usr/share") -> list[Document]:
    """Find the corpus files on this machine (what `build_manifest` pins).

    Args:
        stdlib (`str` or `Path`, *optional*): the standard library folder (default: this interpreter's).
        doc_root (`str` or `Path`, *optional*, defaults to `"/usr/share"`): holds `common-licenses/` and `doc/`.
    """
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    doc_root = Path(doc_root)
    candidates: list[tuple[Path, str]] = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib).parts
        if any(part in _SKIP_STDLIB or part.startswith("test_") for part in relative) or "config-" in str(path):
            continue
        if 2_000 <= path.stat().st_size <= 300_000:
            candidates.append((path, "code"))
    licenses = doc_root / "common-licenses"
    if licenses.is_dir():
        candidates += [(p, "prose") for p in sorted(licenses.iterdir()) if p.is_file() and not p.is_symlink()]
    docs = doc_root / "doc"
    if docs.is_dir():
        for path in (
            sorted(docs.glob("*/copyright")) + sorted(docs.glob("*/README*")) + sorted(docs.glob("*/*.txt.gz"))
        ):
            if path.is_file() and not path.is_symlink() and 1_000 <= path.stat().st_size <= 300_000:
                candidates.append((path, "prose"))
    seen: set[str] = set()
    documents = []
    for path, kind in candidates:
        digest = _file_sha256(path)
        if digest in seen:  # many packages ship the same copyright file
            continue
        seen.add(digest)
        documents.append(Document(str(path), kind, _split_of(str(path)), digest))
    return documents


def manifest_sha256(documents: Sequence[Document]) -> str:
    """One hash over the whole file list (paths, kinds, splits and contents)."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(f"{doc.path}\t{doc.kind}\t{doc.split}\t{doc.sha256}\n".encode())
    return digest.hexdigest()


def build_manifest(path: str | Path, documents: Sequence[Document] | None = None) -> dict:
    """Write the manifest of `documents` (default: `discover()`) to `path` as JSON; return it."""
    documents = list(documents if documents is not None else discover())
    manifest = {
        "version": MANIFEST_VERSION,
        "sha256": manifest_sha256(documents),
        "files": [[d.path, d.kind, d.split, d.sha256] for d in documents],
    }
    write_text_atomically(path, json.dumps(manifest, indent=0) + "\n")
    return manifest


def load_manifest(path: str | Path, verify: bool = True) -> list[Document]:
    """Read a manifest and (with `verify`) check every file is present with the pinned content.

    Raises:
        `ValueError`: the manifest's own hash does not match its file list, or files are missing or changed.
    """
    manifest = json.loads(Path(path).read_text())
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: manifest version {manifest.get('version')} is not {MANIFEST_VERSION}.")
    documents = [Document(*row) for row in manifest["files"]]
    if manifest_sha256(documents) != manifest["sha256"]:
        raise ValueError(f"{path}: the file list does not match the manifest's sha256; it was edited by hand.")
    if verify:
        missing = [d.path for d in documents if not Path(d.path).is_file()]
        changed = [d.path for d in documents if d.path not in missing and _file_sha256(Path(d.path)) != d.sha256]
        if missing or changed:
            raise ValueError(
                f"{path}: {len(missing)} pinned files are missing and {len(changed)} changed on this machine "
                f"(e.g. {(missing + changed)[0]}). This corpus is pinned to the files of the machine that built it; "
                "build a manifest for this machine (`python -m benchmarks.real family manifest --out NEW.json`) "
                "and calibrate with it (its hash is recorded with the statistics)."
            )
    return documents


# --------------------------------------------------------------------------------------------------- streams


def _shuffled(documents: Sequence[Document], kind: str, split: str, seed: int) -> list[Document]:
    chosen = [d for d in documents if d.kind == kind and d.split == split]
    random.Random(f"{seed}-{kind}-{split}").shuffle(chosen)
    return chosen


def prose_texts(documents: Sequence[Document], split: str, seed: int = 0) -> Iterator[str]:
    """Prose in a fixed order: files of kind prose, and the docstrings of the code files, interleaved."""
    files = _shuffled(documents, "prose", split, seed)
    code = _shuffled(documents, "code", split, seed)
    for index in range(max(len(files), len(code))):
        if index < len(files):
            yield read_text(files[index].path)
        if index < len(code):
            docs = docstrings(read_text(code[index].path))
            if docs:
                yield "\n\n".join(docs)


def code_texts(documents: Sequence[Document], split: str, seed: int = 0) -> Iterator[str]:
    """Python sources in a fixed order."""
    for doc in _shuffled(documents, "code", split, seed):
        yield read_text(doc.path)


def chat_texts(tokenizer, documents: Sequence[Document], split: str, seed: int = 0) -> Iterator[str]:
    """Prose in chat form: the first half of a passage as the user's turn, the second as the assistant's."""
    for text in prose_texts(documents, split, seed + 1):
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        if len(paragraphs) < 2:
            continue
        half = len(paragraphs) // 2
        messages = [
            {"role": "user", "content": "Continue this text:\n\n" + "\n\n".join(paragraphs[:half])},
            {"role": "assistant", "content": "\n\n".join(paragraphs[half:])},
        ]
        yield tokenizer.apply_chat_template(messages, tokenize=False)


def _token_stream(tokenizer, texts: Iterator[str], cap: int) -> Iterator[int]:
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:cap]
        yield from ids
        if tokenizer.eos_token_id is not None:
            yield tokenizer.eos_token_id


def calibration_sequences(
    tokenizer, documents: Sequence[Document], count: int, length: int = 1024, seed: int = 0
) -> list[list[int]]:
    """`count` sequences of `length` token ids from the calibration split, streams interleaved code, prose, chat.

    Sequence `i` depends only on the manifest, the tokenizer, `length` and `seed` (not on `count`), so a longer
    run extends a shorter one. At most `2 * length` tokens are taken from any one file.

    Raises:
        `ValueError`: a stream runs out of text before `count` sequences are cut.
    """
    streams = {
        "code": _token_stream(tokenizer, code_texts(documents, "calibration", seed), 2 * length),
        "prose": _token_stream(tokenizer, prose_texts(documents, "calibration", seed), 2 * length),
        "chat": _token_stream(tokenizer, chat_texts(tokenizer, documents, "calibration", seed), 2 * length),
    }
    sequences = []
    for index in range(count):
        name = STREAMS[index % len(STREAMS)]
        window = [token for _, token in zip(range(length), streams[name])]
        if len(window) < length:
            raise ValueError(
                f"The {name} stream of the calibration split ran out after {len(sequences)} sequences of {length} "
                "tokens; use fewer or shorter sequences, or a manifest with more files."
            )
        sequences.append(window)
    return sequences


def _passages(tokenizer, texts: Iterator[str], tokens: int) -> Iterator[str]:
    """Consecutive passages of `tokens` token ids from `texts`, decoded (a file's tail shorter than one is dropped)."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - tokens + 1, tokens):
            yield tokenizer.decode(ids[start : start + tokens])


def conversation_sequences(
    tokenizer, documents: Sequence[Document], count: int, length: int = 4096, seed: int = 0, turn_tokens: int = 192
) -> list[list[int]]:
    """`count` long conversations of exactly `length` token ids from the calibration split: turns of about
    `turn_tokens` tokens (a code or a prose passage, in turn) said by the user and the assistant in turn, rendered
    with the tokenizer's chat template (its default system turn included) and cut at `length`.

    What a served conversation looks like at length (many turns, the template's markers every few hundred tokens),
    from text of the calibration split only: the held-out split that the evaluation tasks draw on never enters.
    Sequence `i` depends only on the manifest, the tokenizer, `length`, `turn_tokens` and `seed` (not on `count`).

    Raises:
        `ValueError`: the calibration split runs out before `count` conversations are built.
    """
    streams = [
        _passages(tokenizer, code_texts(documents, "calibration", seed), turn_tokens),
        _passages(tokenizer, prose_texts(documents, "calibration", seed), turn_tokens),
    ]
    sequences = []
    turn = 0
    for _ in range(count):
        messages: list[dict] = []
        ids: list[int] = []
        while len(ids) < length:
            try:
                passage = next(streams[turn % 2])
            except StopIteration:
                raise ValueError(
                    f"The calibration split ran out after {len(sequences)} conversations of {length} tokens; use "
                    "fewer or shorter ones, or a manifest with more files."
                ) from None
            role = "user" if len(messages) % 2 == 0 else "assistant"
            messages.append({"role": role, "content": passage})
            turn += 1
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sequences.append(list(ids[:length]))
    return sequences


def sequences_sha256(sequences: Sequence[Sequence[int]]) -> str:
    """A hash of token-id sequences (to check a resumed collection sees the same data)."""
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(json.dumps(list(seq)).encode())
    return digest.hexdigest()
