"""A one-connection HTTP server on loopback that answers from a script. A helper module: tests
import it, never each other."""

from __future__ import annotations

import socket


def scripted_server(answers: list[bytes]) -> tuple[int, list[bytes]]:
    """A one-connection server on loopback that sends `answers` in turn, one per request read;
    returns its port and the requests it read."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            for answer in answers:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += connection.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                while len(body) < length:
                    body += connection.recv(65536)
                seen.append(head + b"\r\n\r\n" + body)
                connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], seen
