"""A ``multipart/form-data`` body (RFC 7578) as its parts, for ``POST /v1/files``: each field's name, its filename
(a file part's) and its bytes. The whole body is in memory already (its size bounded by ``jobs.max_file_bytes``);
splitting it on its boundary is a few C-level scans, with no parser package to depend on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value

from inferd.api.errors import APIError

_BOUNDARY = re.compile(r"^[0-9A-Za-z'()+_,\-./:=? ]{1,70}$")
# What browsers and httpx escape in a quoted filename (the HTML standard's multipart encoding): '"', CR and LF.
_ESCAPED = {"%22": '"', "%0D": "\r", "%0A": "\n", "%0d": "\r", "%0a": "\n"}


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None
    data: bytes


def _params(header: str) -> Message:
    message = Message()
    message["content-type"] = header
    return message


def _bad(message: str) -> APIError:
    return APIError(400, message, "invalid_multipart")


def boundary_of(content_type: str) -> bytes:
    message = _params(content_type)
    if message.get_content_type() != "multipart/form-data":
        raise _bad("send the file as multipart/form-data (fields: file, purpose)")
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not _BOUNDARY.match(boundary):
        raise _bad("the multipart/form-data body has no valid boundary")
    return boundary.encode("ascii")


def parts(body: bytes, content_type: str) -> dict[str, Part]:
    """The body's parts by field name (a name sent twice: the first); APIError 400 for a body that is not one."""
    delimiter = b"--" + boundary_of(content_type)
    pieces = body.split(delimiter)
    if len(pieces) < 3 or not pieces[-1].startswith(b"--"):
        raise _bad("the multipart/form-data body is cut short (no closing boundary)")
    found: dict[str, Part] = {}
    for piece in pieces[1:-1]:
        if not piece.startswith(b"\r\n") or not piece.endswith(b"\r\n"):
            raise _bad("a part of the multipart/form-data body is malformed")
        head, sep, data = piece[2:-2].partition(b"\r\n\r\n")
        if not sep:
            raise _bad("a part of the multipart/form-data body has no header end")
        disposition = next((line.split(b":", 1)[1].strip().decode("utf-8", "replace")
                            for line in head.split(b"\r\n") if line.lower().startswith(b"content-disposition:")), None)
        if disposition is None:
            raise _bad("a part of the multipart/form-data body has no Content-Disposition")
        header = _params(f"form-data; {disposition.partition(';')[2]}")
        name = header.get_param("name", header="content-type")
        if not isinstance(name, str):
            raise _bad("a part of the multipart/form-data body has no name")
        found.setdefault(name, Part(name, filename_of(header), data))
    return found


def filename_of(header: Message) -> str | None:
    """A part's filename: RFC 5987's ``filename*`` first (UTF-8, percent-encoded), else ``filename`` with the HTML
    standard's escapes undone; None when neither is given or it is empty."""
    extended = header.get_param("filename*", header="content-type")
    if extended is not None:
        value = collapse_rfc2231_value(extended) if isinstance(extended, tuple) else None
        if value:
            return value
    plain = header.get_param("filename", header="content-type")
    if isinstance(plain, tuple):  # RFC 2231 continuations
        plain = collapse_rfc2231_value(plain)
    if not isinstance(plain, str) or not plain:
        return None
    return re.sub(r"%(22|0[DdAa])", lambda m: _ESCAPED[m.group(0)], plain)
