"""The two HTTP/1.1 messages the exporter deals in: a GET request's head, and an answer
with a body of known length. No request of ours has a body, so none is read."""

from __future__ import annotations

from dataclasses import dataclass

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    keep_alive: bool
    gzip: bool


def parse_request(head: bytes) -> Request | int:
    """The request in ``head`` (request line and headers), or the error status to answer."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400
    method, target, version = parts
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return 400
        headers[name.lower()] = value.strip().lower()
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        return 400  # no request of ours has a body; not reading one keeps the stream simple
    tokens = {t.strip() for t in headers.get("connection", "").split(",")}
    return Request(method, target.split("?", 1)[0],
                   keep_alive=version == "HTTP/1.1" and "close" not in tokens,
                   gzip="gzip" in headers.get("accept-encoding", ""))


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    keep_alive: bool
    content_type: str = "text/plain; charset=utf-8"
    gzipped: bool = False

    def encode(self) -> bytes:
        head = [f"HTTP/1.1 {self.status} {REASONS[self.status]}",
                f"Content-Type: {self.content_type}", f"Content-Length: {len(self.body)}"]
        if self.gzipped:
            head.append("Content-Encoding: gzip")
        if self.status == 405:
            head.append("Allow: GET")
        if not self.keep_alive:
            head.append("Connection: close")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body
