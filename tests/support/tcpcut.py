"""A TCP proxy on a free loopback port that can be cut: while cut, open connections are
closed and new ones refused (what a network partition between one client and its server
looks like to that client; the server stays up for everyone else)."""

from __future__ import annotations

import socket
import threading


class TcpCut:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._srv: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.port = 0
        self.open()

    def open(self) -> None:
        """Listen (on the same port after a :meth:`cut`) and forward."""
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(16)
        self.port = srv.getsockname()[1]
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Close the port and every connection through it."""
        if self._srv is not None:
            try:
                self._srv.shutdown(socket.SHUT_RDWR)   # wakes the accept (close does not)
            except OSError:
                pass
            self._srv.close()
            self._srv = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.cut()
