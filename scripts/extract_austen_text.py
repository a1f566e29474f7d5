"""Extract one of Jane Austen's novels as plain text from Debian's ``r-cran-janeaustenr`` package.

This is how ``artifacts/texts/persuasion.txt`` (the real-text NLL measure of ``calib.perplexity``) and
the book corpus ``artifacts/texts/austen/<novel>.txt.gz`` (``calib.data.corpus``) were made, so anyone
can rebuild them offline from a package registry::

    apt-get download r-cran-janeaustenr          # Debian 12/13: 1.0.0-1, MIT; the novels are public domain
    python scripts/extract_austen_text.py r-cran-janeaustenr_*.deb persuasion artifacts/texts/persuasion.txt
    python scripts/extract_austen_text.py r-cran-janeaustenr_*.deb all artifacts/texts/austen

``all`` writes each novel gzipped (level 9, no name, mtime 0: the same bytes on every run) and prints
the sha256 of each decompressed text, the values ``calib.data.corpus.BOOKS`` checks on load.

The package holds the six novels as R character vectors (one element per line of the Project Gutenberg
text, header and licence already removed) in R's lazy-load database ``data/Rdata.rdb``; its index
``Rdata.rdx`` is a gzipped serialized list mapping each object name to ``(offset, length)``. Each record
is a 4-byte big-endian length followed by a zlib stream of R's XDR serialization. This script reads just
the serialization types those objects use (character vectors, lists, pairlists, symbols, integers).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
NILVALUE, REFSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = (
    254, 255, 1, 2, 9, 10, 13, 14, 16, 19)


class RUnserializer:
    """R's XDR serialization (``saveRDS``/lazy-load format 2 or 3), the subset named in the module docstring."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.pos += 8  # writer's R version, minimal reader version
        if version == 3:
            self.pos += 4 + self.int()  # native encoding name

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NILVALUE:
            return None
        if kind == REFSXP:
            return self.refs[(flags >> 8) - 1]
        if kind == SYMSXP:
            symbol = ("symbol", self.item())
            self.refs.append(symbol)
            return symbol
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8")
            self.pos += n
            return text
        if kind == LISTSXP:
            if has_attr:
                self.item()  # a pairlist's own attributes: not needed here
            tag = self.item() if has_tag else None
            head, rest = self.item(), self.item()
            return [(tag, head)] + (rest or [])
        if kind in (STRSXP, VECSXP, INTSXP, LGLSXP, REALSXP):
            n = self.int()
            if kind in (STRSXP, VECSXP):
                values = [self.item() for _ in range(n)]
            elif kind == REALSXP:
                values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
                self.pos += 8 * n
            else:
                values = [self.int() for _ in range(n)]
            attributes = dict(self.item()) if has_attr else {}
            return {"values": values, "attributes": attributes}
        raise ValueError(f"R serialization type {kind} is not handled")


def read_object(data_dir: Path, name: str) -> list[str | None]:
    """The character vector ``name`` of the lazy-load database in ``data_dir``."""
    index = RUnserializer(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).item()
    fields = dict(zip(index["attributes"][("symbol", "names")]["values"], index["values"]))
    variables = fields["variables"]
    names = variables["attributes"][("symbol", "names")]["values"]
    if name not in names:
        raise SystemExit(f"error: no object {name!r} in {data_dir}; objects: {', '.join(names)}")
    offset, length = (int(x) for x in variables["values"][names.index(name)]["values"])
    record = (data_dir / "Rdata.rdb").read_bytes()[offset:offset + length]
    (size,) = struct.unpack_from(">I", record)
    raw = zlib.decompress(record[4:])
    if len(raw) != size:
        raise SystemExit(f"error: {name}: {len(raw)} bytes decompressed, the record says {size}")
    return RUnserializer(raw).item()["values"]


def novel_text(lines: list[str | None]) -> str:
    """The novel as one text: its lines joined, outer blank lines dropped, one final newline."""
    return "\n".join(line or "" for line in lines).strip() + "\n"


def write_gzip(path: Path, text: str) -> None:
    """``text`` gzipped at level 9 with no file name and mtime 0, so a rebuild gives the same bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("deb", type=Path, help="r-cran-janeaustenr_*.deb (apt-get download r-cran-janeaustenr)")
    parser.add_argument("novel", choices=[*NOVELS, "all"], help="one novel, or all six (out is then a directory)")
    parser.add_argument("out", type=Path, help="the text file, or with `all` the directory of <novel>.txt.gz")
    args = parser.parse_args(argv)
    names = NOVELS if args.novel == "all" else (args.novel,)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
        texts = {name: novel_text(read_object(Path(tmp) / DATA_DIR, name)) for name in names}
    if args.novel != "all":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(texts[args.novel], encoding="utf-8")
        print(f"{args.out}: {texts[args.novel].count(chr(10))} lines, {args.out.stat().st_size} bytes", file=sys.stderr)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        path = args.out / f"{name}.txt.gz"
        write_gzip(path, text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        print(f"{name}: {path} {path.stat().st_size} bytes, text sha256 {digest}")


if __name__ == "__main__":
    main()
