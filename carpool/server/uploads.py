"""``POST /v1/files``: a multipart upload read into one file of the store, or a 4xx saying why.

The form is OpenAI's: a ``file`` part and a ``purpose`` field.  Whatever comes instead is
refused before the store records anything, and leaves no bytes behind: a second ``file``
part (which file would it be?), a ``purpose`` past a few dozen bytes or not UTF-8, a file
name that no file system or JSON reader takes (control characters, NUL, text that is not
UTF-8, past 255 characters), a file past the size limit.  A disk that refuses the bytes is
a 507 (full) or 503 (read-only, failing), never a 500.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import BodyPartReader, MultipartReader
from aiohttp.http_exceptions import HttpProcessingError

from carpool.errors import OpenAIError
from carpool.server.batch_disk import BatchDisk

_CHUNK = 1 << 20
MAX_FILENAME_CHARS = 255  # what common file systems take for one name
_MAX_PURPOSE_BYTES = 64
_DEFAULT_NAME = "upload.jsonl"


@dataclass
class Upload:
    """What the form held: the received file (None until its part came) and the purpose."""

    path: Path | None = None
    filename: str = _DEFAULT_NAME
    purpose: str | None = None
    staged: list[Path] = field(default_factory=list)  # every file this upload created

    def discard(self) -> None:
        for p in self.staged:
            p.unlink(missing_ok=True)


def disk_error(e: OSError) -> OpenAIError:
    """An upload or write the disk refused, as the status a client can act on."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OpenAIError(507, f"the server's disk is full ({e.strerror}); retry later", type="server_error",
                           code="insufficient_storage")
    return OpenAIError(503, f"the server cannot store files now ({e.strerror or e}); retry later",
                       type="server_error", code="storage_unavailable")


def check_filename(name: str | None) -> str:
    if name is None:
        return _DEFAULT_NAME
    try:
        name.encode("utf-8")
        text = True
    except UnicodeEncodeError:  # bytes that were not UTF-8, kept as lone surrogates
        text = False
    if not text or len(name) > MAX_FILENAME_CHARS or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise OpenAIError(400, f"The file name must be UTF-8 text of at most {MAX_FILENAME_CHARS} characters "
                          "without control characters.", param="file", code="invalid_file_name")
    return name or _DEFAULT_NAME


async def read_form(reader: MultipartReader, disk: BatchDisk, staging: Path, most: int) -> Upload:
    """Read the whole form; ``staging``: where the file goes (removed on any refusal)."""
    up = Upload()
    try:
        while (part := await _next_part(reader)) is not None:
            if not isinstance(part, BodyPartReader):
                raise OpenAIError(400, "a nested multipart part is not a form field", param="file")
            if part.name == "purpose":
                up.purpose = await _small_text(part)
            elif part.name == "file":
                if up.path is not None:
                    raise OpenAIError(400, "The form holds more than one 'file' part; upload one file per request.",
                                      param="file")
                up.filename = check_filename(part.filename)
                up.staged.append(staging)
                await _receive(part, disk, staging, most)
                up.path = staging
    except BaseException:
        up.discard()
        raise
    return up


async def _next_part(reader: MultipartReader) -> object | None:
    """The next part, or a 400 when its headers are malformed (a NUL, a line past the limit)."""
    try:
        return await reader.next()
    except (HttpProcessingError, ValueError) as e:
        reason = getattr(e, "message", None) or str(e)
        raise OpenAIError(400, f"The multipart form is malformed: {reason}", param="file",
                          code="invalid_multipart") from None


async def _small_text(part: BodyPartReader) -> str:
    raw = b""
    while len(raw) <= _MAX_PURPOSE_BYTES and (chunk := await part.read_chunk(_MAX_PURPOSE_BYTES + 1 - len(raw))):
        raw += chunk
    if len(raw) > _MAX_PURPOSE_BYTES:
        raise OpenAIError(400, "'purpose' is too long.", param="purpose")
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise OpenAIError(400, "'purpose' is not UTF-8 text.", param="purpose") from None


async def _receive(part: BodyPartReader, disk: BatchDisk, path: Path, most: int) -> None:
    """Stream one uploaded file to ``path`` (fsync'd), refusing it past ``most`` bytes."""
    size = 0
    try:
        f = disk.create(path)
        try:
            while chunk := await part.read_chunk(_CHUNK):
                size += len(chunk)
                if size > most:
                    raise OpenAIError(413, f"File is too large: past the limit of {most:,} bytes "
                                      "(--batch-max-file-mb); split it.", param="file", code="file_too_large")
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
    except OSError as e:
        raise disk_error(e) from None
