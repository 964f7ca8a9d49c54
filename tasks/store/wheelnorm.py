"""Rewrite a wheel so its zip bytes depend only on its contents.

Entries sorted (``.dist-info`` last, ``RECORD`` at the very end), every
timestamp set from ``SOURCE_DATE_EPOCH``, permissions reduced to 0644/0755,
directory entries dropped, ``RECORD`` regenerated. The stdlib's zipfile is all
this needs.

Where the build stage asks, ``METADATA`` gains ``Requires-Dist`` lines before
the wheel is written (the torch a torch extension was compiled against, see
:func:`pin_requirements`): the lines go after the header's last one, so the
same wheel and the same lines give the same bytes, and ``RECORD`` hashes the
edited file.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

DEFAULT_EPOCH = 315532800  # 1980-01-01, the earliest time a zip can hold


def epoch_from_env() -> int:
    raw = os.environ.get("SOURCE_DATE_EPOCH", "")
    return max(int(raw), DEFAULT_EPOCH) if raw.isdigit() else DEFAULT_EPOCH


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _order(name: str) -> tuple[int, str]:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return (2, name) if name.endswith("/RECORD") else (1, name)
    return (0, name)


def add_requirements(metadata: bytes, requires: Sequence[str]) -> bytes:
    """``METADATA`` with ``Requires-Dist: <line>`` for each of ``requires`` not there yet, at the header's end.

    The header ends at the first empty line (the description follows it, RFC 822 style); a line already
    present, character for character, is not repeated.
    """
    text = metadata.decode("utf-8")
    head, sep, body = text.partition("\n\n")
    lines = head.rstrip("\n").split("\n")
    present = {line.strip() for line in lines}
    new = [f"Requires-Dist: {r}" for r in requires if f"Requires-Dist: {r}" not in present]
    if not new:
        return metadata
    return ("\n".join([*lines, *new]) + (sep + body if sep else "\n")).encode("utf-8")


def normalize_wheel(src: Path, dest: Path, epoch: int | None = None, *, requires: Sequence[str] = ()) -> None:
    """Write the normalised form of wheel ``src`` to ``dest``, with ``requires`` added to its Requires-Dist."""
    stamp = time.gmtime(max(epoch if epoch is not None else epoch_from_env(), DEFAULT_EPOCH))[:6]
    with zipfile.ZipFile(src) as zin:
        members = [i for i in zin.infolist() if not i.is_dir()]
        record_name = next(
            (i.filename for i in members if i.filename.endswith(".dist-info/RECORD") and i.filename.count("/") == 1),
            None,
        )
        if record_name is None:
            raise ValueError(f"{src}: not a wheel (no .dist-info/RECORD)")
        files = sorted(
            (
                i
                for i in members
                if i.filename != record_name
                and not i.filename.endswith(".jws")
                and not i.filename.endswith("RECORD.p7s")
            ),
            key=lambda i: _order(i.filename),
        )
        lines: list[tuple[str, str, str]] = []
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
                for info in files:
                    data = zin.read(info)
                    if requires and info.filename == record_name.rsplit("/", 1)[0] + "/METADATA":
                        data = add_requirements(data, requires)
                    mode = (info.external_attr >> 16) & 0o777
                    out = zipfile.ZipInfo(info.filename, date_time=stamp)
                    out.compress_type = zipfile.ZIP_DEFLATED
                    out.external_attr = (0o100755 if mode & 0o111 else 0o100644) << 16
                    out.create_system = 3
                    zout.writestr(out, data, compresslevel=6)
                    lines.append((info.filename, _record_hash(data), str(len(data))))
                lines.append((record_name, "", ""))
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(lines)
                record = buf.getvalue().encode()
                out = zipfile.ZipInfo(record_name, date_time=stamp)
                out.compress_type = zipfile.ZIP_DEFLATED
                out.external_attr = 0o100644 << 16
                out.create_system = 3
                zout.writestr(out, record, compresslevel=6)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
