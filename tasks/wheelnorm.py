"""Rewrite a wheel so its zip bytes depend only on its contents.

Entries sorted (``.dist-info`` last, ``RECORD`` at the very end), every
timestamp set from ``SOURCE_DATE_EPOCH``, permissions reduced to 0644/0755,
directory entries dropped, ``RECORD`` regenerated. The stdlib's zipfile is all
this needs.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import time
import zipfile
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


def normalize_wheel(src: Path, dest: Path, epoch: int | None = None) -> None:
    """Write the normalised form of wheel ``src`` to ``dest``."""
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
